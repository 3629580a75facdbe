"""Speculative planners (protocols.Planner): what each step drafts and verifies.

``VerifyAll`` verifies every proposal (prompt lookup alone is this planner with one drafter). ``CostPlanner``, the
default, verifies what is expected to beat a plain step: a node is accepted with probability pi (the product of
acceptance rates along its path, learnt per drafter, signal and depth); verifying n nodes yields 1 + sum(pi) tokens
in c(n) seconds (costs.StepCosts); the prefix of the nodes in order of pi with the most tokens per second is kept.
The fast stream drafts only where its nodes pay for its draft steps. The arithmetic and the measurements that
justify each piece: docs/speculative.md.
"""

from __future__ import annotations

import bisect
from dataclasses import replace

from ..estimates import Rates
from .costs import StepCosts
from .protocols import Drafter, DraftRequest, Outcome, StepPlan
from .tree import DraftTree

MATCH_EDGES = (2, 3, 4, 8)  # lookup's signal, its match length: 1, 2, 3, 4-7, 8+ tokens
CONFIDENCE_EDGES = (0.1, 0.2, 0.4, 0.6, 0.8)  # a layer drafter's: its draft probability


class VerifyAll:
    """Every proposal verified; the model drafter (if any) drafts after them on every step."""

    def __init__(self, drafters: list[Drafter]):
        self.drafts = any(not d.free for d in drafters)

    def plan(self, tree: DraftTree, request: DraftRequest) -> StepPlan:
        room = request.limit - tree.depths[request.after]  # after the grammar's forced text, if any
        return StepPlan(range(len(tree)), replace(request, limit=room) if self.drafts and room > 0 else None)

    def observe(self, outcome: Outcome) -> None:
        pass


