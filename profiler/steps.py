"""The two decodes of one answer: unmeasured (as a user runs it) and measured (one span per step).

A step is one resumption of the decoder's generator that ran the model: a plain token, a speculative
draft-and-verify (its accepted drafts are yielded right after, with no work of their own, and join it), or one
token's walk through early exit's gates. The first resumption is the prefill (and the first token). A resumption
that ran no forward joins the step before: the speculative engine's plain stretch asks, before it emits the token
that step computed, whether drafting would pay now (a prompt lookup), and early exit fills deferred layers after
the last token.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Sequence

from tqdm.auto import tqdm

from .spans import Recorder, Span

MODEL = {"forward", "verify", "embed", "attention", "mlp"}  # a resumption with one of these ran the model


@dataclass
class Run:
    tokens: list[int]
    prompt_s: float  # prefill and the first token
    decode_s: float  # the first token to the last
    peak_memory_gb: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Tokens after the first over the time from the first to the last (prefill excluded, as m2r2-bench)."""
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 and len(self.tokens) > 1 else 0.0


@dataclass
class Step:
    span: int  # its index in the recorder
    context: int  # positions in the cache when it began
    events: list = field(default_factory=list)  # the TokenEvents it emitted


def _run(events: list) -> Run:
    last = events[-1]
    peak = max(e.timing.peak_memory_gb for e in events)
    return Run([e.token for e in events], last.timing.prompt_time_s, last.timing.elapsed_s, peak)


def decode(decoder, prompt: Sequence[int], generation, cache, label: str) -> Run:
    """One answer, unmeasured."""
    events = []
    with tqdm(total=generation.max_tokens, desc=label, unit="tok", leave=False, file=sys.stderr) as bar:
        for ev in decoder(prompt, cache, generation):
            events.append(ev)
            bar.update()
    return _run(events)


def decode_measured(decoder, prompt: Sequence[int], generation, cache, recorder: Recorder) -> tuple[Run, list[Step]]:
    """One answer with the recorder on: a top-level span per step, the wrapped calls nested in it."""
    it = iter(decoder(prompt, cache, generation))
    steps: list[Step] = []
    recorder.on = True
    try:
        with tqdm(total=generation.max_tokens, desc="measured", unit="tok", leave=False, file=sys.stderr) as bar:
            while True:
                context = len(cache)
                kind = "step" if steps else "prefill"
                index = recorder.open(f"step {len(steps)}" if steps else "prefill", kind)
                try:
                    ev = next(it)
                except StopIteration:
                    ev = None
                recorder.close(index)
                if steps and (ev is None or not any(s.kind in MODEL for s in recorder.spans[index + 1 :])):
                    _join(recorder, steps[-1].span, index, last=ev is None)  # no forward: the step before's
                    if ev is not None:
                        steps[-1].events.append(ev)
                elif ev is not None:
                    steps.append(Step(index, context, [ev]))
                if ev is None:
                    break
                bar.update()
    finally:
        recorder.on = False
    children = recorder.children()
    for step in steps:
        found = [recorder.spans[i] for i in recorder.subtree(step.span, children)]
        recorder.spans[step.span].args.update(step_args(step, found))
    return _run([e for s in steps for e in s.events]), steps


def _join(recorder: Recorder, into: int, index: int, last: bool) -> None:
    """Make the last span (and its subtree, which follows it) part of span ``into``: without work (an accepted
    draft yielded), its time; else a phase of that step, the work after the last token (``last``: early exit's
    deferred fills) or a resumption that ran no forward (the plain stretch's check whether to draft)."""
    if len(recorder.spans) == index + 1:
        recorder.spans[into].end = recorder.spans.pop(index).end
        return
    span = recorder.spans[index]
    recorder.spans[into].end = span.end
    span.parent = into
    span.kind, span.name = ("tail", "after the last token") if last else ("resume", "resumed without a forward")


def step_args(step: Step, spans: Sequence[Span] = ()) -> dict:
    """The step's plan for the trace: tokens emitted, accepted drafts and their drafters, what the engine chose,
    the positions the full model verified and the fast stream's draft steps (``spans``: the step's subtree), and
    early exit's exit depths."""
    events = step.events
    args = {"context": step.context, "tokens": len(events), "accepted": sum(e.drafted for e in events)}
    plans = [e.spec.plan for e in events if e.spec and e.spec.plan]
    if plans:
        args["plan"] = plans[0]
    drafters = sorted({e.spec.source for e in events if e.drafted})
    if drafters:
        args["drafters"] = drafters
    verified = [s.args["positions"] for s in spans if s.kind == "verify" and "positions" in s.args]
    if verified:
        args["positions_verified"] = sum(verified)
    drafted = sum(s.args.get("draft_steps", 0) for s in spans if s.kind == "draft")
    if drafted:
        args["draft_steps"] = drafted
    exits = sorted({e.exit_layer for e in events if not e.drafted})
    if events and exits and exits != [events[0].num_layers]:
        args["exit_layers"] = [e.exit_layer for e in events]
    return args
