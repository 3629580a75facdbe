"""The roofline: the bytes decoding reads against what this machine streams, and where compute limits instead.

Bytes per token are the measured run's: every timed call adds the weights it read (a layer's arrays once per
call, whatever the positions; a mixture-of-experts block its routed experts; attention every earlier position's
keys and values; an embedding its rows), so early exit's skipped layers and the fast stream's extra layers count
as they happen. The achieved rate is those bytes at the unmeasured run's tokens/s. A forward of n positions
cannot take less than max(bytes / bandwidth, FLOPs / compute rate): below the ridge it is memory-bound (one token
or n cost about the same), above it compute-bound (prefill, wide verification).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .probe import Machine
from .spans import Recorder
from .steps import Step
from .table import SizeStat


@dataclass(frozen=True)
class Bound:
    """One forward's floors on this machine and what it measured."""

    positions: int
    bytes: float
    flops: float
    memory_s: float  # bytes / bandwidth
    compute_s: float  # FLOPs / compute rate
    measured_s: float

    @property
    def limit(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "memory"

    @property
    def floor_s(self) -> float:
        return max(self.memory_s, self.compute_s)


def bound(positions: int, read: float, flops: float, measured_s: float, machine: Machine) -> Bound:
    return Bound(
        positions, read, flops, read / (machine.bandwidth_gbs * 1e9), flops / (machine.gflops * 1e9), measured_s
    )


def totals(recorder: Recorder, steps: Sequence[Step], kinds: tuple[str, ...]) -> tuple[int, int, int]:
    """(bytes, FLOPs, tokens) over the steps of the given kinds."""
    spans, children = recorder.spans, recorder.children()
    read = flops = tokens = 0
    for step in steps:
        if spans[step.span].kind not in kinds:
            continue
        tokens += len(step.events)
        for i in recorder.subtree(step.span, children):
            read += spans[i].bytes
            flops += spans[i].flops
    return read, flops, tokens


def _prefill(recorder: Recorder, steps: Sequence[Step], machine: Machine) -> Bound:
    """The prompt's forwards (chunks of many positions) in the first step, which also runs the first decode
    forward."""
    spans, children = recorder.spans, recorder.children()
    found = [
        i
        for i in (recorder.subtree(steps[0].span, children) if steps else ())
        if spans[i].kind == "forward" and int(spans[i].name.split()[-1]) > 1
    ]
    read = flops = 0
    for i in found:
        for j in recorder.subtree(i, children):
            read, flops = read + spans[j].bytes, flops + spans[j].flops
    n = sum(int(spans[i].name.split()[-1]) for i in found)
    return bound(n, read, flops, sum(spans[i].seconds for i in found), machine)


@dataclass(frozen=True)
class Roofline:
    bytes_per_token: float
    achieved_gbs: float  # bytes per token x the unmeasured run's tokens/s
    share: float  # achieved / this machine's streaming bandwidth
    prefill: Bound
    forwards: list[Bound]  # full-model forwards by positions (plain 1, verifications n)
    ridge_positions: float  # where one forward turns compute-bound

    def to_json(self) -> dict:
        as_dict = lambda b: {**b.__dict__, "limit": b.limit}
        return {
            "bytes_per_token": self.bytes_per_token,
            "achieved_gbs": self.achieved_gbs,
            "share_of_bandwidth": self.share,
            "ridge_positions": self.ridge_positions,
            "prefill": as_dict(self.prefill),
            "forwards": [as_dict(b) for b in self.forwards],
        }


def roofline(
    recorder: Recorder, steps: Sequence[Step], sizes: Sequence[SizeStat], unmeasured, machine: Machine
) -> Roofline:
    """``unmeasured``: the unmeasured Run (its tokens/s)."""
    read, _, tokens = totals(recorder, steps, ("step", "tail"))
    per_token = read / max(tokens, 1)
    achieved = per_token * unmeasured.tokens_per_s / 1e9
    prefill = _prefill(recorder, steps, machine)
    forwards = [bound(s.positions, s.bytes, s.flops, s.seconds, machine) for s in sizes]
    one = next((b for b in forwards if b.positions == 1), None)
    ridge = one.memory_s / one.compute_s if one is not None and one.compute_s > 0 else 0.0
    return Roofline(per_token, achieved, achieved / machine.bandwidth_gbs, prefill, forwards, ridge)
