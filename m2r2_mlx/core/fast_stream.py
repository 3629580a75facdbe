"""The multi-rate residual model: a frozen base (slow stream) and a fast stream with adapters.

In interval j = [g_(j-1), g_j) the fast stream restarts from the slow state at
g_(j-1), runs the same base layers plus one small adapter per layer, and at g_j
exits through the base model's final norm and LM head, trained to match the
final layer. Attention in the fast stream reads the slow stream's keys and
values for earlier positions (the KV cache is shared; the fast stream owns none)
and its own key/value for the current position only.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..models.base_model import BaseParts
from .arla import ARLA
from .lora import LoRASwitch, new_lora_deltas


class BottleneckAdapter(nn.Module):
    """A parallel bottleneck on the residual: delta = up(silu(down(rmsnorm(h)))); ``up`` starts at zero.

    Parallel to the whole block, so it needs no knowledge of the architecture's
    projections (fused qkv in phi3, experts in olmoe): one form serves every base.
    """

    def __init__(self, dims: int, rank: int):
        super().__init__()
        self.norm = nn.RMSNorm(dims)
        self.down = nn.Linear(dims, rank, bias=False)
        self.up = nn.Linear(rank, dims, bias=False)
        self.up.weight = mx.zeros_like(self.up.weight)

    def __call__(self, h: mx.array) -> mx.array:
        return self.up(nn.silu(self.down(self.norm(h))))


class ContextFeature(nn.Module):
    """The previous position's final residual, projected into the first interval's start: delta =
    proj(rmsnorm(h_final at t-1)); ``proj`` starts at zero, so the stream starts as it was.

    The first interval starts from the token's embedding alone and sees the context only through
    the slow stream's keys and values of layers 0..g_1-1, shallow features; the previous position's
    final state is the deepest summary of the context there is (EAGLE drafts from it). At decode time
    it is free: the verifying forward computed it (or the drafter's own exit, for a second draft on).
    """

    def __init__(self, dims: int):
        super().__init__()
        self.norm = nn.RMSNorm(dims)
        self.proj = nn.Linear(dims, dims, bias=False)
        self.proj.weight = mx.zeros_like(self.proj.weight)
        # A fixed output scale: Adam moves every weight of ``proj`` by ~lr a step, which moves its output by
        # ~lr * dims, many times an embedding's size (SmolLM2's RMS is 0.12): at scale 1 the first interval's
        # loss doubled within ten steps of lr 1e-3.
        self.scale = dims**-0.5

    def __call__(self, h_prev: mx.array) -> mx.array:
        return self.scale * self.proj(self.norm(h_prev))


class SlowKVView:
    """The fast stream's window onto one layer's slow KV cache at decode time.

    ``update_and_fetch`` returns the slow keys/values of earlier positions with the
    fast stream's own for the new positions appended, and stores nothing.
    """

    def __init__(self, cache, shift: int = 0):
        self.cache, self.shift = cache, shift  # shift: positions missing from this layer's cache (deferred fill)

    @property
    def offset(self) -> int:
        return self.cache.offset + self.shift

    def make_mask(self, *args, **kwargs):
        return self.cache.make_mask(*args, **kwargs)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = self.cache.offset
        if n == 0 or self.cache.keys is None:
            return keys, values
        past_k, past_v = self.cache.keys[..., :n, :], self.cache.values[..., :n, :]
        return mx.concatenate([past_k, keys], axis=2), mx.concatenate([past_v, values], axis=2)


class FusedKV:
    """A layer's cache when the slow chunk (batch row 0) and one fast-stream token (row 1) share a pass.

    Row 0's keys/values are stored as any slow forward stores them. Row 1 sees the same
    earlier positions (the cache plus the chunk's earlier tokens, slow) and its own fast
    key/value at the last position, never the slow twin of itself: what SlowKVView gives
    a fast token, read in the pass that reads the layer's weights for the slow chunk anyway.
    Row 1 is left-padded to the chunk's length, so its last position is the new token's.
    """

    def __init__(self, cache):
        self.cache = cache

    @property
    def offset(self) -> int:
        return self.cache.offset

    def make_mask(self, *args, **kwargs):
        return self.cache.make_mask(*args, **kwargs)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        k0, v0 = self.cache.update_and_fetch(keys[:1], values[:1])
        k1 = mx.concatenate([k0[..., :-1, :], keys[1:, :, -1:]], axis=2)
        v1 = mx.concatenate([v0[..., :-1, :], values[1:, :, -1:]], axis=2)
        return mx.concatenate([k0, k1], axis=0), mx.concatenate([v0, v1], axis=0)


class ParallelKV:
    """Training-time twin of SlowKVView over a whole sequence at once.

    Keys = [slow keys of all T positions | fast keys of all T positions]; with
    ``parallel_mask`` each fast query t sees slow keys < t and its own fast key,
    exactly what SlowKVView gives one decoded token.
    """

    offset = 0

    def __init__(self, slow_keys: mx.array, slow_values: mx.array):
        self.k, self.v = slow_keys, slow_values

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        return mx.concatenate([self.k, keys], axis=2), mx.concatenate([self.v, values], axis=2)


def shift_right(x: mx.array) -> mx.array:
    """Each position's previous entry along the sequence axis (B, T, ...), zeros (False) at a row's start."""
    return mx.concatenate([mx.zeros_like(x[:, :1]), x[:, :-1]], axis=1)


def parallel_mask(T: int) -> mx.array:
    i = mx.arange(T)[:, None]
    j = mx.arange(T)[None, :]
    return mx.concatenate([j < i, j == i], axis=1)


class M2R2Model(nn.Module):
    """Adapters (the only trainable weights) over a frozen mlx-lm base model."""

    def __init__(self, base_model, config):
        super().__init__()
        self.config = config
        self.parts = BaseParts(base_model)  # a plain attribute: the base is not part of our parameters
        fast = config.gates[-1]  # the fast stream runs layers 0..fast-1
        if config.adapter_form == "lora":
            self.adapters = []
            self.lora = new_lora_deltas(
                self.parts.layers[:fast], config.lora_targets, config.adapter_rank, config.lora_scale
            )
            self.lora_switch = LoRASwitch(self.parts.layers, self.lora)
        else:
            self.adapters = [BottleneckAdapter(config.hidden_size, r) for r in config.layer_ranks()]
            self.lora_switch = LoRASwitch(self.parts.layers, [])
        if config.context_feature:
            self.context = ContextFeature(config.hidden_size)
        self.exit_head = None  # SubsetHead exits are scored with (config.exit_vocab; None: the full head)
        if config.arla:
            self.arla = ARLA(config.hidden_size, config.arla_dim, len(config.gates), exit_stats=config.arla_exit_stats)

    @property
    def base(self):
        return self.parts.model

    def fast_layers(self, h: mx.array, start: int, stop: int, mask, views) -> mx.array:
        with self.lora_switch.active(start, stop):  # LoRA deltas exist only inside this block
            for i in range(start, stop):
                out = self.parts.layers[i](h, mask, cache=views[i])
                h = out + self.adapters[i](h) if self.adapters else out
        return h

    def fused_layer(self, i: int, slow: mx.array, fast: mx.array, cache) -> tuple[mx.array, mx.array]:
        """Layer i on the slow chunk (1, n, D) and one fast token (1, 1, D) in one pass (FusedKV):
        the fast check costs no extra read of the layer's weights. Bottleneck adapters only
        (a LoRA delta inside the layer would touch the slow row too)."""
        n = slow.shape[1]
        if n > 1:
            fast_row = mx.concatenate([mx.zeros((1, n - 1, fast.shape[-1]), dtype=fast.dtype), fast], axis=1)
        else:
            fast_row = fast
        out = self.parts.layers[i](
            mx.concatenate([slow, fast_row], axis=0), self.parts.mask(slow, cache), cache=FusedKV(cache)
        )
        return out[:1], out[1:, -1:] + self.adapters[i](fast)

    def start_state(self, gate_index: int, h_start: mx.array, h_prev: mx.array | None) -> mx.array:
        """The fast stream's state entering interval ``gate_index``: the slow state there, plus (first interval,
        with a context feature) the projected final residual of each token's previous position, ``h_prev``
        (same shape; None or zeros where there is none)."""
        if gate_index == 0 and h_prev is not None and getattr(self, "context", None) is not None:
            return h_start + self.context(h_prev)
        return h_start

    @property
    def can_fuse(self) -> bool:
        return bool(self.adapters)

    # ---- decode time -------------------------------------------------------------------
    def fast_exit_state(
        self,
        h_start: mx.array,
        gate_index: int,
        cache_layers,
        shift: dict | None = None,
        h_prev: mx.array | None = None,
    ) -> mx.array:
        """Fast-stream state at gate ``gate_index`` for new tokens whose slow state at the
        interval's start is ``h_start``; earlier positions come from ``cache_layers``
        (``shift[i]``: positions not yet in layer i's cache, as in early exit's deferred fill);
        ``h_prev``: each token's previous final residual, for a context feature (start_state)."""
        start, stop = self.config.intervals()[gate_index]
        views = {i: SlowKVView(cache_layers[i], (shift or {}).get(i, 0)) for i in range(start, stop)}
        mask = self.parts.mask(h_start, views[start])
        return self.fast_layers(self.start_state(gate_index, h_start, h_prev), start, stop, mask, views)

    def draft_logits(
        self,
        token: mx.array,
        gate_index: int,
        cache_layers,
        head=None,
        adapters: bool = True,
        h_prev: mx.array | None = None,
    ) -> mx.array:
        """Exit logits at a gate for one new token, for drafting (``draft_state`` through the LM head, or
        through ``head``, a SubsetHead restricting it to a vocabulary subset)."""
        h = self.draft_state(token, gate_index, cache_layers, adapters, h_prev)
        return self.parts.head(h) if head is None else head(h)

    def draft_state(
        self, token: mx.array, gate_index: int, cache_layers, adapters: bool = True, h_prev: mx.array | None = None
    ) -> mx.array:
        """The exit state (D,) at a gate for the last of new tokens (``token``: one id, or ids of a run of new
        positions, whose states before the last only write their keys and values).

        Layers below the interval run as the slow stream (their K/V are the real ones);
        the interval's layers run as the fast stream and write provisional K/V for the
        drafted positions, which verification trims and recomputes. ``h_prev``: the final
        residual of the position before each token (for a context feature; None: none; zeros: none for that
        token). ``adapters=False`` gives the naive exit of the slow state at the gate (layer-skip drafting
        without M2R2).
        """
        start, stop = self.config.intervals()[gate_index]
        h = self.parts.embed(token.reshape(1, -1))
        mask = "causal" if h.shape[1] > 1 else None
        h = self.parts.run_layers(h, 0, start, mask, cache_layers)
        if adapters:
            h = self.start_state(gate_index, h, None if h_prev is None else h_prev.reshape(h.shape))
            h = self.fast_layers(h, start, stop, mask, cache_layers)
        else:
            h = self.parts.run_layers(h, start, stop, mask, cache_layers)
        return h[0, -1]

    # ---- training time -----------------------------------------------------------------
    def slow_pass(self, ids: mx.array):
        """Frozen base over whole sequences: slow states at g_0 and every gate (and, with a context feature,
        under "prev" each position's previous final state), the final state, K/V."""
        parts, gates = self.parts, set(self.config.gates)
        cache = make_prompt_cache(self.base)
        h = parts.embed(ids)
        states = {0: h}
        mask = parts.mask(h, None)
        for i, layer in enumerate(parts.layers):
            h = layer(h, mask, cache=cache[i])
            if i + 1 in gates:
                states[i + 1] = h
        T = ids.shape[1]
        kv = [(c.keys[..., :T, :], c.values[..., :T, :]) for c in cache]
        if getattr(self, "context", None) is not None:  # only a context feature reads it: no copy for the others
            # each position's previous final residual (zeros at a row's start)
            states["prev"] = shift_right(h)
        return states, h, kv

    def fast_states(self, states: dict, kv, gate_indices=None) -> list[mx.array]:
        """Fast-stream state at every gate (or at the gates ``gate_indices`` names), for whole
        sequences (teacher-forced on the slow stream)."""
        T = states[0].shape[1]
        mask = parallel_mask(T)
        out = []
        intervals = self.config.intervals()
        for j in range(len(intervals)) if gate_indices is None else gate_indices:
            start, stop = intervals[j]
            views = {i: ParallelKV(*kv[i]) for i in range(start, stop)}
            out.append(
                self.fast_layers(self.start_state(j, states[start], states.get("prev")), start, stop, mask, views)
            )
        return out
