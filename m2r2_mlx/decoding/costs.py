"""What a speculative step costs on this machine, in plain steps: ratios that a busy machine does not distort.

A verification of n positions costs ``ratio(n)`` plain steps, each sample taken against the plain step's time at
that moment (timed on plain tokens decoded with the next one queued): when the machine slows, both slow and the
ratio stands. Samples age out after ``max_age`` steps; a size without fresh ones reads the ``Calibration`` (bare
forwards of 1-16 positions timed when the decoder is built) scaled by how the fresh sizes stand against it.
docs/speculative.md.
"""

from __future__ import annotations

import bisect
import functools
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx

from .prompt_cache import PromptCache
from .protocols import Outcome

SIZES = (1, 2, 4, 8, 16)  # verification sizes a calibration times


def _interpolate(points: dict[int, float], n: int) -> float:
    """A piecewise-linear curve through ``points`` (size -> ratio), extended by its end segments, never falling."""
    xs = sorted(points)
    if n in points or len(xs) == 1:
        return points.get(n, points[xs[0]] * (1 + 0.05 * (n - xs[0])))
    i = min(max(bisect.bisect_left(xs, n), 1), len(xs) - 1)  # the segment xs[i - 1]..xs[i]
    lo, hi = xs[i - 1], xs[i]
    return max(points[lo] + max((points[hi] - points[lo]) / (hi - lo), 0.0) * (n - lo), 1e-3)


@dataclass(frozen=True)
class Calibration:
    """One model's step costs on this machine: the plain step's seconds and each verification size's cost in plain
    steps."""

    plain: float
    ratios: dict[int, float] = field(default_factory=dict)

    def ratio(self, n: int) -> float:
        return 1.0 if n <= 1 else _interpolate({1: 1.0, **self.ratios}, n)


def measure_calibration(model, context: int = 64, rounds: int = 3) -> Calibration:
    """Time bare forwards of each of SIZES positions after ``context`` positions of a throwaway cache, after a
    warm-up round (first-time shapes are slow); the median of ``rounds``."""
    cache, token = PromptCache(model), 1
    mx.eval(cache.forward(list(range(1, context + 1))))
    times = {n: [] for n in SIZES}
    for r in range(rounds + 1):
        for n in SIZES:
            tic = time.perf_counter()
            mx.eval(cache.forward([token] * n))
            if r:
                times[n].append(time.perf_counter() - tic)
            cache.trim(n)
    plain = statistics.median(times[1])
    return Calibration(plain, {n: statistics.median(ts) / plain for n, ts in times.items() if n > 1})


def _memoized(method):  # until the next measurement or step: the planner asks many times a step
    @functools.wraps(method)
    def cached(self, *args):
        key = (method.__name__, *args)
        if key not in self._memo:
            self._memo[key] = method(self, *args)
        return self._memo[key]

    return cached


class StepCosts:
    """The running estimates. ``calibration``: None to start from what this instance measures alone;
    ``draft_fraction``: a draft step's cost in plain steps before one is timed."""

    def __init__(self, calibration: Calibration | None = None, draft_fraction=0.2, window: int = 9, max_age=64):
        self.calibration, self.draft_fraction, self.window, self.max_age = calibration, draft_fraction, window, max_age
        self.step = 0  # steps taken (plain or verification): the clock that ages measurements
        self.plains: deque = deque(maxlen=window)  # (step, seconds)
        self.samples: dict[int, deque] = {}  # positions -> (step, plain steps)
        self.drafts: deque = deque(maxlen=window)  # (step, plain steps)
        self._memo: dict = {}

    def tick(self) -> None:
        self.step += 1
        self._memo.clear()

    def _fresh(self, samples) -> list[float]:
        return [v for s, v in samples if self.step - s <= self.max_age]

    def observe(self, outcome: Outcome) -> None:
        """A timed step: a pipelined plain one, or a verification (its drafting apart); then the clock moves."""
        if outcome.plain:
            self.observe_plain(outcome.seconds)
        else:
            if len(outcome.draft) > 1:
                self.observe_verify(len(outcome.draft), outcome.seconds - outcome.draft_seconds)
            if outcome.draft_steps:
                self.observe_draft(outcome.draft_seconds / outcome.draft_steps)
        self.tick()

    def observe_plain(self, seconds: float) -> None:
        self.plains.append((self.step, seconds))
        self._memo.clear()

    def observe_verify(self, n: int, seconds: float) -> None:
        """A verification step of ``n`` positions (drafting excluded), as plain steps of this moment."""
        ratio = max(seconds / self.plain_seconds(), 1.0)
        self.samples.setdefault(n, deque(maxlen=self.window)).append((self.step, ratio))
        self._memo.clear()

    def observe_draft(self, seconds_per_step: float) -> None:
        self.drafts.append((self.step, seconds_per_step / self.plain_seconds()))
        self._memo.clear()

    @property
    def plain_due(self) -> bool:
        """The plain step was not timed lately: every ratio is measured against it, so it is timed again."""
        latest = max((s for s, _ in self.plains), default=0)
        return self.step - latest > self.max_age // 2

    @_memoized
    def plain_seconds(self) -> float:
        """The plain step now: its fresh measurements, else its latest, else the calibration's. Its absolute value
        only scales the others: decisions compare ratios."""
        fresh = self._fresh(self.plains) or [v for _, v in self.plains][-1:]
        return statistics.median(fresh) if fresh else self.calibration.plain if self.calibration else 0.05

    @_memoized
    def ratio(self, n: int) -> float:
        """A verification of ``n`` positions in plain steps (1 for the plain step itself)."""
        if n <= 1:
            return 1.0
        measured = {k: statistics.median(v) for k, s in self.samples.items() if len(v := self._fresh(s)) >= 2}
        if n in measured:
            return measured[n]
        if self.calibration is None:
            return _interpolate({1: 1.0, **measured}, n)
        return self.calibration.ratio(n) * self._scale()

    @_memoized
    def _scale(self) -> float:
        """How the fresh samples stand against the calibrated curve: a step pays for more than bare forwards."""
        scale = [v / self.calibration.ratio(k) for k, s in self.samples.items() for v in self._fresh(s)]
        return min(max(statistics.median(scale), 0.5), 4.0) if scale else 1.0

    def verify_cost(self, n: int) -> float:
        return self.plain_seconds() * self.ratio(n)

    def extra(self, n: int) -> float:
        """Seconds that verifying one more position adds to an n-position step."""
        return self.plain_seconds() * max(self.ratio(n + 1) - self.ratio(n), 0.0)

    def draft_cost(self) -> float:
        fresh = self._fresh(self.drafts)
        return self.plain_seconds() * (statistics.median(fresh) if fresh else self.draft_fraction)
