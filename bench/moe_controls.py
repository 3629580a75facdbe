"""What `m2r2-bench --moe` measures the product's predictors against, kept out of the product: a prediction that
carries no information, the true routes of a recorded run, and Belady's eviction on them.

``ShuffledControl`` asks for as many experts as pre-gating would, at random (seeded): the control. ``Oracle``
replays the experts a previous identical run used (the cache's ``trace``; greedy decoding repeats them): the upper
bound. ``FutureRoutes`` gives each layer Belady's eviction on those routes (the on-demand optimum). ``CONTROLS``
are registry entries beside the product's (m2r2_mlx/moe/predictors.py), for rows and tests.
"""

from __future__ import annotations

from functools import partial

import m2r2_mlx  # noqa: F401  (fast BLAS before mlx)
from m2r2_mlx.moe.baselines import LookaheadPredictor, PreGating
from m2r2_mlx.moe.cache import ExpertCache
from m2r2_mlx.moe.policies import EvictionPolicy
from m2r2_mlx.moe.predictors import PredictorEntry

import mlx.core as mx
import numpy as np


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

    Unlike the product's predictors it also looks past the last layer, into the next step's first layers (the true
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


class Belady(EvictionPolicy):
    """Evict the expert whose next use is farthest in the future (never used again: first); ties by recency.

    Belady's MIN: with the true future routes, the fewest misses any on-demand policy can have (an offline bound:
    it reads the routes of a recorded run). ``next_use(expert)``: the step it is next used at this layer (inf:
    never)."""

    name = "belady"

    def __init__(self, next_use) -> None:
        super().__init__()
        self.next_use = next_use

    def rank(self, expert: int):
        return -self.next_use(expert), self._last.get(expert, 0)


class FutureRoutes:
    """The routes a decode will take ((step, layer) -> experts, a recorded identical run's ``trace``), read by each
    layer's Belady policy: ``ExpertCache(..., policy=future.policy)``, then ``future.follow(cache)``, and
    ``future.set(routes)`` before each decode."""

    def __init__(self):
        self.cache: ExpertCache | None = None
        self._uses: dict[int, dict[int, list[int]]] = {}  # layer -> expert -> the steps it is used at

    def policy(self, layer: int) -> Belady:
        return Belady(partial(self.next_use, layer))

    def follow(self, cache: ExpertCache) -> None:
        self.cache = cache

    def set(self, routes: dict[tuple[int, int], list[int]]) -> None:
        self._uses = {}
        for (step, layer), experts in sorted(routes.items()):
            for e in experts:
                self._uses.setdefault(layer, {}).setdefault(e, []).append(step)

    def next_use(self, layer: int, expert: int) -> float:
        """The first step at which ``layer`` uses ``expert`` after the forward pass's position (inf: never)."""
        from bisect import bisect_left

        step, here = self.cache.position
        first = step if self.cache.ordinal(layer) > here else step + 1  # a later layer of this step, or the next
        steps = self._uses.get(layer, {}).get(expert, ())
        i = bisect_left(steps, first)
        return steps[i] if i < len(steps) else float("inf")


CONTROLS: dict[str, PredictorEntry] = {
    e.name: e
    for e in (
        PredictorEntry(
            "shuffled",
            "shuffled control",
            "as many experts as pre-gating, drawn at random (seeded): a prediction that carries no information",
            lambda i: ShuffledControl(seed=0),
        ),
        PredictorEntry(
            "shuffled-planned",
            "shuffled control, planned",
            "the shuffled control's random experts through the prefetch planner: it should load (almost) nothing",
            lambda i: ShuffledControl(seed=0),
            planned=True,
        ),
    )
}
