"""What the measured run times, through hooks the engine offers and module swaps mlx-lm's own tools use:

- the engine's phases, through its tracer (m2r2_mlx/tracing.py): sampling, each cache forward (by positions),
  planning, prompt lookup, the fast stream's drafting and its draft head, a verification (by positions: its forward,
  acceptance and the cache keeping the accepted prefix), early exit's exit head and exit decision, and an expert
  cache's waits for loads (the forward pass's stall);
- the model, by swapping its modules for ``Timed`` stand-ins (``update_modules``, as mlx-lm's LoRA tuner swaps
  layers): the embedding, each layer's attention (with its input norm) and feed-forward block (with its norm and
  the residual adds, which it evaluates), the final norm and the LM head, and the fast stream's adapters.

Each timed call evaluates its result (spans.timed): the unmeasured run has none of this.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.models.base_model import BaseParts
from m2r2_mlx.tracing import Tracer

import mlx.nn as nn
from mlx.utils import tree_unflatten

from .spans import Recorder, timed
from .weights import Footprint, block, dense, embedding, kv_bytes_per_position

ATTENTION = ("self_attn", "attention", "attn")
FEED_FORWARD = ("mlp", "block_sparse_moe", "feed_forward")


def positions(x) -> int:
    """Positions in a call's input: hidden states (B, T, D) or token ids (B, T) or (T,)."""
    shape = getattr(x, "shape", None)
    if shape is None:
        return len(x)
    return int(shape[0] * shape[1]) if len(shape) >= 3 else int(x.size)


def _fixed(fp: Footprint):
    return lambda args, kwargs: fp.cost(positions(args[0]))


def _head_cost(head) -> Callable | None:
    """A vocabulary-subset head's cost: the rows it gathered once (a quantized head reads the whole one)."""
    weight = getattr(head, "weight", None)
    return _fixed(Footprint(weight.nbytes, weight.size)) if weight is not None else None


class _Attention:
    """An attention call's cost: its weights, every earlier position's keys and values, and its FLOPs."""

    def __init__(self, fp: Footprint, hidden: int):
        self.fp, self.hidden, self.per_position = fp, hidden, 0

    def __call__(self, args: tuple, kwargs: dict) -> tuple[int, int]:
        x = args[0]
        cache = args[2] if len(args) > 2 else kwargs.get("cache")
        context = int(getattr(cache, "offset", 0) or 0) if cache is not None else 0
        if not self.per_position and cache is not None:
            self.per_position = kv_bytes_per_position(cache)
        read, flops = self.fp.cost(positions(x))
        rows, new = (int(x.shape[0]), int(x.shape[1])) if x.ndim >= 3 else (1, 1)
        return read + context * self.per_position, flops + 4 * rows * new * (context + new) * self.hidden


class ProfileTracer(Tracer):
    """The engine's phases as spans of ``recorder`` (while it is on); one tracer serves a whole profile, each
    measured run handing it its recorder (``use``)."""

    # tracer kind -> (span kind, span name or name(fn, args), trace arguments note(args, kwargs, result) or None)
    PHASES: dict = {
        "sample": ("sample", "sampling", None),
        "forward": ("forward", lambda fn, a: f"forward {positions(a[0])}", None),
        "propose": ("lookup", "prompt lookup", None),
        "plan": ("plan", "plan", lambda a, k, out: {"positions": len(a[0]), "plain": out.plain}),
        "observe": ("plan", "observe", None),
        "draft": ("draft", lambda fn, a: f"draft {fn.__self__.name}", lambda a, k, n: {"draft_steps": n}),
        "verify": ("verify", lambda fn, a: f"verify {len(a[1])}", lambda a, k, out: {"positions": len(a[1])}),
        "accept": ("accept", "acceptance", lambda a, k, out: {"accepted": out.accepted}),
        "draft-head": ("draft-head", "draft head", None),
        "exit-head": ("exit-head", "exit head", None),
        "exit-rule": ("exit-rule", "exit decision", None),
        "expert-stall": ("expert-stall", "expert loads", None),
    }

    def __init__(self):
        self.recorder = Recorder()

    def use(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def call(self, kind, fn, *args, **kwargs):
        phase = self.PHASES.get(kind)
        if phase is None or not self.recorder.on:
            return fn(*args, **kwargs)
        span_kind, name, note = phase
        cost = _head_cost(fn) if kind in ("draft-head", "exit-head") else None
        label = name(fn, args) if callable(name) else name
        return timed(self.recorder, fn, span_kind, label, cost=cost, note=note)(*args, **kwargs)


class Timed(nn.Module):
    """A module's stand-in while it is profiled: the methods named in ``spans`` (name -> (kind, label, layer,
    cost)) run as spans of the tracer's recorder; every other attribute is the module's own."""

    def __init__(self, module: nn.Module, tracer: ProfileTracer, spans: dict[str, tuple]):
        super().__init__()
        self.module = module  # a child: the parameter tree keeps its weights
        self.timing = _Spans(tracer, spans)

    def __getattr__(self, key: str):
        if key in self:
            return self[key]
        if "module" not in self:
            raise AttributeError(key)
        return getattr(self["module"], key)

    def __call__(self, *args, **kwargs):
        return self.timing.run("__call__", self.module, *args, **kwargs)

    def as_linear(self, x):
        return self.timing.run("as_linear", self.module.as_linear, x)


class _Spans:
    def __init__(self, tracer: ProfileTracer, spans: dict[str, tuple]):
        self.tracer, self.spans = tracer, spans

    def run(self, method: str, fn, *args, **kwargs):
        recorder = self.tracer.recorder
        if method not in self.spans or not recorder.on:
            return fn(*args, **kwargs)
        kind, label, layer, cost = self.spans[method]
        return timed(recorder, fn, kind, label, layer, cost)(*args, **kwargs)


def _child(layer, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in layer), None)


