"""Early-exit walkers for studies, as subclasses of the product's ``EarlyExit`` (decoding/early_exit.py): the slow
state's own exit instead of the fast stream's (``source="layerskip"``), a fixed exit layer per answer position instead
of the exit score (SkipDecode-style ``schedule``), a subset of the gates, and fast-stream checks that do not ride
along the slow pass (``fused=False``). Pass one to ``EarlyExitDecoder(..., walker=exit_walker(...))``.
"""

from __future__ import annotations

from typing import Callable, Sequence

from m2r2_mlx.decoding.early_exit import EarlyExit, gate_thresholds
from m2r2_mlx.tracing import NO_TRACE

import mlx.core as mx
import numpy as np


def exit_walker(
    *,
    source: str = "fast",
    schedule: Callable[[int], int | None] | None = None,
    gates: Sequence[int] | None = None,
    fused: bool = True,
) -> type[EarlyExit]:
    """An EarlyExit subclass: exit candidates from ``source`` ("fast" or "layerskip"); with ``schedule(index)`` each
    token leaves at the layer it names (None: the whole model), whatever its score; ``gates``: the gates checked
    (None: all; tau belongs to the first of them); ``fused=False``: the fast stream runs its interval apart."""
    if source not in ("fast", "layerskip"):
        raise ValueError(f"unknown exit source {source!r}; choose fast or layerskip")

    class Variant(EarlyExit):
        def __init__(self, m2r2, cache, policy, tracer=NO_TRACE, planner=None):
            super().__init__(m2r2, cache, policy, tracer, planner)
            self.fused = self.fused and fused
            stops = [stop for _, stop in self.intervals]
            allowed = set(m2r2.config.gates if gates is None else gates)
            self.allowed = [stop in allowed for stop in stops]
            first = min((s for s, ok in zip(stops, self.allowed) if ok), default=stops[0])
            self.taus = gate_thresholds(policy.tau, stops, first, self.L, policy.scaled_tau)
            self.forced: int | None = None

        def step(self, token: int, index: int, allowed: np.ndarray | None = None) -> tuple[mx.array, int]:
            self.forced = schedule(index) if schedule else None
            return super().step(token, index, allowed)

        def checked(self, j: int) -> bool:
            return self.forced == self.intervals[j][1] if schedule else self.allowed[j]

        def candidate(self, h: mx.array, j: int) -> tuple[mx.array, mx.array, int]:
            if source == "fast":
                return super().candidate(h, j)
            start, stop = self.intervals[j]
            h = self._slow(h, start, stop)
            return h, h[:, -1:], stop

        def exits(self, j: int, logits: mx.array, h_exit: mx.array, trail: list) -> bool:
            return True if schedule else super().exits(j, logits, h_exit, trail)

    return Variant
