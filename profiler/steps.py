"""The two decodes of one answer: unmeasured (as a user runs it) and measured (one span per step).

A step is one resumption of the decoder's generator that ran the model: a plain token, a speculative
draft-and-verify (its accepted drafts are yielded right after, with no work of their own, and join it), or one
token's walk through early exit's gates. The first resumption is the prefill (and the first token).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Sequence

from tqdm.auto import tqdm

from .spans import Recorder


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
    return Run([e.token for e in events], last.prompt_time_s, last.elapsed_s, max(e.peak_memory_gb for e in events))


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
                ran = len(recorder.spans) > index + 1
                if steps and not ran:  # yielded without work (an accepted draft): part of the step before
                    recorder.spans[steps[-1].span].end = recorder.spans.pop(index).end
                    if ev is not None:
                        steps[-1].events.append(ev)
                elif ev is None:  # work after the last token (early exit's deferred fill): the last step's
                    if steps:
                        _absorb(recorder, steps[-1].span, index)
                else:
                    steps.append(Step(index, context, [ev]))
                if ev is None:
                    break
                bar.update()
    finally:
        recorder.on = False
    for step in steps:
        recorder.spans[step.span].args.update(step_args(step))
    return _run([e for s in steps for e in s.events]), steps


def _absorb(recorder: Recorder, into: int, index: int) -> None:
    """Make the last span (and its subtree, which follows it) part of span ``into``."""
    recorder.spans[into].end = recorder.spans[index].end
    recorder.spans[index].parent = into
    recorder.spans[index].kind, recorder.spans[index].name = "tail", "after the last token"


def step_args(step: Step) -> dict:
    """The step's plan for the trace: tokens emitted, accepted drafts, what the engine chose, exit depths."""
    events = step.events
    args = {"context": step.context, "tokens": len(events), "accepted": sum(e.drafted for e in events)}
    plans = [e.plan for e in events if e.plan]
    if plans:
        args["plan"] = plans[0]
    exits = sorted({e.exit_layer for e in events})
    if events and exits != [events[0].num_layers]:
        args["exit_layers"] = [e.exit_layer for e in events]
    return args