def _model_swaps(model, tracer: ProfileTracer) -> list[tuple[str, nn.Module]]:
    """(path, stand-in) for each timed module of an mlx-lm decoder."""
    parts = BaseParts(model)
    inner, hidden = parts.inner, parts.hidden_size
    embed = {"__call__": ("embed", "embedding", None, _fixed(embedding(inner.embed_tokens)))}
    if parts.tied:
        embed["as_linear"] = ("head", "LM head", None, _fixed(dense(inner.embed_tokens)))
    swaps = [("model.embed_tokens", Timed(inner.embed_tokens, tracer, embed))]
    if not parts.tied:
        head = {"__call__": ("head", "LM head", None, _fixed(dense(model.lm_head)))}
        swaps.append(("lm_head", Timed(model.lm_head, tracer, head)))
    norm = {"__call__": ("head", "final norm", None, _fixed(dense(inner.norm)))}
    swaps.append(("model.norm", Timed(inner.norm, tracer, norm)))
    for i, layer in enumerate(parts.layers):
        attn, ff = _child(layer, ATTENTION), _child(layer, FEED_FORWARD)
        if attn is None or ff is None:
            raise M2R2Error(
                f"layer {i} ({type(layer).__name__}) has no attention ({'/'.join(ATTENTION)}) or feed-forward block "
                f"({'/'.join(FEED_FORWARD)}) to time; m2r2-profile knows mlx-lm's decoders (llama, phi3, olmoe, ...)"
            )
        cost = _Attention(dense(layer[attn]), hidden)
        swaps.append(
            (
                f"model.layers.{i}.{attn}",
                Timed(layer[attn], tracer, {"__call__": ("attention", f"attention L{i + 1}", i, cost)}),
            )
        )
        ff_span = {"__call__": ("mlp", f"feed-forward L{i + 1}", i, _fixed(block(layer[ff])))}
        swaps.append((f"model.layers.{i}.{ff}", Timed(layer[ff], tracer, ff_span)))
    return swaps


def _m2r2_swaps(m2r2, tracer: ProfileTracer) -> list[tuple[str, nn.Module]]:
    """The fast stream's own weights: its bottleneck adapters and context feature (LoRA deltas run inside the
    layers' projections, and are timed with them)."""
    swaps = []
    for i, adapter in enumerate(m2r2.adapters):
        span = {"__call__": ("adapter", f"adapter L{i + 1}", i, _fixed(dense(adapter)))}
        swaps.append((f"adapters.{i}", Timed(adapter, tracer, span)))
    context = getattr(m2r2, "context", None)
    if context is not None:
        swaps.append(
            (
                "context",
                Timed(context, tracer, {"__call__": ("adapter", "context feature", None, _fixed(dense(context)))}),
            )
        )
    return swaps


def m2r2_of(decoder):
    """The M2R2 model a decoder runs (the fast drafter's or early exit's), or None."""
    drafter = getattr(decoder, "model_drafter", None)
    if drafter is not None and getattr(drafter, "adapters", False):
        return drafter.m2r2
    return getattr(decoder, "m2r2", None)


@contextmanager
def swapped(root: nn.Module, swaps: list[tuple[str, nn.Module]]) -> Iterator[None]:
    """``root`` with the modules at ``swaps``' paths replaced by their stand-ins, restored on leaving."""
    originals = [(path, stand_in.module) for path, stand_in in swaps]
    root.update_modules(tree_unflatten(swaps))
    try:
        yield
    finally:
        root.update_modules(tree_unflatten(originals))


@contextmanager
def instrument(tracer: ProfileTracer, model, decoder) -> Iterator[None]:
    """Time the modules ``decoder``'s steps run (the model's, and its M2R2 adapters'); restored on leaving."""
    with swapped(model, _model_swaps(model, tracer)):
        m2r2 = m2r2_of(decoder)
        if m2r2 is None:
            yield
            return
        with swapped(m2r2, _m2r2_swaps(m2r2, tracer)):
            yield
