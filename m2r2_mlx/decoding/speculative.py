"""Lossless speculative decoding: drafters propose a tree of tokens, the full model verifies it in one forward.

``Speculator.__call__`` is the mechanism, one step after another (docs/speculative.md, "One step"): propose, plan,
draft, verify and commit, observe, emit. Where the plan verifies nothing, the engine decodes plainly, pipelined as
plain decoding is, until drafting would pay. Greedy output is the full model's greedy output token for token;
sampled output has its distribution.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterator, Sequence

import mlx.core as mx

from ..errors import M2R2Error
from .config import GenerationConfig
from .events import EventStream, TokenEvent
from .generate import start_decoding
from .planner import VerifyAll
from .prompt_cache import PromptCache
from .protocols import Drafter, DraftRequest, Outcome, Planner
from .sampling import NextToken, Sampling
from .tree import DraftTree, describe, supports_trees, verify_tree

FREE_KINDS = ("grammar", "lookup")  # drafters whose tokens used no layer, in the order an event names them


class Speculator:
    """Draft-and-verify decoding over ``model`` (a Decoder) with free drafters (prompt lookup), at most one model
    drafter, and a planner. One instance serves a whole conversation or a server's requests: what the planner
    has learnt carries over. ``max_draft``: the most tokens a path drafts; ``width``: the candidates the drafters
    may propose at the first position; ``name``: the mode it serves."""

    def __init__(
        self,
        model,
        tokenizer,
        drafters: Sequence[Drafter],
        planner: Planner,
        *,
        max_draft: int,
        width: int = 1,
        name: str = "speculative",
        context_length: int | None = None,
    ):
        layers = model.model.layers if hasattr(model, "model") else model.layers
        if width > 1 and not supports_trees(layers):
            raise M2R2Error(
                f"{type(model).__module__} cannot verify draft trees (no rope on its attention); use tree width 1"
            )
        self.model, self.tokenizer, self.planner = model, tokenizer, planner
        self.grammar = next((d for d in drafters if d.kind == "grammar"), None)  # proposes first
        self.free = [d for d in drafters if d.free and d is not self.grammar]
        self.model_drafter = next((d for d in drafters if not d.free), None)
        self.max_draft, self.width, self.name, self.context_length = max_draft, width, name, context_length
        self.exit_layers = sorted({d.exit_layer for d in drafters} | {len(layers)})  # for legends
        self.needs_adapters = self.model_drafter is not None and self.model_drafter.kind == "fast"
        self.note = ""  # one line an app shows when the decoder is built (what it runs without)

    def __call__(
        self, prompt: Sequence[int], cache: PromptCache | None = None, generation: GenerationConfig | None = None
    ) -> Iterator[TokenEvent]:
        """Decode ``prompt``: each accepted draft is an event with ``drafted`` and its ``source``; the step's
        ``plan`` rides on every event."""
        generation = generation or GenerationConfig()
        s, drafter = generation.sampling, self.model_drafter
        keep_states = drafter is not None and drafter.keeps_states
        cache, logits, events, sample = start_decoding(
            self.model, self.tokenizer, list(prompt), cache, generation, self.context_length, keep_states
        )
        constraint, rows = sample.constraint, events.logprobs is not None
        ev = events.event(int(sample(logits).item()), logprobs=sample.logprobs if rows else None)
        yield ev
        while not ev.finish_reason:
            y, tic = ev.token, time.perf_counter()
            request = self._request(cache, cache.tokens + [y], events, s, constraint)
            tree = self._propose(request)  # 1. propose
            plan = self.planner.plan(tree, request)  # 2. plan
            if plan.plain:
                for ev in self._plain_stretch(cache, tree, events, s, constraint):  # its last event: the next y
                    yield ev
                continue
            tree, draft_seconds, draft_steps = tree.keep(plan.keep), 0.0, 0
            if plan.draft is not None:  # 3. the model drafter, as planned
                t0 = time.perf_counter()
                draft_steps = drafter.propose(tree, plan.draft)
                draft_seconds = time.perf_counter() - t0
                if s.greedy:  # exact for any tree: drop what the drafts did not make worth verifying
                    tree = tree.keep(self.planner.plan(tree, replace(request, limit=0)).keep)
            history = cache.tokens if s.reads_history else ()  # 4. verify and commit
            if constraint is not None:  # just after the root
                constraint.at(cache.tokens + [y])
            verified = verify_tree(cache.forward_tree(tree), tree, s, history, constraint, rows)
            path, token = verified.path, verified.token
            cache.commit(path, len(tree))
            seconds = time.perf_counter() - tic  # 5. observe
            self.planner.observe(Outcome(tree, path, token, seconds, draft_seconds, draft_steps))
            status = describe(tree)
            for i, node in enumerate(path[1:]):  # 6. emit
                source = next(k for k in (*FREE_KINDS, drafter and drafter.kind) if k in tree.sources[node])
                layer = 0 if source in FREE_KINDS else drafter.exit_layer
                lp = verified.logprobs[i] if rows else None
                ev = events.event(
                    tree.tokens[node], exit_layer=layer, drafted=True, source=source, plan=status, logprobs=lp
                )
                yield ev
                if ev.finish_reason:
                    return
            ev = events.event(token, plan=status, logprobs=verified.logprobs[-1] if rows else None)
            yield ev

    def _request(
        self, cache: PromptCache, context: list[int], events: EventStream, s: Sampling, constraint
    ) -> DraftRequest:
        limit = min(events.max_tokens - events.n - 1, self.max_draft)
        return DraftRequest(cache, context, limit, s, events.eos_ids, self.width, constraint=constraint)

    def _propose(self, request: DraftRequest) -> DraftTree:
        """The free drafters' proposals after the root: the grammar's forced text first, the others after it."""
        tree = DraftTree.root(request.context[-1])
        if self.grammar is not None and request.constraint is not None:
            self.grammar.propose(tree, request)
            if len(tree) > 1:
                request.context = request.context + tree.tokens[1:]
                request.after = len(tree) - 1
        for free in self.free:
            free.propose(tree, request)
        return tree

    def _plain_stretch(
        self, cache: PromptCache, proposals: DraftTree, events: EventStream, s: Sampling, constraint
    ) -> Iterator[TokenEvent]:
        """Plain decoding after ``proposals``' root, each step queued before the previous token is read (as generate
        does; a draft-and-verify step cannot), while the planner expects no draft to pay. After each token the
        planner is asked whether drafting after it would; the stretch then ends with the token in flight emitted.
        Leaving depends only on tokens already read, never on the one in flight. The planner observes each plain
        step: its time (the pipelined one that drafting has to beat) and its token after the unverified proposals.
        """
        y = proposals.tokens[0]
        context = cache.tokens + [y]  # ints: reading the cache's would wait for the step in flight
        sample = NextToken(s, context[:-1], constraint)  # as generate draws it
        rows = events.logprobs is not None

        def step(token: mx.array) -> tuple[mx.array, mx.array | None]:  # feed ``token`` (shape (1,)); the next one
            logits = cache.forward(token)[-1]
            if constraint is not None:  # the forward runs while the grammar reads the token
                mx.async_eval(logits)
            sample.feed(token)
            token = sample(logits)
            lp = sample.logprobs if rows else None
            mx.async_eval(token, lp)
            return token, lp

        (y, lp), tic, leave = step(mx.array([y])), None, False
        while True:
            next_y = None if leave or events.n + 1 >= events.max_tokens else step(y[None])
            context.append(int(y.item()))
            toc = time.perf_counter()
            seconds = None if tic is None else toc - tic  # (the first waited for its own forward: not pipelined)
            self.planner.observe(Outcome(proposals, [0], context[-1], seconds, plain=True))
            ev = events.event(context[-1], plan="plain", logprobs=lp)
            yield ev
            tic = time.perf_counter()  # the caller's time with the token is not the step's
            if ev.finish_reason or leave:
                return
            request = self._request(cache, context, events, s, constraint)
            proposals = self._propose(request)
            # one more token comes before the draft step: leave only where that step may still draft
            leave = events.max_tokens - events.n > 2 and not self.planner.plan(proposals, request).plain
            if events.n % 256 == 0:
                mx.clear_cache()
            y, lp = next_y


def speculative_generate(
    model,
    tokenizer,
    prompt: Sequence[int],
    drafter: Drafter,
    generation: GenerationConfig | None = None,
    *,
    max_draft: int,
    cache: PromptCache | None = None,
) -> Iterator[TokenEvent]:
    """Speculative decoding with one drafter whose every proposal is verified (planner.VerifyAll)."""
    engine = Speculator(model, tokenizer, [drafter], VerifyAll([drafter]), max_draft=max_draft)
    return engine(prompt, cache, generation)
