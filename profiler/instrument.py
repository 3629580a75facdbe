"""What the measured run times, by wrapping (patches.py) the parts a decode step calls:

- the model: the embedding, each layer's attention (with its input norm) and feed-forward block (with its norm
  and the residual adds, which it evaluates), the final norm and the LM head;
- the cache: a forward (by positions);
- the speculative engine: planning, prompt lookup, the fast stream's drafting, its adapters and draft head, a
  verification (by positions: its forward, acceptance (``verify``) and the cache keeping the accepted prefix);
- early exit: the exit head and the exit decision (ARLA or confidence);
- sampling everywhere, and an expert cache's loads (the forward pass's stall).

Each wrapped call evaluates its result (spans.timed): the unmeasured run has none of this.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from m2r2_mlx.decoding import generate, speculative
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.models.base_model import BaseParts

from .patches import Patches
from .spans import Recorder, timed
from .weights import Footprint, block, dense, embedding, kv_bytes_per_position

ATTENTION = ("self_attn", "attention", "attn")
FEED_FORWARD = ("mlp", "block_sparse_moe", "feed_forward")


@dataclass(frozen=True)
class Target:
    model: object  # the mlx-lm model
    decoder: object  # a Decoder (decoding/protocols.py)
    cache: object  # the PromptCache the measured run decodes into
    experts: object | None = None  # an ExpertCache when the model runs within a memory budget


def positions(x) -> int:
    """Positions in a call's input: hidden states (B, T, D) or token ids (B, T) or (T,)."""
    shape = getattr(x, "shape", None)
    if shape is None:
        return len(x)
    return int(shape[0] * shape[1]) if len(shape) >= 3 else int(x.size)


def _child(layer, names: tuple[str, ...]):
    return next((layer[n] for n in names if n in layer), None)


def _fixed(fp: Footprint):
    return lambda args, kwargs: fp.cost(positions(args[0]))


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


def _model(p: Patches, rec: Recorder, model) -> None:
    parts = BaseParts(model)
    inner, hidden = parts.inner, parts.hidden_size
    p.method(
        inner.embed_tokens,
        "__call__",
        lambda f: timed(rec, f, "embed", "embedding", cost=_fixed(embedding(inner.embed_tokens))),
    )
    head = inner.embed_tokens if parts.tied else model.lm_head
    head_cost = _fixed(dense(head))
    p.method(
        head, "as_linear" if parts.tied else "__call__", lambda f: timed(rec, f, "head", "LM head", cost=head_cost)
    )
    p.method(inner.norm, "__call__", lambda f: timed(rec, f, "head", "final norm", cost=_fixed(dense(inner.norm))))
    for i, layer in enumerate(parts.layers):
        attn, ff = _child(layer, ATTENTION), _child(layer, FEED_FORWARD)
        if attn is None or ff is None:
            raise M2R2Error(
                f"layer {i} ({type(layer).__name__}) has no attention ({'/'.join(ATTENTION)}) or feed-forward block "
                f"({'/'.join(FEED_FORWARD)}) to time; m2r2-profile knows mlx-lm's decoders (llama, phi3, olmoe, ...)"
            )
        cost = _Attention(dense(attn), hidden)
        p.method(attn, "__call__", lambda f, i=i, c=cost: timed(rec, f, "attention", f"attention L{i + 1}", i, c))
        fp = _fixed(block(ff))
        p.method(ff, "__call__", lambda f, i=i, c=fp: timed(rec, f, "mlp", f"feed-forward L{i + 1}", i, c))


def _m2r2(p: Patches, rec: Recorder, m2r2) -> None:
    """The fast stream's own weights: its bottleneck adapters and context feature (LoRA deltas run inside the
    layers' projections, and are timed with them)."""
    for i, adapter in enumerate(m2r2.adapters):
        cost = _fixed(dense(adapter))
        p.method(adapter, "__call__", lambda f, i=i, c=cost: timed(rec, f, "adapter", f"adapter L{i + 1}", i, c))
    context = getattr(m2r2, "context", None)
    if context is not None:
        p.method(
            context, "__call__", lambda f: timed(rec, f, "adapter", "context feature", cost=_fixed(dense(context)))
        )


