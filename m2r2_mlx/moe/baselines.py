"""The baseline predictors, each listening to the cache (``attach``) and, before layer l computes, asking
``cache.prefetch`` for deeper layers.

``PreGating`` feeds layer l's input to the routers of the next layers (the slow state as a
stand-in for theirs). ``ShuffledControl`` asks for as many experts as pre-gating would, at
random (seeded): a prediction that carries no information, the control. ``Oracle`` replays
the experts a previous identical run really used (the cache's ``trace``): the upper bound.
``NoPrediction`` asks for nothing: every expert loads on demand. The M2R2 fast stream's
predictors are in fast_predictor.py and fused_predictor.py; predictors.py names them all.
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
        missing = [l for l in cache.layers if l not in cache.routers]
        if missing:
            raise M2R2Error(
                f"pre-gating needs the routers of MoE layers {missing}, which this model's blocks do not expose"
            )
        return super().attach(cache)

    def predict(self, layer: int, x: mx.array) -> list[int]:
        return _by_votes(np.array(self.cache.routers[layer](x)))

    def predict_scored(self, layer: int, x: mx.array) -> tuple[list[int], np.ndarray | None]:
        if x.shape[0] != 1 or layer not in self.cache.scorers:
            return self.predict(layer, x), None
        return top_scored(np.array(self.cache.scorers[layer](x))[0], self.cache.top_k(layer))


class ShuffledControl(PreGating):
    """As many experts as pre-gating predicts, drawn at random with a fixed seed."""

    def __init__(self, lookahead: int = 1, seed: int = 0):
        super().__init__(lookahead)
        self.rng = np.random.default_rng(seed)

    def predict(self, layer: int, x: mx.array) -> list[int]:
        n = len(super().predict(layer, x))
        return [int(e) for e in self.rng.choice(self.cache.num_experts(layer), size=n, replace=False)]

    def predict_scored(self, layer: int, x: mx.array) -> tuple[list[int], np.ndarray | None]:
        return self.predict(layer, x), None


class Oracle(LookaheadPredictor):
    """The experts a previous run used at the same (step, layer): record ``cache.trace`` in a first run.

    Unlike the other predictors it also looks past the last layer, into the next step's first layers (the true
    routes of the next token are known to it): so no layer is left to load on demand, and it bounds what any
    predictor can hide."""

    def __init__(self, trace: dict[tuple[int, int], list[int]], lookahead: int = 1):
        super().__init__(lookahead)
        self.trace = trace

    def predict(self, layer: int, x: mx.array) -> list[int]:
        return self.routes(self.cache.step, layer)

    def routes(self, step: int, layer: int) -> list[int]:
        """The experts it names for ``layer`` at ``step`` (the recorded ones)."""
        return list(self.trace.get((step, layer), []))

    def on_layer(self, layer: int, x: mx.array) -> None:
        cache, n = self.cache, len(self.cache.layers)
        for j in range(cache.ordinal(layer) + 1, cache.ordinal(layer) + 1 + self.lookahead):
            step, target = cache.step + j // n, cache.layers[j % n]
            if experts := self.routes(step, target):
                cache.prefetch(target, experts, step=step)
