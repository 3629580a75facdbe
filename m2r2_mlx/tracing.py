"""Hooks that let a tool watch a decode without reaching into it, in the style of PyTorch's forward hooks.

An engine (plain, speculative, early exit, the expert cache) is handed a ``Tracer`` when it is built and runs each
phase of a step through ``tracer.call(kind, fn, *args)``: the default tracer just calls ``fn``; a profiler's times
it. After a speculative step's plan and verification, and for every token emitted, the engine calls ``on_plan``,
``on_verify`` and ``on_emit``. The adaptive engines time their steps on ``tracer.now()`` (wall time by default; a
study replays a device's costs instead). Nothing outside the engine ever replaces one of its functions or
methods.

Phase kinds (what a profiler groups by): "sample" (the next token from logits), "forward" (a cache forward),
"propose" (a free drafter: prompt lookup, the grammar), "plan", "observe", "draft" (the model drafter's steps),
"draft-head", "verify" (a verification step), "accept" (the acceptance rule), "exit-head", "exit-rule",
"expert-stall" (an expert cache waiting for loads).
"""

from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class Tracer:
    """Runs and observes a decode's phases; this base class changes nothing and records nothing."""

    def call(self, kind: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run one phase: ``fn(*args, **kwargs)``."""
        return fn(*args, **kwargs)

    def now(self) -> float:
        """Seconds, for the costs an adaptive engine learns from."""
        return time.perf_counter()

    def on_plan(self, draft, plan) -> None:
        """A speculative step's plan (protocols.StepPlan) for the free drafters' ``draft``."""

    def on_verify(self, outcome) -> None:
        """A speculative step's outcome (protocols.Outcome), plain steps included."""

    def on_emit(self, event) -> None:
        """A token event, as the engine yields it."""


NO_TRACE = Tracer()