class CostPlanner:
    """Verifies what is expected to beat a plain step. ``max_nodes``: the most nodes a step verifies. The floor,
    verified whatever the rates say: the grammar's forced text, and the first ``lookup_floor`` tokens of lookup's
    first continuation (as far as prompt lookup alone verifies it)."""

    def __init__(self, drafters: list[Drafter], max_nodes: int, costs: StepCosts, lookup_floor: int = 0):
        self.priors = {d.kind: d.prior for d in drafters}
        model = next((d for d in drafters if not d.free), None)
        self.model_kind = None if model is None else model.kind  # "fast" or "layerskip"
        self.max_nodes, self.costs, self.lookup_floor = max_nodes, costs, lookup_floor
        self.rates = Rates(strength=2.0, decay=0.995)
        self.unverified: tuple[DraftTree, int] | None = None  # a plain stretch's proposals, and the node it reached

    @staticmethod
    def keys(kind: str, depth: int, signal: float | None) -> tuple:
        """Rate keys, finest first: (drafter, signal bucket, depth 1-4+), then (drafter, signal bucket)."""
        if signal is None:
            return ((kind, min(depth, 4)),)
        coarse = (kind, bisect.bisect_right(MATCH_EDGES if kind == "lookup" else CONFIDENCE_EDGES, signal))
        return ((*coarse, min(depth, 4)), coarse)

    def rate(self, kind: str, depth: int, signal: float | None = None) -> float:
        """Lookup at its mean (free and many: optimism would compound along a chain); the fast stream at mean plus
        one standard deviation, so a drafter left unused is tried again as its estimate grows uncertain."""
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
        """The nodes verified whatever the rates say: the grammar's forced chain, then up to ``lookup_floor`` nodes
        of lookup's first continuation after it."""

        def first_child(node: int, kind: str) -> int | None:
            return next((c for c in tree.children(node) if kind in tree.sources[c]), None)

        nodes = []
        while (node := first_child(nodes[-1] if nodes else 0, "grammar")) is not None:
            nodes.append(node)
        for _ in range(self.lookup_floor):
            if (node := first_child(nodes[-1] if nodes else 0, "lookup")) is None:
                break
            nodes.append(node)
        return nodes

    def select(self, tree: DraftTree) -> tuple[list[int], float, float]:
        """The nodes to verify (root first), the tokens they are expected to yield, and their seconds."""
        pi = self.reach(tree)
        order = sorted(range(1, len(tree)), key=lambda i: (-pi[i], tree.depths[i]))[: self.max_nodes]
        tokens, seconds = 1.0, self.costs.verify_cost(1)
        best, best_tokens, best_seconds = 0, tokens, seconds
        for n, node in enumerate(order, start=1):
            tokens, seconds = tokens + pi[node], seconds + self.costs.extra(n)
            if tokens / seconds > best_tokens / best_seconds:
                best, best_tokens, best_seconds = n, tokens, seconds
        floor = [n for n in self.floor(tree) if n not in order[:best]]
        keep = sorted([0, *order[:best], *floor])
        if not floor:
            return keep, best_tokens, best_seconds
        return keep, best_tokens + sum(pi[n] for n in floor), self.costs.verify_cost(len(keep))

    def drafting_pays(self, tree: DraftTree, anchor: int, n: int, tokens: float, seconds: float, limit: int) -> bool:
        """Whether the fast stream drafting after ``anchor`` (up to ``limit`` deep) raises the tokens per second of
        a step that verifies ``n`` nodes for ``tokens`` in ``seconds``."""
        pi, draft, rate = self.reach(tree)[anchor], self.costs.draft_cost(), tokens / seconds
        for depth in range(1, limit + 1):
            pi *= self.rate(self.model_kind, tree.depths[anchor] + depth)
            tokens, seconds, n = tokens + pi, seconds + draft + self.costs.extra(n), n + 1
            if tokens / seconds > rate:
                return True
        return False

    def go_on(self, tree: DraftTree, node: int) -> bool:
        """After the fast stream drafted ``node``: whether one more draft step is expected to pay."""
        keep, tokens, seconds = self.select(tree)
        return self.drafting_pays(tree, node, len(keep), tokens, seconds, limit=1)

    def plan(self, tree: DraftTree, request: DraftRequest) -> StepPlan:
        if self.costs.plain_due:  # the plain step is timed again before anything is priced against it
            return StepPlan([0])
        keep, tokens, seconds = self.select(tree)
        if self.model_kind is None:
            return StepPlan(keep)
        reach = self.reach(tree)
        leaves = [n for n in keep if not any(tree.parents[c] == n for c in keep)]
        anchor = max(leaves, key=lambda node: (reach[node], tree.depths[node]))  # the likeliest end
        room = request.limit - tree.depths[anchor]
        if room <= 0 or tree.tokens[anchor] in request.eos_ids:
            return StepPlan(keep)
        if not self.drafting_pays(tree, anchor, len(keep), tokens, seconds, room):
            return StepPlan(keep)
        width = request.width if anchor == 0 else 1
        return StepPlan(keep, replace(request, limit=room, width=width, go_on=self.go_on, after=keep.index(anchor)))

    def observe(self, outcome: Outcome) -> None:
        tree = outcome.tree
        if outcome.plain:
            self.score_unverified(tree, outcome.token)
        else:
            self.unverified = None
            on_path = set(outcome.path)
            for node in range(1, len(tree)):
                if tree.parents[node] in on_path:  # put to the test
                    self.tested(tree, node, node in on_path)
        if outcome.seconds is not None:
            self.costs.observe(outcome)
            self.rates.tick()

    def tested(self, tree: DraftTree, node: int, accepted: bool) -> None:
        for kind in tree.sources[node]:
            self.rates.observe(self.keys(kind, tree.depths[node], tree.signal.get((kind, node))), accepted)

    def score_unverified(self, proposals: DraftTree, token: int) -> None:
        """A plain step's ``token`` scores the free drafters' unverified ``proposals`` as verification would (a
        copied token is accepted where it equals the model's), following a chain while it matches: a plain
        stretch keeps teaching the rates, and ends where the text starts to repeat."""
        tree, node = self.unverified or (proposals, 0)
        for child in tree.children(node):
            self.tested(tree, child, tree.tokens[child] == token)
        hit = tree.child(node, token)
        self.unverified = (tree, hit) if hit is not None and tree.children(hit) else None
