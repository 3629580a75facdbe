"""Lossless speculative decoding: drafters propose a tree of tokens, one full forward verifies it.

One step, with y the last emitted token (not yet in the cache):
1. prompt lookup proposes the continuations of earlier occurrences of the context's tail, at no model cost;
2. the fast stream (or a naive layer exit) drafts after the most likely end of those, or from y where nothing
   matched, its first step also proposing its next most likely tokens beside its chain;
3. the full model runs once on the tree (tree.py) and verification (sampling.verify_tree) accepts a path and
   emits the full model's own next token; the rest is dropped from the cache.
Greedy output is the full model's greedy output token for token; sampled output has its distribution.

With ``policy="cost"`` the planner (policy.py) decides each step, from the costs (costs.py: in plain steps,
calibrated once per machine and refined while decoding) and acceptance rates it measures, whether the fast
stream drafts, how far, and which proposals are verified: only what is expected to beat plain decoding (the tree
itself: drafting.py). Where nothing pays it decodes plainly, pipelined as plain decoding is, until a draft
would. ``policy="always"`` verifies every proposal: the fixed behaviour the planner is measured against.
"""

from __future__ import annotations

import time
from typing import Iterator, Sequence

import mlx.core as mx

from ..errors import M2R2Error
from .calibration import Calibration
from .config import GenerationConfig
from .costs import StepCosts, measure_profile
from .drafting import MAX_WIDTH, POLICIES, SpecSettings, TreeBuilder
from .events import TokenEvent
from .generate import start_decoding
from .policy import Acceptance, Exploration, Planner, ShadowChain
from .prompt_cache import PromptCache
from .protocols import Drafter, DraftRequest
from .sampling import NextToken, Sampling, next_token, verify_tree
from .tree import DraftTree, supports_trees

__all__ = ["MAX_WIDTH", "POLICIES", "SpecSettings", "Speculator", "speculative_generate"]


