"""M2R2 expert prediction that rides along the slow stream's own pass (fused rows): almost free.

The run-ahead predictor (fast_predictor.py) runs the fast stream through an interval before
the slow stream does: extra layer passes, each reading the layer's weights again. Here the
fast stream is a second batch row of the slow stream's pass instead, as early exit's fused
checks are (M2R2Model.fused_layer, FusedKV): at a decode step, at each interval's start the
fast row restarts from the slow state; through the interval it shares every layer call with
the slow row, so the weights are read once. At the interval's end its state (approximating
the final residual) goes to the routers of the layers it predicts, and the loader brings
their experts in, in layer order, while the slow stream computes on.

Which layers an exit predicts: those of the interval after the next one (a whole interval of
lead), plus, from the first exit, the next interval's (nothing earlier predicts them), plus,
from the last exit that predicts anything, everything above. With SmolLM2's gates 6/12/18/24:
exit 6 -> layers 6-17, exit 12 -> 18-23, exit 18 -> 24-29; the last interval is not fused.

In a fused layer the fast row is routed to the slow row's experts (its router logits are the
slow row's): they are the ones the cache makes resident for this layer anyway, so the fast
row never loads, stalls or evicts anything. The slow row's computation is the model's own, so
the tokens are the all-resident model's (tests/test_moe_moefied.py checks).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..core.fast_stream import M2R2Model
from ..errors import M2R2Error
from .blocks import moe_blocks, top_scored
from .cache import ExpertCache
from .fast_predictor import LayerTap


def prediction_plan(intervals: list[tuple[int, int]], num_layers: int, moe_layers: list[int]) -> dict[int, list[int]]:
    """exit layer (gate) -> the MoE layers its state predicts (see the module docstring)."""
    ends = [g for _, g in intervals] + [num_layers]
    plan, covered = {}, set()
    for j, (_, gate) in enumerate(intervals):
        end = ends[min(j + 2, len(ends) - 1)]
        targets = [t for t in range(gate, end) if t in moe_layers and t not in covered]
        if targets:
            plan[gate] = targets
            covered.update(targets)
    return plan


class _FusedRowsGate(nn.Module):
    """A router that, while the cache runs fused rows, gives the fast rows the slow row's logits."""

    def __init__(self, gate: nn.Module, cache: ExpertCache):
        super().__init__()
        self.gate, self.cache = gate, cache

    def __call__(self, x: mx.array) -> mx.array:
        logits = self.gate(x)
        fast = self.cache.mode.fused_rows
        if not fast:
            return logits
        slow = logits[:-fast]
        return mx.concatenate([slow, mx.broadcast_to(slow[:1, -1:], (fast, *slow.shape[1:]))])


class _FusedTap(LayerTap):
    """At decode steps, runs its layer fused with the fast row where one is live."""

    def __call__(self, h, mask=None, cache=None):
        p = self.predictor
        if p.inside:  # fused_layer calling the layer itself
            return self.layer(h, mask, cache=cache)
        out = p.step_layer(self.index, h, mask, cache) if h.shape[1] == 1 and cache is not None else None
        if out is None:
            out = self.layer(h, mask, cache=cache)
        if self.index == p.last_layer:
            p.h_prev = out[:, -1:]  # the context feature's input at the next step: this position's final residual
        return out


class FusedPredictor:
    """Predict experts from the fast stream's exits, computed as an extra row of the slow pass (a ``Predictor``: the
    registry in predictors.py names it ``fast-fused``)."""

    def __init__(self, m2r2: M2R2Model):
        if not m2r2.can_fuse:
            raise M2R2Error("fused expert prediction needs bottleneck adapters (LoRA adapters touch the slow row)")
        self.m2r2 = m2r2
        self.parts = m2r2.parts
        self.intervals = m2r2.config.intervals()
        self.last_layer = self.parts.num_layers - 1
        self.cache: ExpertCache | None = None
        self.inside = False
        self.fast: mx.array | None = None
        self.h_prev: mx.array | None = None
        self.fast_layer_passes = 0  # fused fast rows (not extra passes: the weights are read once)

    def attach(self, cache: ExpertCache) -> "FusedPredictor":
        cache.require_routers("the M2R2 predictor")
        if any(isinstance(layer, _FusedTap) for layer in self.parts.layers):
            raise M2R2Error("this model already has an M2R2 expert predictor attached")
        self.cache = cache
        self.targets = prediction_plan(self.intervals, self.parts.num_layers, cache.layers)
        fused = [(j, s, g) for j, (s, g) in enumerate(self.intervals) if g in self.targets]
        self.start_of = {s: j for j, s, _ in fused}
        self.stop_of = {g - 1: g for _, _, g in fused}
        self.blocks = dict(moe_blocks(self.parts.model))
        for _, block in self.blocks.items():
            block.gate = _FusedRowsGate(block.gate, cache)
        layers = self.parts.layers
        for i in range(len(layers)):
            layers[i] = _FusedTap(layers[i], i, self)
        return self

    def own_modules(self) -> list:
        return [self.m2r2]

    def detach(self) -> None:
        layers = self.parts.layers
        for i in range(len(layers)):
            if isinstance(layers[i], _FusedTap):
                layers[i] = layers[i].layer
        for block in self.blocks.values():
            if isinstance(block.gate, _FusedRowsGate):
                block.gate = block.gate.gate
        self.cache, self.fast, self.h_prev = None, None, None

    def step_layer(self, i: int, h: mx.array, mask, kv) -> mx.array | None:
        """Layer ``i`` of a decode step: fused with the fast row inside a predicting interval, else None."""
        if i in self.start_of:
            j, planner = self.start_of[i], self.cache.planner
            wanted = planner is None or any(planner.wants(t) for t in self.targets[self.intervals[j][1]])
            # where none of its exit's predictions has been paying, the fast row does not run (probed now and then)
            self.fast = self.m2r2.start_state(j, h, self.h_prev) if wanted else None
        if self.fast is None:
            return None
        self.inside = True
        try:
            with self.cache.fused_rows(1):
                out, self.fast = self.m2r2.fused_layer(i, h, self.fast, kv)
        finally:
            self.inside = False
        self.fast_layer_passes += 1
        if i in self.stop_of:
            self.predict(self.targets[self.stop_of[i]], self.fast)
            self.fast = None
        return out

    def predict(self, targets: list[int], exit_state: mx.array) -> None:
        """The exit state through each target layer's router; loads queued in layer order (order of need)."""
        picks = [
            self.cache.scorers[t](self.parts.layers[t].layer.post_attention_layernorm(exit_state).reshape(1, -1))
            for t in targets
        ]
        mx.eval(picks)
        for t, p in zip(targets, picks):
            experts, scores = top_scored(np.array(p)[0], self.cache.top_k(t))
            self.cache.prefetch(t, experts, scores=scores)
