"""What a speculative step costs on this machine, in plain steps: ratios that a busy machine does not distort.

A verification of n positions costs ``ratio(n)`` plain steps, each sample taken against the plain step's time at
that moment (timed on plain tokens decoded with the next one queued): when the machine slows, both slow and the
ratio stands. Each size keeps its latest few samples; a size not yet measured reads the curve through those that
were, and one beyond them is priced to be tried (docs/speculative.md).
"""

from __future__ import annotations

import bisect
import functools
import statistics
from collections import deque

from .protocols import Outcome

PRIOR_SLOPE = 0.05  # beyond the largest size measured, each position adds 5% of its ratio until measured


def _interpolate(points: dict[int, float], n: int) -> float:
    """A piecewise-linear curve through ``points`` (size -> ratio), never falling. Beyond the largest size measured
    it rises at PRIOR_SLOPE: extending the end segment instead would let two noisy samples of a small size price
    every longer verification out of reach, and a size never verified is never measured, so the planner stays
    locked out of copying; priced low, a longer size is tried and then priced by its own samples."""
    xs = sorted(points)
    if n in points:
        return points[n]
    if n > xs[-1]:
        return points[xs[-1]] * (1 + PRIOR_SLOPE * (n - xs[-1]))
    i = bisect.bisect_left(xs, n)  # the segment xs[i - 1]..xs[i]
    lo, hi = xs[i - 1], xs[i]
    return max(points[lo] + max((points[hi] - points[lo]) / (hi - lo), 0.0) * (n - lo), 1e-3)


def _memoized(method):  # until the next measurement: the planner asks many times a step
    @functools.wraps(method)
    def cached(self, *args):
        key = (method.__name__, *args)
        if key not in self._memo:
            self._memo[key] = method(self, *args)
        return self._memo[key]

    return cached


class StepCosts:
    """The running estimates: the latest ``window`` samples of the plain step, of each verification size and of a
    draft step. ``draft_fraction``: a draft step's cost in plain steps before one is timed."""

    def __init__(self, draft_fraction: float = 0.2, window: int = 9):
        self.draft_fraction, self.window = draft_fraction, window
        self.plains: deque = deque(maxlen=window)  # seconds
        self.samples: dict[int, deque] = {}  # positions -> plain steps
        self.drafts: deque = deque(maxlen=window)  # plain steps
        self.pending: list = []  # samples timed before the first plain step, waiting for it
        self._memo: dict = {}

    def observe(self, outcome: Outcome) -> None:
        """A timed step: a pipelined plain one, or a verification (its drafting apart)."""
        if outcome.plain:
            self.observe_plain(outcome.seconds)
            return
        if len(outcome.draft) > 1:
            self.observe_verify(len(outcome.draft), outcome.seconds - outcome.draft_seconds)
        if outcome.draft_steps:
            self.observe_draft(outcome.draft_seconds / outcome.draft_steps)

    def observe_plain(self, seconds: float) -> None:
        self.plains.append(seconds)
        pending, self.pending = self.pending, []
        for record in pending:  # timed before the first plain step: priced against it now
            record(seconds)
        self._memo.clear()

    def observe_verify(self, n: int, seconds: float) -> None:
        """A verification step of ``n`` positions (drafting excluded), as plain steps of this moment."""
        self._priced(
            lambda ratio: self.samples.setdefault(n, deque(maxlen=self.window)).append(max(ratio, 1.0)), seconds
        )

    def observe_draft(self, seconds_per_step: float) -> None:
        self._priced(self.drafts.append, seconds_per_step)

    def _priced(self, record, seconds: float) -> None:
        """``record(seconds in plain steps)``. Before a plain step is timed the ratio is unknown, and a guessed plain
        step would fix a wrong ratio for a whole window of samples, so the sample waits for the first one."""
        if not self.plains:
            self.pending = [*self.pending[-4 * self.window :], lambda plain: record(seconds / plain)]
            return
        record(seconds / self.plain_seconds())
        self._memo.clear()

    @_memoized
    def plain_seconds(self) -> float:
        """The plain step now (a guess before one is timed). Its absolute value only scales the others: decisions
        compare ratios."""
        return statistics.median(self.plains) if self.plains else 0.05

    @_memoized
    def ratio(self, n: int) -> float:
        """A verification of ``n`` positions in plain steps (1 for the plain step itself)."""
        measured = {k: statistics.median(v) for k, v in self.samples.items() if len(v) >= 2}
        return 1.0 if n <= 1 else _interpolate({1: 1.0, **measured}, n)

    def verify_cost(self, n: int) -> float:
        return self.plain_seconds() * self.ratio(n)

    def extra(self, n: int) -> float:
        """Seconds that verifying one more position adds to an n-position step."""
        return self.plain_seconds() * max(self.ratio(n + 1) - self.ratio(n), 0.0)

    def draft_cost(self) -> float:
        return self.plain_seconds() * (statistics.median(self.drafts) if self.drafts else self.draft_fraction)