class Speculator:
    """Draft-and-verify decoding over ``model`` with one or two drafters (prompt lookup and/or a layer drafter),
    a Decoder. One instance serves a whole conversation (or a server's requests): the costs and acceptance rates it
    has learnt carry over. ``name``: the mode it serves; ``context_length``: the model's; ``calibration``: this
    machine's step costs for the model (calibration.py; None: measured in the first answer, kept in memory).
    Each drafter's ``prior`` is its acceptance rate until the engine has measured one."""

    def __init__(
        self,
        model,
        tokenizer,
        drafters: Sequence[Drafter],
        settings: SpecSettings | None = None,
        *,
        name: str = "speculative",
        context_length: int | None = None,
        calibration: Calibration | None = None,
    ):
        self.settings = settings = settings or SpecSettings()
        self.model, self.tokenizer = model, tokenizer
        self.name, self.context_length, self.calibration = name, context_length, calibration
        layers = model.model.layers if hasattr(model, "model") else model.layers
        if settings.width > 1 and not supports_trees(layers):
            raise M2R2Error(
                f"{type(model).__module__} cannot verify draft trees (no rope on its attention); use tree width 1"
            )
        num_layers = len(layers)
        self.exit_layers = sorted({d.exit_layer for d in drafters} | {num_layers})  # for legends
        layer = next((d for d in drafters if d.kind != "lookup"), None)
        self.needs_adapters = layer is not None and layer.kind == "fast"
        self.note = ""  # one line an app shows when the decoder is built (what it runs without)
        self.keeps_states = bool(layer and layer.keeps_states)
        fraction = layer.exit_layer / num_layers if layer else 0.0
        self.costs = StepCosts(calibration.profile if calibration else None, draft_fraction=fraction)
        self.acceptance = Acceptance({d.kind: d.prior for d in drafters})
        self.explore = Exploration(share=settings.explore)
        self.planner = Planner(self.costs, self.acceptance, max_nodes=settings.max_draft * settings.width)
        self.builder = TreeBuilder(list(drafters), settings, self.planner, self.explore)

    @property
    def drafter_names(self) -> str:
        return " + ".join(d.name for d in (self.builder.lookup, self.builder.layer) if d is not None)

    @property
    def status(self) -> str:
        """The last step's plan: "plain", or what was drafted."""
        return self.builder.status

    def __call__(
        self, prompt: Sequence[int], cache: PromptCache | None = None, generation: GenerationConfig | None = None
    ) -> Iterator[TokenEvent]:
        """Decode ``prompt``: each accepted draft is an event with ``drafted`` and its ``source``; the step's
        ``plan`` rides on every event."""
        generation = generation or GenerationConfig()
        s, cost = generation.sampling, self.settings.policy == "cost"
        cache, logits, events = start_decoding(
            self.model, self.tokenizer, list(prompt), cache, generation, self.context_length, self.keeps_states
        )
        self.acceptance.new_text()
        y = next_token(logits, s, cache)
        ev = events.event(y)
        yield ev
        if cost and not self.costs.calibrated and not ev.finish_reason:
            self._calibrate(cache, y)
        try:
            while not ev.finish_reason:
                tic = time.perf_counter()
                self.costs.context = len(cache)
                limit = events.max_tokens - events.n - 1
                context = cache.tokens + [y] if self.builder.lookup else ()
                request = DraftRequest(cache, context, limit, s, events.eos_ids)
                tree = self.builder.build(request, y, time.perf_counter)
                plan = self.status
                if len(tree) == 1 and cost:  # nothing pays: decode plainly until a draft would
                    y_next = yield from self._plain_stretch(cache, y, events, s)
                    if y_next is None:
                        return
                else:
                    history = cache.tokens if s.reads_history else ()
                    path, y_next = verify_tree(cache.forward_tree(tree), tree, s, history)
                    cache.commit(path, len(tree))
                    self._learn(tree, path)
                    self._account(len(tree), time.perf_counter() - tic)
                    for node in path[1:]:
                        source = "lookup" if "lookup" in tree.sources[node] else self.builder.layer.kind
                        layer = 0 if source == "lookup" else self.builder.layer.exit_layer
                        ev = events.event(tree.tokens[node], exit_layer=layer, drafted=True, source=source, plan=plan)
                        yield ev
                        if ev.finish_reason:
                            return
                y = y_next
                ev = events.event(y, plan=plan)
                yield ev
        finally:
            if self.calibration is not None and cost:  # also after a cancelled answer: what it measured holds
                self.calibration.refine(self.costs.profile())

    # ---- bookkeeping -------------------------------------------------------------------------------------
    def _account(self, n: int, seconds: float) -> None:
        """After a verification step of ``n`` nodes that took ``seconds`` in all (drafting included)."""
        verify = seconds - self.builder.draft_seconds  # the fast stream's drafting is priced apart
        plain = self.costs.plain_seconds()
        self.costs.observe_verify(n, verify)
        if self.builder.probe:
            self.explore.spend(seconds - plain)
        self._tick(seconds, plain)

    def _tick(self, seconds: float, plain: float) -> None:
        self.explore.earn(seconds, plain)
        self.explore.tick(self.builder.kinds)
        self.costs.tick()
        self.acceptance.tick()

    def _learn(self, tree: DraftTree, path: list[int]) -> None:
        """Each proposal whose parent was accepted was put to the test: count it for each drafter that made it."""
        on_path = set(path)
        for node in range(1, len(tree)):
            if tree.parents[node] in on_path:
                for kind in tree.sources[node]:
                    self.acceptance.observe(kind, tree.depths[node], tree.signal.get((kind, node)), node in on_path)
                    self.explore.tried(kind)

    def _calibrate(self, cache: PromptCache, y: int) -> None:
        """Without a machine profile: time forwards of each size now, on this answer's cache (left as it was),
        so that the first steps already weigh drafting against what it costs here."""
        self.costs.calibrate(measure_profile(cache, y))

    def _shadow(self, shadow: ShadowChain, context: list[int], limit: int) -> None:
        """In a plain stretch, after ``context[-1]`` was emitted: resolve lookup's open chain against it, then open
        the next one from ``context`` (policy.ShadowChain)."""
        lookup = self.builder.lookup
        if lookup is None:
            return
        if shadow.active:
            depth, signal, hit = shadow.resolve(context[-1])
            self.acceptance.observe(lookup.kind, depth, signal, hit)
            self.explore.tried(lookup.kind)
        if not shadow.active and limit > 0:
            found = lookup.continuations(context, min(limit, self.settings.max_draft))
            if found:
                shadow.open(*found[0])

    # ---- plain stretches ---------------------------------------------------------------------------------
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

        stretches = self.settings.plain_stretches
        shadow = ShadowChain()
        self._shadow(shadow, context, events.max_tokens - events.n - 1)
        start = time.perf_counter()
        pending, tic, first = step(mx.array([y])), None, True
        while True:
            limit = min(events.max_tokens - events.n - 1, self.settings.max_draft)
            self.costs.context = len(context)
            # the first question was just answered by build() for this root (its fast-stream drafts priced out)
            if limit > 0 and (
                not stretches or (not first and self.builder.would_draft(context, limit, events.eos_ids, s))
            ):
                token = int(pending.item())
                if not stretches:  # the ablation: one plain step, timed as a whole
                    seconds = time.perf_counter() - start
                    self.costs.observe_plain(seconds)
                    self._tick(seconds, self.costs.plain_seconds())
                return token
            first = False
            after = step(pending[None]) if events.n + 1 < events.max_tokens else None
            context.append(int(pending.item()))
            self._shadow(shadow, context, limit)
            toc = time.perf_counter()
            if tic is not None:
                self.costs.observe_plain(toc - tic)
                self._tick(toc - tic, self.costs.plain_seconds())
            tic = toc
            ev = events.event(context[-1], plan="plain")
            yield ev
            tic += time.perf_counter() - toc  # the caller's time with the token is not the step's
            if ev.finish_reason:
                return None
            if events.n % 256 == 0:
                mx.clear_cache()
            pending = after


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
    engine = Speculator(model, tokenizer, [drafter], SpecSettings(policy, max_draft))
    return engine(prompt, cache, generation)
