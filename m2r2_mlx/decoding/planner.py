"""Speculative planners (protocols.Planner): what each step drafts and verifies.

- ``VerifyAll``: verifies every proposal, and the model drafter drafts every step (its confidence threshold ends
  the chain). Prompt lookup alone is this planner with one drafter.
- ``CostPlanner`` (the default): verifies only what it expects to beat a plain step, from what it measures while
  decoding.

The cost planner's arithmetic. A verification over n positions costs c(n) seconds, a fast-stream draft step d
(costs.StepCosts: plain steps measured on the running machine). A drafted node is accepted with probability pi,
the product along its path of each node's acceptance rate given its parent was accepted, learnt per drafter,
depth and signal (the length of lookup's match, the fast stream's draft probability). A step verifying n nodes
yields E = 1 + sum(pi) tokens in c(n) seconds. Nodes join in order of pi, and the prefix with the most tokens per
second is verified: a copied span whose first token alone would not pay can pay as a whole. The fast stream drafts
only where the nodes it is expected to add pay for its draft steps. The root alone is plain decoding, so a step
drafts only where that is expected to beat it.

Prompt lookup's first continuation is verified as far as lookup alone verifies one (the floor) whatever its rate:
on prompts the planner was not tuned on, pricing those tokens cost 7% against lookup alone, while the rates'
choices beyond them (longer spans, more candidates, the fast stream) pay (docs/speculative.md, "Ablation").

Rates are decaying Beta posteriors (estimates.Rates): they follow the text. Lookup's proposals are priced at their
mean rates (they are free and many; optimism compounded along a chain would verify far more than pays); the fast
stream's optimistically (mean plus one standard deviation): its runs are gated by its estimate, so while that
estimate is uncertain, as it becomes when the drafter goes unused, it is tried again.
"""

from __future__ import annotations

import bisect
from dataclasses import replace

from ..estimates import Rates
from .costs import StepCosts
from .protocols import Drafter, DraftRequest, Outcome, StepPlan
from .tree import DraftTree

CONFIDENCE_EDGES = (0.1, 0.2, 0.4, 0.6, 0.8)  # fast-stream draft probability buckets
MATCH_EDGES = (2, 3, 4, 8)  # lookup match lengths: 1, 2, 3, 4-7, 8+ tokens


class VerifyAll:
    """Every proposal verified; the model drafter (if any) drafts from the root on every step, as far as the
    step's limit and its own confidence threshold allow."""

    def __init__(self, drafters: list[Drafter]):
        self.drafts = any(not d.free for d in drafters)

    def plan(self, tree: DraftTree, request: DraftRequest) -> StepPlan:
        room = request.limit - tree.depths[request.after]  # after the grammar's forced text, if any
        return StepPlan(range(len(tree)), replace(request, limit=room) if self.drafts and room > 0 else None)

    def observe(self, outcome: Outcome) -> None:
        pass


def signal_bucket(kind: str, signal: float) -> int:
    """Lookup's match length bucket, or the fast stream's draft probability bucket."""
    edges = MATCH_EDGES if kind == "lookup" else CONFIDENCE_EDGES
    return bisect.bisect_right(edges, signal)


