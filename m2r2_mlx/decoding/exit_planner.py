"""Which gates early exit checks: only those whose expected saving pays for the check.

Checking gate j costs the exit head, the exit rule (a host read) and, fused, one more row through the interval's
layers; a token that exits there skips the layers after g_j now and fills their keys and values later, as extra rows
of the next token's passes. So gate j is checked while

    p_j * (L - g_j) * (pass - row)  >  (g_j - g_(j-1)) * row + check

with p_j the exit rate at gate j (decaying Beta posteriors: estimates.Rates, as the speculative planner's acceptance
rates) and ``pass``, ``row`` and ``check`` the seconds of a layer pass, of one more row in a pass and of a check,
fitted to every token's measured time by least squares that forget, held to a prior's proportions where the
tokens cannot tell two costs apart (``StepFit``). A gate left unchecked drifts back
to its prior and is tried again, so a text where exits start to pay turns its gates back on. Where no gate pays,
every token runs the whole model: plain decoding's work.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..estimates import Rates

FEATURES = ("pass", "row", "check", "token")  # what a token's time is fitted on: layer passes, extra rows, checks, 1


class StepFit:
    """Seconds per token as a linear function of what the token ran: least squares over the tokens so far, each
    token's weight decaying by ``forget`` per token, held to ``prior``'s proportions (at the measured scale) with
    the weight of ``strength`` tokens in each feature. Decoding seldom varies the features apart (a checked token
    runs its interval's rows and its check together), and without the prior such a fit may put a pair's cost on
    either one of them; with it, what the tokens cannot tell apart keeps the prior's split."""

    def __init__(self, prior: Sequence[float], strength: float = 2.0, forget: float = 0.99):
        self.prior = np.asarray(prior, dtype=float)
        self.strength, self.forget = strength, forget
        k = len(prior)
        self.xx, self.xy, self.weight = np.zeros((k, k)), np.zeros(k), 0.0
        self.scale, self.seen = 1.0, 0
        self.theta = self.prior.copy()

    def observe(self, x: Sequence[float], seconds: float) -> None:
        x = np.asarray(x, dtype=float)
        ratio = seconds / max(float(x @ self.prior), 1e-12)  # the prior's scale, as this token measures it
        self.scale = ratio if self.seen == 0 else self.forget * self.scale + (1 - self.forget) * ratio
        self.xx = self.forget * self.xx + np.outer(x, x)
        self.xy = self.forget * self.xy + x * seconds
        self.weight = self.forget * self.weight + 1.0
        ridge = self.strength * np.maximum(np.diag(self.xx) / self.weight, 1e-9)  # a token's worth per feature
        anchor = self.prior * self.scale
        self.theta = np.linalg.solve(self.xx + np.diag(ridge), self.xy + ridge * anchor)
        self.seen += 1

    def cost(self, name: str) -> float:
        return max(float(self.theta[FEATURES.index(name)]), 0.0)


class GatePlanner:
    """Decides each token's checked gates from the exit rates and the fitted costs; learns from every token."""

    def __init__(self, stops: Sequence[int], num_layers: int, prior: float = 0.3):
        self.stops, self.L, self.prior = list(stops), num_layers, prior
        self.rates = Rates(strength=2.0, decay=0.995)
        # before any token is timed: a pass 1, an extra row a third of it, a check two passes, no fixed cost
        self.fit = StepFit([1.0, 1 / 3, 2.0, 0.0])

    def rate(self, j: int) -> float:
        return self.rates.mean((("exit", j),), self.prior)

    def saving(self, j: int) -> float:
        """Expected seconds checking gate j saves (negative: it costs)."""
        start = self.stops[j - 1] if j else 0
        gain = self.rate(j) * (self.L - self.stops[j]) * (self.fit.cost("pass") - self.fit.cost("row"))
        return gain - (self.stops[j] - start) * self.fit.cost("row") - self.fit.cost("check")

    def checked(self) -> list[bool]:
        """This token's checks, gate by gate."""
        return [self.saving(j) > 0 for j in range(len(self.stops))]

    def observe(self, exits: dict[int, bool], passes: int, rows: int, checks: int, seconds: float | None) -> None:
        """A token: each checked gate's verdict (``exits``: gate -> left there), and what it ran and took."""
        for j, left in exits.items():
            self.rates.observe((("exit", j),), left)
        self.rates.tick()
        if seconds is not None:
            self.fit.observe([passes, rows, checks, 1.0], seconds)
