"""What a speculative step costs on this machine, in units that a busy machine does not distort.

The planner compares costs only with each other (does verifying one more position, or one more draft step, buy
more tokens than it costs?), so it needs ratios, not seconds. A verification of n positions costs ``ratio(n)``
plain steps, each measurement taken against the plain step's time at that moment; the plain step (pipelined, as
plain decoding runs) is measured on every plain token. When the whole machine slows down (other apps, indexing,
thermal throttling), a step and the plain step slow down together and the ratio stands.

No estimate outlives the conditions it was measured in: a size keeps its latest few samples (their median), a
sample older than ``max_age`` steps is dropped, and a sample is clipped at ``clip`` times the calibrated ratio,
so one outlier cannot move an estimate far or for long. A size without fresh samples reads the calibrated curve
(``CostProfile``, measured once per machine and model: calibration.py), corrected by how the fresh sizes stand
against it. Costs are kept per context-length bucket (below 512 positions, then each doubling): attention makes
a wide verification dearer against a plain step the longer the context.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx

SIZES = (1, 2, 4, 8, 16)  # verification sizes a calibration times
MIN_EXTRA = 0.01  # plain steps: the least one more verified position is priced at


def context_bucket(context: int) -> int:
    return max(0, int(context).bit_length() - 9)  # 0: < 512 positions, 1: < 1024, 2: < 2048, ...


def _interpolate(points: dict[int, float], n: int) -> float:
    """A piecewise-linear curve through ``points`` (size -> ratio), extended from its last two points."""
    xs = sorted(points)
    if n in points or len(xs) == 1:
        return points.get(n, points[xs[0]] * (1 + 0.05 * (n - xs[0])))
    lo = max((x for x in xs if x < n), default=xs[0])
    hi = min((x for x in xs if x > n), default=xs[-1])
    if lo == hi:  # beyond the ends: the nearest segment's slope, never falling
        lo, hi = (xs[0], xs[1]) if n < xs[0] else (xs[-2], xs[-1])
    slope = max((points[hi] - points[lo]) / (hi - lo), 0.0)
    return max(points[lo] + slope * (n - lo), 1e-3)


@dataclass
class CostProfile:
    """One machine's step costs for one model: per context bucket, the plain step's seconds and each verification
    size's cost in plain steps; a fast-stream draft step's cost in plain steps."""

    plain: dict[int, float] = field(default_factory=dict)  # bucket -> seconds
    ratios: dict[int, dict[int, float]] = field(default_factory=dict)  # bucket -> positions -> plain steps
    draft: float | None = None

    def ratio(self, bucket: int, n: int) -> float | None:
        """From the bucket's curve, else the nearest bucket's; None when nothing was measured."""
        if not self.ratios:
            return None
        near = min(self.ratios, key=lambda b: (abs(b - bucket), -b))
        return 1.0 if n <= 1 else _interpolate({1: 1.0, **self.ratios[near]}, n)

    def to_json(self) -> dict:
        return {
            "plain": {str(b): s for b, s in self.plain.items()},
            "ratios": {str(b): {str(n): r for n, r in row.items()} for b, row in self.ratios.items()},
            "draft": self.draft,
        }

    @classmethod
    def from_json(cls, data: dict) -> "CostProfile":
        """Raises ValueError, TypeError or AttributeError on a malformed document."""
        plain = {int(b): float(s) for b, s in data["plain"].items()}
        ratios = {int(b): {int(n): float(r) for n, r in row.items()} for b, row in data["ratios"].items()}
        draft = None if data.get("draft") is None else float(data["draft"])
        if any(s <= 0 for s in plain.values()) or any(r <= 0 for row in ratios.values() for r in row.values()):
            raise ValueError("costs must be positive")
        return cls(plain, ratios, draft)


def measure_profile(cache, token: int, rounds: int = 3) -> CostProfile:
    """Time bare forwards of each of SIZES positions at the end of ``cache`` (a PromptCache, left as it was),
    after a warm-up round (first-time shapes are slow); the median of ``rounds``."""
    states, times = cache.states, {n: [] for n in SIZES}
    for r in range(rounds + 1):
        for n in SIZES:
            tic = time.perf_counter()
            mx.eval(cache.forward([token] * n))
            if r:
                times[n].append(time.perf_counter() - tic)
            cache.trim(n)
    cache.states = states
    plain = statistics.median(times[1])
    bucket = context_bucket(len(cache))
    return CostProfile({bucket: plain}, {bucket: {n: statistics.median(ts) / plain for n, ts in times.items()}})


class StepCosts:
    """The running estimates: the plain step's seconds and each verification size's cost in plain steps.

    A step's time is its wall-clock time, everything a step does but the fast stream's drafting (priced apart).
    ``prior``: the calibrated profile (None: estimates from what this instance measures alone)."""

    def __init__(
        self,
        prior: CostProfile | None = None,
        draft_fraction: float = 0.2,
        window: int = 9,
        max_age: int = 64,
        clip: float = 4.0,
    ):
        self.prior = prior
        self.draft_fraction = draft_fraction  # a draft step's cost before one is timed, without a profile
        self.window, self.max_age, self.clip = window, max_age, clip
        self.context = 0  # positions in the cache now: which bucket the estimates read and measurements feed
        self.step = 0  # steps taken (plain or verification): the clock that ages measurements
        self.plains: dict[int, deque] = {}  # bucket -> (step, seconds)
        self.samples: dict[int, dict[int, deque]] = {}  # bucket -> positions -> (step, plain steps)
        self.drafts: deque = deque(maxlen=window)  # (step, plain steps)
        self.stale = False  # a verification was priced against a plain step the machine no longer takes
        self._memo: dict = {}  # estimates, until the next measurement or step (the planner asks many times a step)

    @property
    def bucket(self) -> int:
        return context_bucket(self.context)

    def tick(self) -> None:
        self.step += 1
        self._memo.clear()

    def _memoized(self, key, compute):
        key = (self.bucket, *key)
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def _fresh(self, samples) -> list[float]:
        return [v for s, v in samples if self.step - s <= self.max_age]

    # ---- measurements ------------------------------------------------------------------------------------
    def observe_plain(self, seconds: float) -> None:
        """A plain step: pipelined, as plain decoding runs (or a lone verification, where stretches are off)."""
        self.plains.setdefault(self.bucket, deque(maxlen=self.window)).append((self.step, seconds))
        self.stale = False
        self._memo.clear()

    def observe_verify(self, n: int, seconds: float) -> None:
        """A whole verification step of ``n`` positions, as plain steps of this moment (clipped). A ratio out of
        bounds says the plain step it was taken against is stale as much as that it is an outlier: below 0.8 (a
        synchronous step over several positions is never cheaper than a pipelined plain one) the machine has
        sped up, above ``clip`` times the calibrated ratio it has slowed down; either way the plain step is timed
        again (``plain_due``)."""
        if n <= 1:
            self.observe_plain(seconds)
            return
        ratio = seconds / self.plain_seconds()
        prior = self.prior.ratio(self.bucket, n) if self.prior else None
        top = self.clip * (prior if prior is not None else n)
        self.stale = self.stale or not 0.8 <= ratio <= top
        ratio = min(max(ratio, 1.0), top)
        row = self.samples.setdefault(self.bucket, {})
        row.setdefault(n, deque(maxlen=self.window)).append((self.step, ratio))
        self._memo.clear()

    def observe_draft(self, seconds_per_step: float) -> None:
        self.drafts.append((self.step, min(seconds_per_step / self.plain_seconds(), self.clip)))
        self._memo.clear()

    # ---- estimates -------------------------------------------------------------------------------------
    @property
    def plain_due(self) -> bool:
        """The plain step has not been timed lately in this bucket: take a few plain steps to measure it, since
        every ratio is measured against it (an engine that always drafted would otherwise price its steps
        against a plain step of another time, a busy machine's or an idle one's)."""
        latest = max((s for s, _ in self.plains.get(self.bucket, ())), default=0)
        return self.stale or self.step - latest > self.max_age // 2

    def plain_seconds(self) -> float:
        return self._memoized(("plain",), self._plain_seconds)

    def _plain_seconds(self) -> float:
        """The plain step now: its fresh measurements in this bucket, else the nearest bucket's (fresh before
        stale), else the profile's. Its absolute value only scales the others: decisions compare ratios."""
        here = self.bucket
        for fresh in (True, False):
            for b in sorted(self.plains, key=lambda b: abs(b - here)):
                values = self._fresh(self.plains[b]) if fresh else [v for _, v in self.plains[b]]
                if values:
                    return statistics.median(values)
        if self.prior and self.prior.plain:
            return self.prior.plain[min(self.prior.plain, key=lambda b: abs(b - here))]
        return 0.05

    def _measured(self) -> dict[int, float]:
        """This bucket's sizes with at least two fresh samples: their medians."""
        row = self.samples.get(self.bucket, {})
        return {n: statistics.median(v) for n, s in row.items() if len(v := self._fresh(s)) >= 2}

    def ratio(self, n: int) -> float:
        """A verification of ``n`` positions in plain steps (1 for the plain step itself)."""
        return 1.0 if n <= 1 else self._memoized(("ratio", n), lambda: self._ratio(n))

    def _ratio(self, n: int) -> float:
        measured = self._measured()
        if n in measured:
            return measured[n]
        prior = self.prior.ratio(self.bucket, n) if self.prior else None
        if prior is not None:
            return prior * self._memoized(("scale",), self._scale)
        return _interpolate({1: 1.0, **measured}, n)

    def _scale(self) -> float:
        """How this bucket's fresh samples, every size's, stand against the calibrated curve: a whole step pays
        for more than the bare forward calibration timed, and a bucket the calibration never saw (a long
        context) is priced from its first verifications on, whatever their sizes."""
        row = self.samples.get(self.bucket, {})
        scale = [v / self.prior.ratio(self.bucket, k) for k, s in row.items() for v in self._fresh(s)]
        return min(max(statistics.median(scale), 0.5), self.clip) if scale else 1.0

    def verify_cost(self, n: int) -> float:
        return self.plain_seconds() * self.ratio(n)

    def extra(self, n: int) -> float:
        """Seconds that verifying one more position adds to an n-position step. Two sizes' estimates may be out
        of order on a noisy machine, but a position is never free: at least MIN_EXTRA of a plain step, so a
        proposal the engine is all but sure fails is not verified because noise priced it at nothing."""
        return self.plain_seconds() * max(self.ratio(n + 1) - self.ratio(n), MIN_EXTRA)

    def draft_cost(self) -> float:
        fresh = self._fresh(self.drafts)
        if fresh:
            ratio = statistics.median(fresh)
        elif self.prior and self.prior.draft is not None:
            ratio = self.prior.draft
        else:
            ratio = self.draft_fraction
        return self.plain_seconds() * ratio

    def calibrate(self, prior: CostProfile) -> None:
        self.prior = prior
        self._memo.clear()

    @property
    def calibrated(self) -> bool:
        return self.prior is not None and bool(self.prior.ratios)

    def profile(self) -> CostProfile:
        """The calibrated profile refined by what was measured (each estimate that has samples, fresh or not),
        for the next session on this machine."""
        out = CostProfile(
            dict(self.prior.plain) if self.prior else {},
            {b: dict(row) for b, row in self.prior.ratios.items()} if self.prior else {},
            self.prior.draft if self.prior else None,
        )
        # Each refinement moves a value halfway (geometrically) toward what was measured, so what one session
        # saw (a slowdown that passed, say) shifts the profile but cannot replace it.
        for b, samples in self.plains.items():
            if fresh := self._fresh(samples):
                out.plain[b] = _blend(out.plain.get(b), statistics.median(fresh))
        for b, row in self.samples.items():
            for n, samples in row.items():
                if len(samples) >= 3:
                    measured = statistics.median(v for _, v in samples)
                    out.ratios.setdefault(b, {})[n] = _blend(out.ratios.get(b, {}).get(n), measured)
        if len(self.drafts) >= 3:
            out.draft = _blend(out.draft, statistics.median(v for _, v in self.drafts))
        return out


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (old * new) ** 0.5
