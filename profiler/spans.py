"""Spans: the timed calls of the measured run, nested as they were made.

MLX is lazy: calling a layer only builds a graph, and the work runs where something is evaluated, often in a
later component. So a wrapped call evaluates its outputs before its span closes (``timed``): the span then holds
the graph building and the computation of that component and nothing else. That boundary is what measuring
costs (no step is pipelined with the next, and each evaluation is a synchronisation), which is why the profile
also decodes once unmeasured and reports both rates.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import mlx.core as mx


@dataclass
class Span:
    name: str  # what the trace shows: "attention L3", "verify 5", "step 12"
    kind: str  # what the component table groups by: "attention", "mlp", "verify", "step", ...
    start: float
    end: float = 0.0
    parent: int = -1  # index of the enclosing span in Recorder.spans; -1 at the top
    layer: int | None = None  # the model layer a layer component ran (0-based)
    args: dict = field(default_factory=dict)  # the trace's arguments (a step's plan, positions verified)
    bytes: int = 0  # weights and keys/values the call read (the roofline)
    flops: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Recorder:
    """Spans in call order. ``on`` is False outside the measured run: wrappers then call straight through."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.spans: list[Span] = []
        self._open: list[int] = []
        self.on = False

    def open(self, name: str, kind: str, layer: int | None = None) -> int:
        parent = self._open[-1] if self._open else -1
        self.spans.append(Span(name, kind, self.clock(), parent=parent, layer=layer))
        self._open.append(len(self.spans) - 1)
        return len(self.spans) - 1

    def close(self, index: int) -> Span:
        span = self.spans[index]
        span.end = self.clock()
        self._open.remove(index)
        return span

    @contextmanager
    def span(self, name: str, kind: str) -> Iterator[Span]:
        index = self.open(name, kind)
        try:
            yield self.spans[index]
        finally:
            self.close(index)

    def children(self) -> dict[int, list[int]]:
        """Each span's direct children, in call order (-1: the top-level spans)."""
        out: dict[int, list[int]] = {}
        for i, s in enumerate(self.spans):
            out.setdefault(s.parent, []).append(i)
        return out

    def subtree(self, index: int, children: dict[int, list[int]] | None = None) -> Iterator[int]:
        children = self.children() if children is None else children
        stack = [index]
        while stack:
            i = stack.pop()
            yield i
            stack.extend(reversed(children.get(i, [])))


def arrays(value) -> list[mx.array]:
    """The MLX arrays in a call's result (an array, or tuples, lists and dicts of them)."""
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (tuple, list)):
        return [a for v in value for a in arrays(v)]
    if isinstance(value, dict):
        return [a for v in value.values() for a in arrays(v)]
    return []


# (positional args, keyword args) -> (bytes read, FLOPs), computed inside the span (microseconds)
Cost = Callable[[tuple, dict], "tuple[int, int]"]
# (positional args, keyword args, result) -> the span's trace arguments
Note = Callable[[tuple, dict, object], dict]


def timed(
    recorder: Recorder,
    fn: Callable,
    kind: str,
    name: str | Callable[[tuple, dict], str],
    layer: int | None = None,
    cost: Cost | None = None,
    note: Note | None = None,
):
    """``fn`` timed as one span while the recorder is on, its result evaluated before the span closes; ``cost``
    gives the bytes and FLOPs the call moved, ``note`` the span's trace arguments; ``name`` may be made from the
    call's arguments."""

    def call(*args, **kwargs):
        if not recorder.on:
            return fn(*args, **kwargs)
        index = recorder.open(name(args, kwargs) if callable(name) else name, kind, layer)
        try:
            if cost is not None:
                span = recorder.spans[index]
                span.bytes, span.flops = cost(args, kwargs)
            out = fn(*args, **kwargs)
            found = arrays(out)
            if found:
                mx.eval(*found)
            if note is not None:
                recorder.spans[index].args.update(note(args, kwargs, out))
            return out
        finally:
            recorder.close(index)

    return call
