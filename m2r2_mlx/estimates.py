"""Estimates that follow a changing stream: yes/no rates as decaying Beta posteriors, and a budget for probes.

Both planners learn rates online while the text under them changes: the speculative engine whether a drafter's
proposal is accepted (decoding/planner.py), the expert loader whether a predicted expert is used
(moe/planner.py). Counts decay every step, so an estimate follows the text (a passage being copied, then new
writing) and one left unused drifts back to its prior. A planner that learns only from what it chooses to do may
also probe now and then, from a budget of a small share of its time (the expert loader's governor does).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Hashable, Sequence


class Rates:
    """Beta posteriors of yes/no rates under keys. A key sequence reads from the finest key (first) to the coarsest
    (last), each coarser key's posterior being the prior of the finer one, so a key seldom seen leans on its
    coarser kin. ``prior`` and ``strength`` (pseudo-observations) set the coarsest key's prior, per call if given;
    every ``tick`` multiplies all counts by ``decay`` (0.995: a count is worth half after ~140 ticks)."""

    def __init__(self, prior: float = 0.5, strength: float = 2.0, decay: float = 0.995):
        self.prior, self.strength, self.decay = prior, strength, decay
        self.counts: dict[Hashable, list[float]] = defaultdict(lambda: [0.0, 0.0])  # key -> [yes, seen]

    def observe(self, keys: Sequence[Hashable], yes: bool) -> None:
        for key in keys:
            c = self.counts[key]
            c[0] += yes
            c[1] += 1

    def mean(self, keys: Sequence[Hashable], prior: float | None = None) -> float:
        """The posterior mean under the finest of ``keys``: each key's counts over the next coarser key's mean."""
        mean = self.prior if prior is None else prior
        for key in reversed(keys):
            yes, seen = self.counts.get(key, (0.0, 0.0))
            mean = (yes + self.strength * mean) / (seen + self.strength)
        return mean

    def tick(self) -> None:
        self.scale(self.decay)

    def scale(self, factor: float) -> None:
        for c in self.counts.values():
            c[0] *= factor
            c[1] *= factor


@dataclass
class ProbeBudget:
    """What probes may spend: actions a planner would not choose, taken so that an estimate it stopped feeding is
    measured again. Every measured second earns ``share`` of itself; a probe spends what it is expected to lose
    against the planner's own choice."""

    share: float
    credit: float = field(default=0.0)

    def earn(self, seconds: float) -> None:
        self.credit += self.share * seconds

    def affords(self, loss: float) -> bool:
        return self.share > 0 and loss <= self.credit

    def spend(self, loss: float) -> None:
        self.credit -= max(loss, 0.0)
