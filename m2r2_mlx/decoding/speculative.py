"""Lossless speculative decoding: drafters propose a tree of tokens, one full forward verifies it.

One step, with y the last emitted token (not yet in the cache):
1. prompt lookup proposes the continuations of earlier occurrences of the context's tail, at no model cost;
2. the fast stream (or a naive layer exit) drafts after the most likely end of those, or from y where nothing
   matched, its first step also proposing its next most likely tokens beside its chain;
3. the full model runs once on the tree (tree.py) and verification (sampling.verify_tree) accepts a path and
   emits the full model's own next token; the rest is dropped from the cache.
Greedy output is the full model's greedy output token for token; sampled output has its distribution.

With ``policy="cost"`` the planner (policy.py) decides each step, from the costs and acceptance rates it
measures while decoding, whether the fast stream drafts, how far, and which proposals are verified: only what is
expected to beat plain decoding. ``policy="always"`` verifies every proposal (drafting as far as ``max_draft``
and, for the fast stream, its confidence threshold allow): the fixed behaviour the planner is measured against.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from typing import Iterator, Sequence

import mlx.core as mx

from ..errors import M2R2Error
from .config import GenerationConfig
from .events import TokenEvent
from .generate import start_decoding
from .policy import Acceptance, Planner, StepCosts
from .prompt_cache import PromptCache
from .protocols import Drafter, DraftRequest
from .sampling import NextToken, Sampling, next_token, verify_tree
from .tree import DraftTree, supports_trees

POLICIES = ("cost", "always")
MAX_WIDTH = 8


class Speculator:
    """Draft-and-verify decoding over ``model`` with one or two drafters (prompt lookup and/or a layer drafter),
    a Decoder. One instance serves a whole conversation: the costs and acceptance rates it has learnt carry over.
    ``name``: the mode it serves; ``context_length``: the model's. Each drafter's ``prior`` is its acceptance rate
    until the engine has measured one."""

    # False: one plain step at a time where no draft pays (the ablation of the pipelined plain stretches)
    plain_stretches = True

    def __init__(
        self,
        model,
        tokenizer,
        drafters: Sequence[Drafter],
        *,
        max_draft: int = 8,
        width: int = 1,
        policy: str = "cost",
        context_length: int | None = None,
        name: str = "speculative",
    ):
        if policy not in POLICIES:
            raise M2R2Error(f"unknown drafting policy {policy!r}; choose one of: {', '.join(POLICIES)}")
        if max_draft < 1:
            raise M2R2Error(f"the most drafted tokens per step must be at least 1 (got {max_draft})")
        if not 1 <= width <= MAX_WIDTH:
            raise M2R2Error(f"tree width must be in 1..{MAX_WIDTH} (got {width})")
        self.model, self.tokenizer = model, tokenizer
        self.lookup = next((d for d in drafters if d.kind == "lookup"), None)
        self.layer = next((d for d in drafters if d.kind != "lookup"), None)
        layers = model.model.layers if hasattr(model, "model") else model.layers
        if width > 1 and not supports_trees(layers):
            raise M2R2Error(
                f"{type(model).__module__} cannot verify draft trees (no rope on its attention); use tree width 1"
            )
        self.max_draft, self.width, self.policy = max_draft, width, policy
        self.context_length, self.name = context_length, name
        self.needs_adapters = self.layer is not None and self.layer.kind == "fast"
        self.keeps_states = bool(self.layer and self.layer.keeps_states)
        num_layers = len(layers)
        self.exit_layers = sorted({d.exit_layer for d in drafters} | {num_layers})  # for legends
        fraction = self.layer.exit_layer / num_layers if self.layer else 0.0
        self.costs = StepCosts(draft_fraction=fraction)
        self.acceptance = Acceptance({d.kind: d.prior for d in drafters})
        self.planner = Planner(self.costs, self.acceptance, max_nodes=max_draft * width)
        self.status = "plain"  # the last step's plan, for the chat's side panel
        self.draft_seconds = 0.0

    @property
    def drafter_names(self) -> str:
        return " + ".join(d.name for d in (self.lookup, self.layer) if d is not None)

    def __call__(
        self, prompt: Sequence[int], cache: PromptCache | None = None, generation: GenerationConfig | None = None
    ) -> Iterator[TokenEvent]:
        """Decode ``prompt``: each accepted draft is an event with ``drafted`` and its ``source``; the step's
        ``plan`` rides on every event."""
        generation = generation or GenerationConfig()
        s = generation.sampling
        cache, logits, events = start_decoding(
            self.model, self.tokenizer, list(prompt), cache, generation, self.context_length, self.keeps_states
        )
        y = next_token(logits, s, cache)
        ev = events.event(y)
        yield ev
        if self.policy == "cost" and not self.costs.calibrated and not ev.finish_reason:
            self._calibrate(cache, y)
        while not ev.finish_reason:
            tic = time.perf_counter()
            self.costs.context = len(cache)
            tree = self._draft(cache, y, events.max_tokens - events.n - 1, s, events.eos_ids)
            plan = self.status
            if len(tree) == 1 and self.policy == "cost":  # nothing pays: decode plainly until a draft would
                y_next = yield from self._plain_stretch(cache, y, events, s)
                if y_next is None:
                    return
            else:
                history = cache.tokens if s.reads_history else ()
                path, y_next = verify_tree(cache.forward_tree(tree), tree, s, history)
                cache.commit(path, len(tree))
                self._learn(tree, path)
                self.costs.observe_verify(len(tree), time.perf_counter() - tic - self.draft_seconds)
                for node in path[1:]:
                    source = "lookup" if "lookup" in tree.sources[node] else self.layer.kind
                    layer = 0 if source == "lookup" else self.layer.exit_layer
                    ev = events.event(tree.tokens[node], exit_layer=layer, drafted=True, source=source, plan=plan)
                    yield ev
                    if ev.finish_reason:
                        return
            y = y_next
            ev = events.event(y, plan=plan)
            yield ev

    # ---- one step --------------------------------------------------------------------------------
    def _draft(self, cache: PromptCache, y: int, limit: int, s: Sampling, eos_ids) -> DraftTree:
        """The tree to verify after ``y``; ``limit``: the most tokens a path may draft (the answer's budget)."""
        tree = DraftTree.root(y)
        self.draft_seconds = 0.0  # the fast stream's, priced apart from the step
        limit = min(limit, self.max_draft)
        if limit <= 0:
            self.status = "plain"
            return tree
        # Sampling: whether a sampled draft is verified must not depend on the token drawn (its own probability,
        # or meeting another drafter's token), or it would be tested against a law it was not drawn from; so
        # the planner prunes lookup's proposals before the fast stream samples, and the fast stream's chain
        # ends by a stopping rule (go_on), never by pruning. Greedy verification is exact for any tree.
        prune = self.policy == "cost"
        request = DraftRequest(cache, cache.tokens + [y] if self.lookup else (), limit, s, eos_ids, self.width)
        if self.lookup is not None:
            self.lookup.propose(tree, request)
            if prune and not s.greedy:
                tree = tree.keep(self.planner.select(tree)[0])
        if self.layer is not None:
            if self.policy == "always":
                self.layer.propose(tree, request)
            else:
                self._draft_fast(tree, request)
        if prune and s.greedy:
            tree = tree.keep(self.planner.select(tree)[0])
        self.status = self._describe(tree)
        return tree

    def _plain_stretch(self, cache: PromptCache, y: int, events, s: Sampling) -> Iterator[TokenEvent]:
        """Plain decoding after ``y``, each step built and queued before the previous token is read (as generate
        does, which a draft-and-verify step cannot), while drafting is not expected to pay. After each token the
        planner is asked whether drafting after it would; then the stretch ends with one step in flight and
        returns that step's token (not yet emitted nor in the cache), or None when the answer has ended.

        Leaving depends only on tokens already emitted, never on the one in flight, so sampled tokens keep their
        distribution. A plain step's time, measured here, is the pipelined one drafting has to beat."""
        # the tokens so far as ints: reading the cache's would wait for the step in flight (its last entry is lazy)
        context = cache.tokens + [y]
        sample = NextToken(s, context[:-1])  # as generate draws it

        def step(token: mx.array) -> mx.array:  # feed token (shape (1,)); the next one, queued, not read
            sample.feed(token)
            token = sample(cache.forward(token)[-1])
            mx.async_eval(token)
            return token

        start = time.perf_counter()
        pending, tic, first = step(mx.array([y])), None, True
        while True:
            limit = min(events.max_tokens - events.n - 1, self.max_draft)
            self.costs.context = len(context)
            # the first question was just answered by _draft for this root (its fast-stream drafts priced out)
            if limit > 0 and (
                not self.plain_stretches or (not first and self._would_draft(context, limit, events.eos_ids, s))
            ):
                token = int(pending.item())
                if not self.plain_stretches:  # the ablation: one plain step, timed as a whole
                    self.costs.observe_verify(1, time.perf_counter() - start)
                self.acceptance.tick()
                return token
            first = False
            after = step(pending[None]) if events.n + 1 < events.max_tokens else None
            context.append(int(pending.item()))
            toc = time.perf_counter()
            if tic is not None:
                self.costs.observe_verify(1, toc - tic)
            tic = toc
            self.acceptance.tick()
            ev = events.event(context[-1], plan="plain")
            yield ev
            tic += time.perf_counter() - toc  # the caller's time with the token is not the step's
            if ev.finish_reason:
                return None
            if events.n % 256 == 0:
                mx.clear_cache()
            pending = after

    def _would_draft(self, context: list[int], limit: int, eos_ids, s: Sampling) -> bool:
        """Whether a step after ``context[-1]`` would draft: lookup's proposals worth verifying, or the fast stream
        expected to pay (the planner's decisions in _draft, without running the fast stream)."""
        tree = DraftTree.root(context[-1])
        if self.lookup is not None:
            self.lookup.propose(tree, DraftRequest(None, context, limit, s, eos_ids, self.width))
            if len(self.planner.select(tree)[0]) > 1:
                return True
        return self.layer is not None and self.planner.fast_pays(tree, 0, self.layer.kind, limit)

    def _draft_fast(self, tree: DraftTree, request: DraftRequest) -> None:
        """The fast stream continues after the deepest proposal worth verifying, or drafts from the root where
        none is; only when the planner expects it to pay."""
        chosen = self.planner.select(tree)[0]
        reach = self.planner.reach(tree)
        leaves = [n for n in chosen if not any(tree.parents[c] == n for c in chosen)]
        anchor = max(leaves, key=lambda node: (reach[node], tree.depths[node]))  # the likeliest end
        room = request.limit - tree.depths[anchor]
        if room <= 0 or tree.tokens[anchor] in request.eos_ids:
            return
        if not self.planner.fast_pays(tree, anchor, self.layer.kind, room):
            return
        tic = time.perf_counter()
        go_on = self.planner.go_on(tree, self.layer.kind)
        width = self.width if anchor == 0 else 1
        steps = self.layer.propose(tree, replace(request, limit=room, width=width, go_on=go_on, after=anchor))
        self.draft_seconds = time.perf_counter() - tic
        self.costs.observe_draft(self.draft_seconds / max(steps, 1))

    def _learn(self, tree: DraftTree, path: list[int]) -> None:
        """Each proposal whose parent was accepted was put to the test: count it for each drafter that made it."""
        on_path = set(path)
        for node in range(1, len(tree)):
            if tree.parents[node] in on_path:
                for kind in tree.sources[node]:
                    self.acceptance.observe(kind, tree.depths[node], tree.signal.get((kind, node)), node in on_path)
        self.acceptance.tick()

    def _calibrate(self, cache: PromptCache, y: int) -> None:
        """Time forwards of 1, 2, 4 and 8 tokens on this machine (after a warm-up round: first-time shapes are
        slow), so that the first steps already weigh drafting against what it costs here; the cache is left as
        it was."""
        states = cache.states
        self.costs.context = len(cache)
        for round in range(3):
            for n in (1, 2, 4, 8):
                tic = time.perf_counter()
                mx.eval(cache.forward([y] * n))
                if round:
                    self.costs.observe_verify(n, time.perf_counter() - tic, provisional=True)
                cache.trim(n)
        cache.states = states

    def _describe(self, tree: DraftTree) -> str:
        if len(tree) == 1:
            return "plain"
        counts = Counter(kind for node in range(1, len(tree)) for kind in tree.sources[node])
        return " + ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))


def speculative_generate(
    model,
    tokenizer,
    prompt: Sequence[int],
    drafter: Drafter,
    generation: GenerationConfig | None = None,
    *,
    max_draft: int = 6,
    policy: str = "always",
    cache: PromptCache | None = None,
) -> Iterator[TokenEvent]:
    """Speculative decoding with one drafter, verifying all it proposes (``policy="always"``) or what the cost
    model picks (``"cost"``)."""
    engine = Speculator(model, tokenizer, [drafter], max_draft=max_draft, policy=policy)
    return engine(prompt, cache, generation)