def _subset_head(p: Patches, rec: Recorder, head, kind: str) -> None:
    weight = getattr(head, "weight", None)
    cost = _fixed(Footprint(weight.nbytes, weight.size)) if weight is not None else None
    p.method(head, "__call__", lambda f: timed(rec, f, kind, kind.replace("-", " "), cost=cost))


def _speculator(p: Patches, rec: Recorder, engine) -> None:
    planner = engine.planner
    plan = lambda a, k, out: {"positions": len(a[0]), "plain": out.plain}
    p.attribute(planner, "plan", timed(rec, planner.plan, "plan", "plan", note=plan))
    p.attribute(planner, "observe", timed(rec, planner.observe, "plan", "observe"))
    size = lambda a, k: f"verify {len(a[1])}"
    p.attribute(engine, "verify_step", timed(rec, engine.verify_step, "verify", size, note=_verified))
    for drafter in engine.free:
        p.attribute(drafter, "propose", timed(rec, drafter.propose, "lookup", "prompt lookup"))
    layer = engine.model_drafter
    if layer is not None:
        steps = lambda a, k, n: {"draft_steps": n}
        p.attribute(layer, "propose", timed(rec, layer.propose, "draft", f"draft {layer.name}", note=steps))
        if layer.head is not None:
            _subset_head(p, rec, layer.head, "draft-head")
        _m2r2(p, rec, layer.m2r2)


def _early_exit(p: Patches, rec: Recorder, decoder) -> None:
    policy = decoder.policy
    if policy.exit_head is not None:
        _subset_head(p, rec, policy.exit_head, "exit-head")
    p.attribute(decoder, "policy", replace(policy, rule=timed(rec, policy.rule, "exit-rule", "exit decision")))
    _m2r2(p, rec, decoder.m2r2)


def _sampler_class(rec: Recorder, cls):
    class Profiled(cls):
        def __call__(self, logits):
            return timed(rec, super().__call__, "sample", "sampling")(logits)

    Profiled.__name__ = Profiled.__qualname__ = cls.__name__
    return Profiled


def _sampling(p: Patches, rec: Recorder) -> None:
    """The sampling the decoding loops call by name (their modules' globals): every mode's NextToken is made in
    generate (start_decoding) or in speculative (a plain stretch)."""
    for module in (generate, speculative):
        p.attribute(module, "NextToken", _sampler_class(rec, module.NextToken))
    note = lambda a, k, out: {"accepted": out.accepted}
    p.attribute(speculative, "verify", timed(rec, speculative.verify, "accept", "acceptance", note=note))


def _cache(p: Patches, rec: Recorder, cache) -> None:
    count = lambda a, k: f"forward {positions(a[0])}"
    p.attribute(cache, "forward", timed(rec, cache.forward, "forward", count))


def _verified(args: tuple, kwargs: dict, out) -> dict:
    return {"positions": len(args[1])}


def instrument(recorder: Recorder, target: Target) -> Patches:
    """Wrap everything the target's decode steps call; ``restore()`` (or leaving ``with``) undoes it all."""
    p = Patches()
    try:
        _model(p, recorder, target.model)
        _cache(p, recorder, target.cache)
        _sampling(p, recorder)
        decoder = target.decoder
        if hasattr(decoder, "planner"):
            _speculator(p, recorder, decoder)
        elif hasattr(decoder, "policy") and hasattr(decoder, "m2r2"):
            _early_exit(p, recorder, decoder)
        if target.experts is not None:
            ensure = target.experts.ensure
            p.attribute(target.experts, "ensure", timed(recorder, ensure, "expert-stall", "expert loads"))
    except BaseException:
        p.restore()
        raise
    return p
