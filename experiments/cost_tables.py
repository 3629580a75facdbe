"""Devices' step costs as tables, and a clock that replays them: the speculative engine's planner then learns from
the device's costs instead of this machine's wall clock, so its decisions (and each method's modelled time) can be
checked against every device's costs on this CPU.

A table prices each forward of n positions in plain steps (a verification; n = 1 is the plain step) and a fast-stream
draft step. ``ModelledClock`` is the engine's tracer, whose clock (``now``) the cache's forwards and the drafter's steps
advance by what they cost on the table's device (an answer's first forward, the prefill, is free: the
methods are compared on decoding).

    clock = ModelledClock(TABLES["h200"])
    engine = speculative_engine(lm, drafters, planner, max_draft=8, name="speculative", tracer=clock)
    cache = PromptCache(lm.model, tracer=clock); clock.start_answer()
    ... decode ...; clock.decode_s
"""

from __future__ import annotations

from dataclasses import dataclass

from m2r2_mlx.tracing import Tracer

import numpy as np


@dataclass(frozen=True)
class CostTable:
    name: str
    source: str  # where the figures come from
    plain_s: float  # a plain one-token step, seconds
    verify: dict  # positions -> a forward over them, in plain steps (measured points; between them: linear)
    draft: float  # one fast-stream draft step, in plain steps

    def forward_s(self, positions: int) -> float:
        points = sorted({1: 1.0, **self.verify}.items())
        xs, ys = zip(*points)
        return self.plain_s * float(np.interp(positions, xs, ys))  # flat past the widest measured


TABLES = {
    "cpu": CostTable(
        "cpu",
        "this project's 2-core x86 CPU, SmolLM2-135M float32, OpenBLAS "
        "(experiments.verify_cost, experiments.draft_calibration)",
        0.0555,
        {2: 1.12, 3: 1.23, 4: 1.32, 6: 1.40, 8: 1.42, 16: 1.75},
        0.25,
    ),
    "h200": CostTable(
        "h200",
        "one H200 through MLX's CUDA backend, float32 (docs/accelerator.md): any verification 2.3-2.7 plain steps; "
        "a draft step priced as the first gate's share of a launch-bound step",
        0.0059,
        {2: 2.29, 4: 2.29, 8: 2.37, 16: 2.34},
        0.25,
    ),
    "apple-gpu": CostTable(
        "apple-gpu",
        "an Apple GPU as vllm-mlx #699 reports it: a width-2 verification 1.59 plain steps, width 4 about 1.8",
        0.012,
        {2: 1.59, 4: 1.8, 8: 2.0, 16: 2.3},
        0.25,
    ),
}


def positions(tokens) -> int:
    return int(getattr(tokens, "size", None) or len(tokens))


class ModelledClock(Tracer):
    """Seconds on ``table``'s device: each forward and draft step advances it by its cost there."""

    def __init__(self, table: CostTable):
        self.table = table
        self.elapsed = 0.0
        self.decode_s = 0.0  # this answer's, after its prefill
        self.prefill = False
        self.log: list[tuple[str, int]] = []  # this answer's priced work: ("forward", positions), ("draft", steps)

    def now(self) -> float:
        return self.elapsed

    def start_answer(self) -> None:
        self.prefill, self.decode_s, self.log = True, 0.0, []

    def _advance(self, seconds: float) -> None:
        self.elapsed += seconds
        self.decode_s += seconds

    def call(self, kind, fn, *args, **kwargs):
        out = fn(*args, **kwargs)
        if kind == "forward":
            if self.prefill:
                self.prefill = False
            else:
                self.log.append(("forward", positions(args[0])))
                self._advance(self.table.forward_s(positions(args[0])))
        elif kind == "draft":
            self.log.append(("draft", out))
            self._advance(out * self.table.draft * self.table.plain_s)
        return out


def priced(log: list[tuple[str, int]], table: CostTable) -> float:
    """The seconds an answer's work (ModelledClock.log) takes on ``table``'s device: what a method whose choices do
    not depend on its costs (plain, lookup, the fast stream alone) would have taken there."""
    return sum(table.forward_s(n) if kind == "forward" else n * table.draft * table.plain_s for kind, n in log)