class CostPlanner:
    """Verifies what is expected to beat a plain step (the module docstring has the arithmetic). ``max_nodes``:
    the most nodes a step verifies; ``lookup_floor``: the first tokens of lookup's first continuation are
    verified whatever the rates say, as prompt lookup alone verifies them."""

    def __init__(self, drafters: list[Drafter], max_nodes: int, costs: StepCosts, lookup_floor: int = 0):
        self.priors = {d.kind: d.prior for d in drafters}
        model = next((d for d in drafters if not d.free), None)
        self.model_kind = None if model is None else model.kind  # the model drafter's: "fast" or "layerskip"
        self.max_nodes, self.costs, self.lookup_floor = max_nodes, costs, lookup_floor
        self.rates = Rates(strength=2.0, decay=0.995)
        self.unverified: tuple[DraftTree, int] | None = None  # a stretch's proposals, and the node its tokens reached

    # ---- estimates ---------------------------------------------------------------------------------------
    @staticmethod
    def keys(kind: str, depth: int, signal: float | None) -> tuple:
        """From the finest to the coarsest: by drafter, signal bucket and depth (1-4+); by drafter and signal
        bucket (what the signal says holds at every depth: a long match is a passage being copied)."""
        if signal is None:
            return ((kind, min(depth, 4)),)
        coarse = (kind, signal_bucket(kind, signal))
        return ((*coarse, min(depth, 4)), coarse)

    def rate(self, kind: str, depth: int, signal: float | None = None) -> float:
        read = self.rates.mean if kind == "lookup" else self.rates.optimistic
        return read(self.keys(kind, depth, signal), self.priors.get(kind, 0.5))

    def reach(self, tree: DraftTree) -> list[float]:
        """pi per node (1 for the root): the probability that verification accepts it."""
        pi = [1.0]
        for node in range(1, len(tree)):
            rate = max(self.rate(k, tree.depths[node], tree.signal.get((k, node))) for k in tree.sources[node])
            pi.append(pi[tree.parents[node]] * rate)
        return pi

    def floor(self, tree: DraftTree) -> list[int]:
        """Lookup's first continuation (after the grammar's forced text), as far as prompt lookup alone verifies one
        (``lookup_floor`` tokens)."""
        node, nodes = 0, []
        while (forced := next((c for c in tree.children(node) if "grammar" in tree.sources[c]), None)) is not None:
            node = forced
        while len(nodes) < self.lookup_floor:
            node = next((c for c in tree.children(node) if "lookup" in tree.sources[c]), None)
            if node is None:
                break
            nodes.append(node)
        return nodes

    def select(self, tree: DraftTree) -> tuple[list[int], float, float]:
        """The nodes worth verifying (root first), the tokens they are expected to yield, and their seconds: the
        best prefix of the nodes in order of pi, and the floor."""
        pi = self.reach(tree)
        order = sorted(range(1, len(tree)), key=lambda i: (-pi[i], tree.depths[i]))[: self.max_nodes]
        tokens, seconds = 1.0, self.costs.verify_cost(1)
        best, best_tokens, best_seconds = 0, tokens, seconds
        for n, node in enumerate(order, start=1):
            tokens, seconds = tokens + pi[node], seconds + self.costs.extra(n)
            if tokens / seconds > best_tokens / best_seconds:
                best, best_tokens, best_seconds = n, tokens, seconds
        floor = [n for n in self.floor(tree) if n not in order[:best]]
        if not floor:
            return sorted([0, *order[:best]]), best_tokens, best_seconds
        keep = sorted([0, *order[:best], *floor])
        return keep, best_tokens + sum(pi[n] for n in floor), self.costs.verify_cost(len(keep))

    def drafting_pays(self, tree: DraftTree, anchor: int, n: int, tokens: float, seconds: float, limit: int) -> bool:
        """Whether the fast stream drafting after ``anchor`` raises the expected tokens per second of a step that
        verifies ``n`` nodes for ``tokens`` in ``seconds``, at some depth up to ``limit``."""
        pi, draft, rate = self.reach(tree)[anchor], self.costs.draft_cost(), tokens / seconds
        for depth in range(1, limit + 1):
            pi *= self.rate(self.model_kind, tree.depths[anchor] + depth)
            tokens, seconds, n = tokens + pi, seconds + draft + self.costs.extra(n), n + 1
            if tokens / seconds > rate:
                return True
        return False

    def go_on(self, tree: DraftTree, node: int) -> bool:
        """For the fast stream's chain: after it drafted ``node``, whether one more draft step is expected to pay."""
        keep, tokens, seconds = self.select(tree)
        pi = self.reach(tree)[node] * self.rate(self.model_kind, tree.depths[node] + 1)
        return pi * seconds > tokens * (self.costs.draft_cost() + self.costs.extra(len(keep)))

    # ---- the protocol ------------------------------------------------------------------------------------
    def plan(self, tree: DraftTree, request: DraftRequest) -> StepPlan:
        if self.costs.plain_due:  # the plain step is timed again before anything is priced against it
            return StepPlan([0])
        keep, tokens, seconds = self.select(tree)
        if self.model_kind is None:
            return StepPlan(keep)
        leaves = [n for n in keep if not any(tree.parents[c] == n for c in keep)]
        reach = self.reach(tree)
        anchor = max(leaves, key=lambda node: (reach[node], tree.depths[node]))  # the likeliest end
        room = request.limit - tree.depths[anchor]
        if room <= 0 or tree.tokens[anchor] in request.eos_ids:
            return StepPlan(keep)
        if not self.drafting_pays(tree, anchor, len(keep), tokens, seconds, room):
            return StepPlan(keep)
        width = request.width if anchor == 0 else 1
        return StepPlan(keep, replace(request, limit=room, width=width, go_on=self.go_on, after=keep.index(anchor)))

    def observe(self, outcome: Outcome) -> None:
        if outcome.plain:
            self.score_unverified(outcome.tree, outcome.token)
        else:
            self.unverified = None
        costs, tree = self.costs, outcome.tree
        if outcome.seconds is None:
            return
        if outcome.plain:
            costs.observe_plain(outcome.seconds)
        else:
            if len(tree) > 1:
                costs.observe_verify(len(tree), outcome.seconds - outcome.draft_seconds)
            if outcome.draft_steps:
                costs.observe_draft(outcome.draft_seconds / outcome.draft_steps)
            on_path = set(outcome.path)
            for node in range(1, len(tree)):
                if tree.parents[node] in on_path:  # put to the test
                    self.tested(tree, node, node in on_path)
        costs.tick()
        self.rates.tick()

    def tested(self, tree: DraftTree, node: int, accepted: bool) -> None:
        """Count the outcome for each drafter that proposed ``node``."""
        for kind in tree.sources[node]:
            self.rates.observe(self.keys(kind, tree.depths[node], tree.signal.get((kind, node))), accepted)

    def score_unverified(self, proposals: DraftTree, token: int) -> None:
        """A plain step verifies none of the free drafters' ``proposals`` (made after the token before ``token``),
        yet the tokens it emits score them as verification would: a copied token is accepted where it equals the
        model's token (greedy, and with the same probability when sampled). A chain is followed token by token
        while it matches, so a stretch keeps teaching the rates and ends where the text starts to repeat."""
        tree, node = self.unverified or (proposals, 0)
        for child in tree.children(node):
            self.tested(tree, child, tree.tokens[child] == token)
        hit = tree.child(node, token)
        self.unverified = (tree, hit) if hit is not None and tree.children(hit) else None
