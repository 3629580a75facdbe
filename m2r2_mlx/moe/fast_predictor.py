"""M2R2 ahead-of-time expert prediction: the fast stream runs ahead in depth and tells the loader.

When the slow stream of a decode step enters interval j = [g_(j-1), g_j), the fast stream
restarts from the slow state there and runs the interval's layers with its adapters (as in
drafting: the shared KV cache read through ``SlowKVView``, nothing stored). Its state at
g_j approximates the final residual; fed to the routers of the layers of the *next*
interval, it names their experts a whole interval before the slow stream gets there, and
the background loader brings them in while the slow stream computes this interval.
Pre-gating, the baseline, sees only one layer ahead.

The fast stream's own MoE layers route among the experts already resident (the others'
router logits are masked), so running ahead never loads, stalls or waits for the router's
choice (the interval is one lazy graph, evaluated once), and it runs inside
``cache.side_pass()`` so it counts no hits or misses. The slow stream is untouched: the
tokens are the all-resident model's exactly.

Only the exit state is used: it predicts the next interval's routing better than the fast
stream's intermediate states do (docs/moe_bench.md).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..core.fast_stream import M2R2Model, SlowKVView
from ..errors import M2R2Error
from .blocks import moe_blocks, top_scored
from .cache import ExpertCache


class _ResidentOnlyGate(nn.Module):
    """A router restricted to the experts resident in the cache (fast stream only)."""

    def __init__(self, gate: nn.Module, cache: ExpertCache, layer: int):
        super().__init__()
        self.gate, self.cache, self.layer = gate, cache, layer

    def __call__(self, x: mx.array) -> mx.array:
        return mx.where(self.cache.resident_mask(self.layer), self.gate(x), -1e9)


class LayerTap(nn.Module):
    """Wraps decoder layer ``index`` so that a predictor sees each call; subclasses say what it does there."""

    def __init__(self, layer: nn.Module, index: int, predictor):
        super().__init__()
        self.layer, self.index, self.predictor = layer, index, predictor

    def __getattr__(self, key: str):  # the model reads its layers' attributes (llama: use_sliding)
        try:
            return super().__getattr__(key)
        except AttributeError:
            if "layer" not in self:  # still being built
                raise
            return getattr(self["layer"], key)


class _GateTap(LayerTap):
    """Remembers its layer's KV cache and, at an interval start, calls the predictor first."""

    def __call__(self, h, mask=None, cache=None):
        if self.predictor.running:  # the fast stream itself passing through: nothing to record
            return self.layer(h, mask, cache=cache)
        self.predictor.caches[self.index] = cache
        if self.index in self.predictor.starts:
            self.predictor.on_gate(self.index, h)
        return self.layer(h, mask, cache=cache)


class FastStreamPredictor:
    """Predict each interval's experts from the previous interval's fast-stream exit (a ``Predictor``: the registry
    in predictors.py names it ``fast``)."""

    def __init__(self, m2r2: M2R2Model):
        self.m2r2 = m2r2
        self.parts = m2r2.parts
        self.intervals = m2r2.config.intervals()
        self.starts = {s: (s, g) for s, g in self.intervals}
        self.caches: dict[int, object] = {}
        self.running = False
        self.cache: ExpertCache | None = None
        self.fast_layer_passes = 0

    def attach(self, cache: ExpertCache) -> "FastStreamPredictor":
        cache.require_routers("the M2R2 predictor")
        if any(isinstance(layer, _GateTap) for layer in self.parts.layers):
            raise M2R2Error("this model already has an M2R2 expert predictor attached")
        self.cache = cache
        self.blocks = dict(moe_blocks(self.parts.model))
        layers = self.parts.layers
        for i in range(len(layers)):
            layers[i] = _GateTap(layers[i], i, self)
        return self

    def own_modules(self) -> list:
        return [self.m2r2]

    def detach(self) -> None:
        layers = self.parts.layers
        for i in range(len(layers)):
            if isinstance(layers[i], _GateTap):
                layers[i] = layers[i].layer
        self.cache = None
        self.caches.clear()  # they hold the KV caches

    def targets(self, stop: int) -> list[int]:
        """The layers of the interval after the one ending at ``stop`` (the last gate: up to the top)."""
        nxt = [g for s, g in self.intervals if s == stop]
        end = nxt[0] if nxt else self.parts.num_layers  # the last interval run: everything above it
        return [l for l in range(stop, end) if l in self.cache.routers]

    def on_gate(self, start: int, h: mx.array) -> None:
        if h.shape[1] != 1 or any(self.caches.get(i) is None for i in range(*self.starts[start])):
            return  # prompts load on demand; decode steps are what ahead-of-time loading is for
        _, stop = self.starts[start]
        planner = self.cache.planner
        if planner is not None and not any(planner.wants(t) for t in self.targets(stop)):
            return  # none of this exit's predictions has been paying: no run ahead (probed now and then)
        self.running = True
        try:
            exit_state = self._run_fast(h, start, stop)
        finally:
            self.running = False
        # the cache counts a new step at its first MoE layer: before it, this step is not counted yet
        step = self.cache.step + (0 if self.cache.layers[0] < start else 1)
        for t in self.targets(stop):
            x = self.parts.layers[t].layer.post_attention_layernorm(exit_state).reshape(1, -1)
            experts, scores = top_scored(np.array(self.cache.scorers[t](x))[0], self.cache.top_k(t))
            self.cache.prefetch(t, experts, step, scores)

    def _run_fast(self, h: mx.array, start: int, stop: int) -> mx.array:
        views = {i: SlowKVView(self.caches[i]) for i in range(start, stop)}
        saved = {}
        for i in range(start, stop):
            if i in self.blocks:
                saved[i] = self.blocks[i].gate
                self.blocks[i].gate = _ResidentOnlyGate(saved[i], self.cache, i)
        try:  # routed among resident experts: one lazy graph for the whole interval, evaluated once
            with self.cache.resident_only(), self.cache.side_pass():
                out = self.m2r2.fast_layers(h, start, stop, None, views)
                mx.eval(out)
        finally:
            for i, gate in saved.items():
                self.blocks[i].gate = gate
        self.fast_layer_passes += stop - start
        return out
