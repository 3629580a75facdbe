"""Whether the predictor pays for its own work: the expert loader's answer to the speculative planner's drafting
costs (decoding/costs.py, decoding/planner.py).

A predictor costs compute every token (M2R2's fast stream: extra layer passes, or fused rows), and saves only the
stall its prefetches hide. The governor measures both per decode step ("window": from one step's first MoE layer
to the next's), relative to the plain step, as the speculative engine prices drafting:

    cost     = compute (wall - stall) of a step with the predictor - that of a step without (the plain step),
               at least 0 (the predictor only adds work)
    savings  = stall LRU alone would have had - the stall the step had
             = (prefetch hits - experts a prefetch evicted that came back on demand) x t
               - (stall - on-demand misses x t)              (late prefetches, landing copies, a queued link)

with ``t`` one on-demand load's measured stall (from steps without the predictor; the loader's expected read time
before any). Both are moving averages. The predictor runs while savings exceed cost; otherwise the cache is plain
LRU. Estimates recover through probes: a step with the predictor where it is off (for its cost and savings), one
without where it is on (for the plain step's compute), each only while the probes' total expected loss (cost -
savings, or the reverse) stays within ``probe_share`` of the decode time measured so far. The first decode step
runs without it (the plain step's baseline), the second with it (the first probe, whatever it costs).

Steps are windows between consecutive decode steps of one generation; one that holds a prompt's pass, or spans a
``cache.reset()``, is not measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..estimates import ProbeBudget

if TYPE_CHECKING:
    from .cache import ExpertCache


@dataclass(frozen=True)
class GovernorConfig:
    probe_share: float = 0.02  # the probes' expected loss, at most this share of the decode time measured
    smoothing: float = 0.3  # weight of the newest window in the moving averages
    refresh_every: int = 16  # while on: a window without the predictor after this many with it (affordable)


def _counters(cache: ExpertCache) -> tuple[float, int, int, int]:
    s = cache.stats
    return s.stall_s, s.misses, s.total("prefetch_hits"), s.total("evicted_ahead_missed")


class PredictorGovernor:
    """Turns the predictor on and off by its measured cost and savings; see the module docstring."""

    def __init__(self, config: GovernorConfig = GovernorConfig()):
        self.config = config
        self.active = False  # the predictor runs in the current window
        self.compute_off: float | None = None  # seconds: a step's compute without the predictor
        self.t_miss: float | None = None  # seconds: one on-demand load's stall
        self.cost: float | None = None  # seconds per step the predictor's own work adds
        self.savings: float | None = None  # seconds of stall per step its prefetches hide
        self.spent = 0.0  # probes' expected loss so far
        self.elapsed = 0.0  # decode time measured
        self.budget = ProbeBudget(config.probe_share)  # what probes may still lose
        self.windows = {"on": 0, "off": 0, "probes": 0}
        self._mark: tuple | None = None  # (time, step, counters) at the window's start
        self._probe = False
        self._since_off = 0

    @property
    def probing(self) -> bool:
        """The predictor runs in this window as a probe (every layer predicted, to measure it)."""
        return self.active and self._probe

    def interrupt(self) -> None:
        """A prompt's pass ran: the window is not a decode step's; it is not measured."""
        self._mark = None

    def tick(self, cache: ExpertCache) -> None:
        """At each decode step's first MoE layer: measure the window that ends, decide the next."""
        now, counters = cache.clock.now(), _counters(cache)
        if self.t_miss is None:
            self.t_miss = cache.loader.read_seconds(cache.store.expert_bytes())
        if self._mark is not None and cache.step == self._mark[1] + 1:
            d = [a - b for a, b in zip(counters, self._mark[2])]
            if min(d) >= 0:
                self._learn(now - self._mark[0], *d)
        self._mark = (now, cache.step, counters)
        self.active, self._probe = self._decide()
        self.windows["on" if self.active else "off"] += 1
        self.windows["probes"] += self._probe

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.config.smoothing * (new - old)

    def _learn(self, wall: float, stall: float, misses: int, hits: int, came_back: int) -> None:
        compute, t = wall - stall, self.t_miss
        self.elapsed += wall
        self.budget.earn(wall)
        if not self.active:
            self.compute_off = self._avg(self.compute_off, compute)
            if misses:
                self.t_miss = self._avg(self.t_miss, stall / misses)
            if self._probe:
                self._spend(self.net())
            return
        saved = (hits - came_back) * t - (stall - misses * t)
        # the predictor only adds work: a step measured cheaper than the plain one is a slow baseline (the first
        # decode step's warm-up, a busy machine), and a negative cost would keep a predictor that saves nothing on
        cost = max(compute - self.compute_off, 0.0)
        self.savings, self.cost = self._avg(self.savings, saved), self._avg(self.cost, cost)
        if self._probe:
            self._spend(cost - saved)

    def _spend(self, loss: float) -> None:
        self.spent += max(loss, 0.0)
        self.budget.spend(loss)

    def net(self) -> float:
        """Seconds per step the predictor is expected to gain (negative: to lose)."""
        return (self.savings or 0.0) - (self.cost or 0.0)

    def _decide(self) -> tuple[bool, bool]:
        """(run the predictor in the next window, as a probe)."""
        if self.compute_off is None:
            return False, False  # the plain step first
        if self.cost is None:
            return True, True  # the first probe
        net = self.net()
        if net > 0:
            self._since_off += 1
            if self._since_off > self.config.refresh_every and self.budget.affords(net):
                self._since_off = 0
                return False, True  # refresh the plain step's compute
            return True, False
        if self.budget.affords(-net):
            return True, True
        return False, False

    def summary(self) -> dict:
        ms = lambda x: None if x is None else round(1e3 * x, 3)  # noqa: E731
        return {
            **self.windows,
            "cost_ms": ms(self.cost),
            "savings_ms": ms(self.savings),
            "plain_compute_ms": ms(self.compute_off),
            "probe_loss_share": self.spent / self.elapsed if self.elapsed else 0.0,
        }
