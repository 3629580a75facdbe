"""Lossless speculative decoding: drafters propose a chain of tokens, the full model verifies it in one forward.

``Speculator.__call__`` is the mechanism, one step after another (docs/speculative.md, "One step"): propose, plan,
draft, verify and keep, observe, emit. Where the plan verifies nothing, the engine decodes plainly, pipelined as
plain decoding is, until drafting would pay. Greedy output is the full model's greedy output token for token;
sampled output has its distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import mlx.core as mx

from .. import host
from ..tracing import NO_TRACE, Tracer
from .config import GenerationConfig
from .draft import Draft, Verified, verify
from .events import EventStream, SpecStep, TokenEvent
from .generate import start_decoding
from .history import TokenHistory
from .prompt_cache import PromptCache
from .protocols import Drafter, DraftRequest, Outcome, Planner
from .sampling import NextToken, Sampling


@dataclass(frozen=True)
class SpeculatorSettings:
    max_draft: int  # the most tokens a step drafts
    name: str = "speculative"  # the method it serves
    context_length: int | None = None  # the model's: a prompt must leave room for an answer
    note: str = ""  # one line for the app to show when the decoder is built


class Speculator:
    """Draft-and-verify decoding over ``model`` (a Decoder) with free drafters (the grammar's forced text, prompt
    lookup), at most one model drafter, and a planner. One instance serves a whole conversation or a server's
    requests: what the planner has learnt carries over. ``tracer``: the hooks a tool watches through, and the clock
    the planner's costs are measured on (Tracer.now)."""

    def __init__(
        self,
        model,
        tokenizer,
        drafters: Sequence[Drafter],
        planner: Planner,
        settings: SpeculatorSettings,
        tracer: Tracer = NO_TRACE,
    ):
        self.model, self.tokenizer, self.planner, self.tracer = model, tokenizer, planner, tracer
        self.free = [d for d in drafters if d.free]  # in the order they extend a draft: the grammar first
        self.model_drafter = next((d for d in drafters if not d.free), None)
        self.max_draft, self.name, self.context_length = settings.max_draft, settings.name, settings.context_length
        layers = model.model.layers if hasattr(model, "model") else model.layers
        self.layers_used = {d.kind: d.exit_layer for d in drafters}  # by a token each drafter drafts
        self.exit_layers = sorted({*self.layers_used.values(), len(layers)})  # for legends
        self.needs_adapters = self.model_drafter is not None and self.model_drafter.kind == "fast"
        self.note = settings.note

    def __call__(
        self, prompt: Sequence[int], cache: PromptCache | None = None, generation: GenerationConfig | None = None
    ) -> Iterator[TokenEvent]:
        """Decode ``prompt``: each event's ``spec`` names the drafter of an accepted draft and the step's plan."""
        generation = generation or GenerationConfig()
        s, drafter, trace = generation.sampling, self.model_drafter, self.tracer
        keep_states = drafter is not None and drafter.keeps_states
        cache, logits, events, sample = start_decoding(
            self.model, self.tokenizer, list(prompt), cache, generation, self.context_length, keep_states
        )
        constraint, rows = sample.constraint, events.wants_logprobs
        token = int(host.read(trace.call("sample", sample, logits)))
        ev = self._emit(events, token, sample.logprobs if rows else None, None, "")
        yield ev
        history = TokenHistory([*cache.tokens, ev.token])  # ends with the root: the last token, not yet in the cache
        while not ev.finish_reason:
            tic = self.tracer.now()
            request = self._request(cache, history, events, s, constraint)
            draft = self._propose(request)  # 1. propose
            plan = trace.call("plan", self.planner.plan, draft, request)  # 2. plan
            trace.on_plan(draft, plan)
            if plan.plain:
                for ev in self._plain_stretch(cache, history, draft, events, s, constraint):  # last: the next y
                    yield ev
                continue
            draft, draft_seconds, draft_steps = draft.keep(plan.keep), 0.0, 0
            if plan.draft is not None:  # 3. the model drafter, as planned
                t0 = self.tracer.now()
                draft_steps = trace.call("draft", drafter.propose, draft, plan.draft)
                draft_seconds = self.tracer.now() - t0
                if s.greedy:  # exact for any draft: drop the drafts that did not make verifying them worth it
                    draft = draft.keep(trace.call("plan", self.planner.plan, draft, replace(request, limit=0)).keep)
            verified = trace.call("verify", self.verify_step, cache, draft, s, constraint, rows, history.view())
            accepted, lps = verified.accepted, verified.logprobs  # 4. verified
            seconds = self.tracer.now() - tic  # 5. observe
            outcome = Outcome(draft, accepted, verified.token, seconds, draft_seconds, draft_steps)
            trace.call("observe", self.planner.observe, outcome)
            trace.on_verify(outcome)
            history.extend([*draft.tokens[1 : accepted + 1], verified.token])
            status = draft.describe()
            for i in range(1, accepted + 1):  # 6. emit
                ev = self._emit(events, draft.tokens[i], lps[i - 1] if rows else None, draft.sources[i], status)
                yield ev
                if ev.finish_reason:
                    return
            ev = self._emit(events, verified.token, lps[-1] if rows else None, None, status)
            yield ev

    def _emit(self, events: EventStream, token: int, row, source: str | None, plan: str) -> TokenEvent:
        """The event for ``token``: an accepted draft of ``source``'s, or the full model's own (``source`` None)."""
        layers = self.layers_used[source] if source else events.num_layers
        ev = events.event(token, row=row, spec=SpecStep(source, layers, plan))
        self.tracer.on_emit(ev)
        return ev

    def verify_step(self, cache: PromptCache, draft: Draft, s: Sampling, constraint, rows: bool, context) -> Verified:
        """One forward of the full model over ``draft``; the cache keeps the accepted prefix, as if it had been
        decoded token by token. ``context``: every token so far, ending with the draft's root."""
        history = context[:-1][-s.history_size :].tolist() if s.reads_history else ()  # all it reads
        if constraint is not None:  # just after the root
            constraint.at(context)
        logits = cache.forward(draft.ids())
        verified = self.tracer.call("accept", verify, logits, draft, s, history, constraint, rows)
        cache.trim(len(draft) - 1 - verified.accepted)
        return verified

    def _request(self, cache, history: TokenHistory, events: EventStream, s: Sampling, constraint) -> DraftRequest:
        limit = min(events.max_tokens - events.n - 1, self.max_draft)
        return DraftRequest(cache, history.view(), limit, s, events.eos_ids, constraint=constraint, tracer=self.tracer)

    def _propose(self, request: DraftRequest) -> Draft:
        """The free drafters' proposals after the root, each extending the chain where the one before stopped."""
        draft = Draft.root(int(request.context[-1]))
        for free in self.free:
            self.tracer.call("propose", free.propose, draft, request)
        return draft

    def _plain_stretch(
        self, cache: PromptCache, history: TokenHistory, proposals: Draft, events: EventStream, s: Sampling, constraint
    ) -> Iterator[TokenEvent]:
        """Plain decoding after ``proposals``' root, each step queued before the previous token is read (as generate
        does; a draft-and-verify step cannot), while the planner expects no draft to pay. After each token the
        planner is asked whether drafting after it would; the stretch then ends with the token in flight emitted.
        Leaving depends only on tokens already read, never on the one in flight. The planner observes each plain
        step: its time (the pipelined one that drafting has to beat) and its token after the unverified proposals.
        """
        y = proposals.tokens[0]  # ``history`` ends with it; it gains each token as read (not the cache's: reading
        sample = NextToken(s, history.view()[:-1], constraint)  # those would wait for the step in flight)
        rows, trace = events.wants_logprobs, self.tracer

        def step(token: mx.array) -> tuple[mx.array, mx.array | None]:  # feed ``token`` (shape (1,)); the next one
            logits = cache.forward(token)[-1]
            if constraint is not None:  # the forward runs while the grammar reads the token
                mx.async_eval(logits)
            sample.feed(token)
            token = trace.call("sample", sample, logits)
            lp = sample.logprobs if rows else None
            mx.async_eval(token, lp)
            return token, lp

        (y, lp), tic, leave = step(mx.array([y])), None, False
        while True:
            next_y = None if leave or events.n + 1 >= events.max_tokens else step(y[None])
            history.append(int(host.read(y)))
            toc = self.tracer.now()
            # timed only with the next step queued in it: the first waited for its own forward (not pipelined), and
            # where evaluation runs at once (MLX's CPU backend), the last one's forward ran in the step before
            seconds = None if tic is None or next_y is None else toc - tic
            outcome = Outcome(proposals, 0, history.last, seconds, plain=True)
            trace.call("observe", self.planner.observe, outcome)
            trace.on_verify(outcome)
            ev = self._emit(events, history.last, lp, None, "plain")
            yield ev
            tic = self.tracer.now()  # the caller's time with the token is not the step's
            if ev.finish_reason or leave:
                return
            request = self._request(cache, history, events, s, constraint)
            proposals = self._propose(request)
            # one more token comes before the draft step: leave only where that step may still draft
            leave = (
                events.max_tokens - events.n > 2 and not trace.call("plan", self.planner.plan, proposals, request).plain
            )
            if events.n % 256 == 0:
                mx.clear_cache()
            y, lp = next_y
