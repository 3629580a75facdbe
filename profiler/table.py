"""The component table: each decode step's time, split by what ran it.

Every span's own time (its duration less its children's) goes to one row: the phase it ran in (the nearest
enclosing plain forward, planning, drafting, verification, commit; or the step itself) and its component (the
outermost layer-level call it is part of: a feed-forward block's time includes the residual adds it evaluates).
Expert loads keep a row of their own wherever they happen. The step's own time, in no timed call, is the
framework and Python overhead. So the rows add up to the measured steps exactly; the check that matters is that
the steps cover the measured decode's wall time (the rest is this loop's own bookkeeping).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from .spans import Recorder
from .steps import Step

PHASES = {  # kind -> label (the phase's own time: its Python outside the timed calls)
    "forward": "plain forward",
    "plan": "planning",
    "lookup": "prompt lookup",
    "draft": "fast-stream drafting",
    "verify": "verification (keeping the accepted prefix)",
    "tail": "after the last token (deferred fills)",
    "resume": "resumed without a forward (whether to draft)",
    "step": "step",
}
COMPONENTS = {  # kind -> label, in table order
    "embed": "embedding",
    "attention": "attention",
    "mlp": "feed-forward",
    "adapter": "fast-stream adapters",
    "head": "final norm and LM head",
    "draft-head": "draft LM head (vocabulary subset)",
    "exit-head": "exit LM head (vocabulary subset)",
    "exit-rule": "exit decision",
    "sample": "sampling",
    "accept": "acceptance (verify)",
    "expert-stall": "expert loads (the forward pass stalled)",
}
LAYERED = {"attention", "mlp", "adapter"}
OWN = {"expert-stall"}
OVERHEAD = "framework and Python overhead"


@dataclass(frozen=True)
class Row:
    phase: str  # a PHASES kind
    component: str  # "attention:0" (layer group 0), "sample", ... or "" for the phase's own time
    label: str
    seconds: float  # over all decode steps
    calls: int


def groups_of(num_layers: int, gates: Sequence[int] | None) -> list[tuple[int, int]]:
    """Layer groups (start, stop): the exit intervals of the adapters' gates, else five even ones."""
    stops = [g for g in (gates or []) if 0 < g < num_layers]
    if not stops:
        step = max(1, round(num_layers / 5))
        stops = list(range(step, num_layers, step))
    bounds = [0, *stops, num_layers]
    return list(zip(bounds[:-1], bounds[1:]))


def _group(groups: list[tuple[int, int]], layer: int | None) -> int:
    return next((g for g, (a, b) in enumerate(groups) if layer is not None and a <= layer < b), 0)


def _label(phase: str, component: str, groups: list[tuple[int, int]], moe: bool) -> str:
    if not component:
        return OVERHEAD if phase == "step" else f"{PHASES[phase]}: other"
    kind, _, g = component.partition(":")
    text = COMPONENTS[kind]
    if kind == "mlp" and moe:
        text = "mixture-of-experts block"
    if g:
        a, b = groups[int(g)]
        text += f", layers {a + 1}-{b}"
    return text if phase == "step" else f"{PHASES[phase]}: {text}"


def component_rows(recorder: Recorder, steps: Sequence[Step], groups: list[tuple[int, int]], moe: bool) -> list[Row]:
    """The rows over the decode steps (the prefill left out), in table order."""
    spans, children = recorder.spans, recorder.children()
    seconds: dict[tuple[str, str], float] = defaultdict(float)
    calls: dict[tuple[str, str], int] = defaultdict(int)

    def visit(i: int, phase: str, component: str) -> None:
        s = spans[i]
        if s.kind in PHASES and not (phase == "verify" and s.kind == "forward"):  # a chain verifies by forward
            phase, component = s.kind, ""
            calls[(phase, "")] += 1
        elif s.kind in OWN or (not component and s.kind in COMPONENTS):
            component = f"{s.kind}:{_group(groups, s.layer)}" if s.kind in LAYERED else s.kind
            calls[(phase, component)] += 1
        kids = children.get(i, [])
        seconds[(phase, component)] += s.seconds - sum(spans[c].seconds for c in kids)
        for c in kids:
            visit(c, phase, component)

    for step in steps:
        if spans[step.span].kind == "step":
            visit(step.span, "step", "")
    order = list(PHASES)
    kinds = list(COMPONENTS)

    def rank(key: tuple[str, str]):
        phase, component = key
        kind, _, g = component.partition(":")
        # the step's own rows last, its overhead at the very end
        return (order.index(phase), kind == "", kinds.index(kind) if kind else 0, int(g or 0))

    return [Row(p, c, _label(p, c, groups, moe), seconds[(p, c)], calls[(p, c)]) for p, c in sorted(seconds, key=rank)]


@dataclass(frozen=True)
class SizeStat:
    positions: int
    count: int
    seconds: float  # mean per call
    bytes: float  # mean per call
    flops: float


def verification_sizes(recorder: Recorder, steps: Sequence[Step]) -> list[SizeStat]:
    """Full-model forwards in the decode steps by positions: plain forwards (1) and verifications (n)."""
    spans, children = recorder.spans, recorder.children()
    found: dict[int, list[tuple[float, int, int]]] = defaultdict(list)
    for step in steps:
        if spans[step.span].kind != "step":
            continue
        for i in recorder.subtree(step.span, children):
            s = spans[i]
            inside_verify = s.kind == "forward" and spans[s.parent].kind == "verify"
            if s.kind in ("forward", "verify") and not inside_verify:
                n = int(s.name.split()[-1])
                sub = list(recorder.subtree(i, children))
                found[n].append((s.seconds, sum(spans[j].bytes for j in sub), sum(spans[j].flops for j in sub)))
    return [
        SizeStat(n, len(v), sum(x[0] for x in v) / len(v), sum(x[1] for x in v) / len(v), sum(x[2] for x in v) / len(v))
        for n, v in sorted(found.items())
    ]


def draft_steps(recorder: Recorder, steps: Sequence[Step]) -> tuple[int, float]:
    """(fast-stream draft steps taken, seconds drafting) over the decode steps."""
    spans, children = recorder.spans, recorder.children()
    total, seconds = 0, 0.0
    for step in steps:
        if spans[step.span].kind != "step":
            continue
        for i in recorder.subtree(step.span, children):
            if spans[i].kind == "draft":
                total += int(spans[i].args.get("draft_steps", 0))
                seconds += spans[i].seconds
    return total, seconds
