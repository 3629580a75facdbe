"""The baseline predictors, each listening to the cache (``attach``) and, before layer l computes, asking
``cache.prefetch`` for deeper layers.

``PreGating`` feeds layer l's input to the routers of the next layers (the slow state as a stand-in for theirs).
``NoPrediction`` asks for nothing: every expert loads on demand. The lookahead maps are in lookahead.py, the M2R2
fast stream's predictors in fast_predictor.py and fused_predictor.py; predictors.py names them all. The bench's
controls (a shuffled prediction, the true routes) are in bench/moe_controls.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..errors import M2R2Error
from .blocks import top_scored
from .cache import ExpertCache


class NoPrediction:
    """Predicts nothing: experts load when the router picks them (on demand)."""

    fast_layer_passes: int | None = None  # runs no fast stream

    def __init__(self):
        self.cache: ExpertCache | None = None

    def attach(self, cache: ExpertCache) -> "NoPrediction":
        self.cache = cache
        return self

    def detach(self) -> None:
        self.cache = None

    def own_modules(self) -> list:
        return []


class ListeningPredictor(NoPrediction):
    """A predictor that runs ``on_layer(layer, x)`` before each MoE layer computes, while attached."""

    def attach(self, cache: ExpertCache) -> "ListeningPredictor":
        super().attach(cache)
        cache.add_listener(self.on_layer)
        return self

    def detach(self) -> None:
        if self.cache is not None:
            self.cache.remove_listener(self.on_layer)
        super().detach()

    def on_layer(self, layer: int, x: mx.array) -> None:
        raise NotImplementedError


class LookaheadPredictor(ListeningPredictor):
    """Shared code of the per-layer predictors: on layer l, predict each of the next ``lookahead`` MoE layers and
    prefetch them. Subclasses implement ``predict``."""

    def __init__(self, lookahead: int = 1):
        if lookahead < 1:
            raise M2R2Error(f"lookahead must be at least 1 layer, got {lookahead}")
        super().__init__()
        self.lookahead = lookahead

    def on_layer(self, layer: int, x: mx.array) -> None:
        planner = self.cache.planner
        for target in self.cache.next_layers(layer, self.lookahead):
            if planner is not None and not planner.wants(target):
                continue  # its predictions have not been paying: save the work (the planner probes now and then)
            experts, scores = self.predict_scored(target, x)
            if experts:
                self.cache.prefetch(target, experts, scores=scores)

    def predict(self, layer: int, x: mx.array) -> list[int]:
        """Experts ``layer`` is expected to use at this step, most likely first."""
        raise NotImplementedError

    def predict_scored(self, layer: int, x: mx.array) -> tuple[list[int], np.ndarray | None]:
        """``predict``'s experts and, where the predictor has them, its probability of every expert (None: none)."""
        return self.predict(layer, x), None


def _by_votes(ids: np.ndarray) -> list[int]:
    """Distinct experts, the most often chosen (over tokens) first; ties by id."""
    experts, votes = np.unique(ids.reshape(-1), return_counts=True)
    return [int(e) for e in experts[np.argsort(-votes, kind="stable")]]


class PreGating(LookaheadPredictor):
    """Run the next layers' routers on this layer's input (no fast stream)."""

    def attach(self, cache: ExpertCache) -> "PreGating":
        cache.require_routers("pre-gating")
        return super().attach(cache)

    def predict(self, layer: int, x: mx.array) -> list[int]:
        return _by_votes(np.array(self.cache.routers[layer](x)))

    def predict_scored(self, layer: int, x: mx.array) -> tuple[list[int], np.ndarray | None]:
        if x.shape[0] != 1 or layer not in self.cache.scorers:
            return self.predict(layer, x), None
        return top_scored(np.array(self.cache.scorers[layer](x))[0], self.cache.top_k(layer))
