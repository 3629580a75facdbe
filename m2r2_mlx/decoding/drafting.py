"""The tree a speculative step verifies: what each drafter proposes, and what the planner keeps.

Under the ``cost`` policy the planner (policy.py) keeps only the proposals expected to beat a plain step, and the
fast stream drafts only where it is expected to pay. When it keeps nothing, a probe may still verify a drafter
left untried for a while, from the exploration budget (policy.Exploration): its acceptance is measured again, so
no estimate keeps a drafter off for long while the text would make it pay. Under ``always`` every proposal is
verified (as far as ``max_draft`` and, for the fast stream, its confidence threshold allow).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from ..errors import M2R2Error
from .policy import Exploration, Planner
from .protocols import Drafter, DraftRequest
from .sampling import Sampling
from .tree import DraftTree

POLICIES = ("cost", "always")
MAX_WIDTH = 8
PROBE_DEPTH = 4  # proposals a lookup probe verifies; a fast-stream probe drafts half as many


@dataclass(frozen=True)
class SpecSettings:
    policy: str = "cost"  # "cost": the planner decides; "always": every proposal is verified
    max_draft: int = 8  # most tokens drafted per step
    width: int = 1  # candidates at the first draft position
    plain_stretches: bool = True  # False: one synchronous plain step at a time where no draft pays (an ablation)
    explore: float = 0.01  # the share of decoding time probes may spend (0: none)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise M2R2Error(f"unknown drafting policy {self.policy!r}; choose one of: {', '.join(POLICIES)}")
        if self.max_draft < 1:
            raise M2R2Error(f"the most drafted tokens per step must be at least 1 (got {self.max_draft})")
        if not 1 <= self.width <= MAX_WIDTH:
            raise M2R2Error(f"tree width must be in 1..{MAX_WIDTH} (got {self.width})")
        if not 0 <= self.explore < 1:
            raise M2R2Error(f"the exploration share must be in [0, 1) (got {self.explore})")


class TreeBuilder:
    """Builds each step's draft tree from prompt lookup and/or a layer drafter under the settings' policy."""

    def __init__(self, drafters: list[Drafter], settings: SpecSettings, planner: Planner, explore: Exploration):
        self.lookup = next((d for d in drafters if d.kind == "lookup"), None)
        self.layer = next((d for d in drafters if d.kind != "lookup"), None)
        self.settings, self.planner, self.explore = settings, planner, explore
        self.kinds = [d.kind for d in (self.lookup, self.layer) if d is not None]
        self.status = "plain"  # the last step's plan, for the chat's side panel
        self.draft_seconds = 0.0  # the fast stream's drafting in the last step (timed by the caller's clock)
        self.probe = False  # the last tree is a probe

    def build(self, request: DraftRequest, y: int, clock) -> DraftTree:
        """The tree to verify after ``y``; ``request.limit`` is the most tokens a path may draft (the answer's
        budget). ``clock()`` gives seconds (the fast stream's drafting is priced apart from the step)."""
        tree = DraftTree.root(y)
        self.draft_seconds, self.probe = 0.0, False
        limit = min(request.limit, self.settings.max_draft)
        if limit <= 0:
            self.status = "plain"
            return tree
        if self.settings.policy == "cost" and self.planner.costs.plain_due:
            self.status = "plain"  # a plain stretch measures the plain step every ratio is taken against
            return tree
        request = replace(request, limit=limit, width=self.settings.width)
        # Sampling: whether a sampled draft is verified must not depend on the token drawn (its own probability,
        # or meeting another drafter's token), or it would be tested against a law it was not drawn from; so
        # the planner prunes lookup's proposals before the fast stream samples, and the fast stream's chain
        # ends by a stopping rule (go_on), never by pruning. Greedy verification is exact for any tree.
        prune = self.settings.policy == "cost"
        proposed = tree  # lookup's proposals, for a probe
        if self.lookup is not None:
            self.lookup.propose(tree, request)
            proposed = tree.keep(range(len(tree)))  # a copy: the fast stream may add to ``tree``
            if prune and not request.sampling.greedy:
                tree = tree.keep(self.planner.select(tree)[0])
        if self.layer is not None:
            if not prune:
                self.layer.propose(tree, request)
            else:
                self._draft_fast(tree, request, clock)
        if prune and request.sampling.greedy:
            tree = tree.keep(self.planner.select(tree)[0])
        if prune and len(tree) == 1:
            tree = self._probe(proposed, request, clock) or tree
        self.status = ("probe " if self.probe else "") + describe(tree)
        return tree

    def would_draft(self, context: list[int], limit: int, eos_ids, s: Sampling) -> bool:
        """Whether a step after ``context[-1]`` would draft or probe: lookup's proposals worth verifying, the fast
        stream expected to pay, or a probe due and affordable (``build``'s decisions, without running the fast
        stream)."""
        if self.planner.costs.plain_due:  # stay until the plain step has been timed again
            return False
        tree = DraftTree.root(context[-1])
        if self.lookup is not None:
            self.lookup.propose(tree, DraftRequest(None, context, limit, s, eos_ids, self.settings.width))
            if len(self.planner.select(tree)[0]) > 1:
                return True
        if self.layer is not None and self.planner.fast_pays(tree, 0, self.layer.kind, limit):
            return True
        return self._probe_cost(tree, limit) is not None

    # ---- the fast stream ---------------------------------------------------------------------------------
    def _draft_fast(self, tree: DraftTree, request: DraftRequest, clock) -> None:
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
        go_on = self.planner.go_on(tree, self.layer.kind)
        width = request.width if anchor == 0 else 1
        self._run_fast(tree, replace(request, limit=room, width=width, go_on=go_on, after=anchor), clock)

    def _run_fast(self, tree: DraftTree, request: DraftRequest, clock) -> None:
        tic = clock()
        steps = self.layer.propose(tree, request)
        self.draft_seconds = clock() - tic
        self.planner.costs.observe_draft(self.draft_seconds / max(steps, 1))

    # ---- probes ------------------------------------------------------------------------------------------
    def _probe_cost(self, proposed: DraftTree, limit: int) -> tuple[str, float] | None:
        """(the drafter to probe, the probe's expected cost beyond a plain step) when one is due and the budget
        affords it; else None. A lookup probe needs a proposal to test."""
        kind = self.explore.stalest(self.kinds)
        costs = self.planner.costs
        if kind is None or limit <= 0:
            return None
        if kind == "lookup":
            depth = min(max(proposed.depths, default=0), PROBE_DEPTH, limit)
            if depth == 0:
                return None
            cost = costs.verify_cost(1 + depth) - costs.verify_cost(1)
        else:
            depth = min(PROBE_DEPTH // 2, limit)
            cost = depth * costs.draft_cost() + costs.verify_cost(1 + depth) - costs.verify_cost(1)
        return (kind, cost) if self.explore.affords(cost) else None

    def _probe(self, proposed: DraftTree, request: DraftRequest, clock) -> DraftTree | None:
        """A probe tree, or None: lookup's likeliest chain (up to PROBE_DEPTH proposals), or a short fast-stream
        chain from the root."""
        due = self._probe_cost(proposed, request.limit)
        if due is None:
            return None
        kind, _ = due
        if kind == "lookup":
            reach = self.planner.reach(proposed)
            node, keep = 0, [0]
            while len(keep) <= PROBE_DEPTH and (children := proposed.children(node)):
                node = max(children, key=lambda c: reach[c])
                keep.append(node)
            tree = proposed.keep(keep)
        else:
            tree = DraftTree.root(proposed.tokens[0])
            depth = min(PROBE_DEPTH // 2, request.limit)
            self._run_fast(tree, replace(request, limit=depth, width=1, go_on=lambda node, p: True), clock)
        self.probe = len(tree) > 1
        return tree if self.probe else None


def describe(tree: DraftTree) -> str:
    """ "plain", or the proposals by drafter: "lookup 4 + fast 1"."""
    if len(tree) == 1:
        return "plain"
    counts = Counter(kind for node in range(1, len(tree)) for kind in tree.sources[node])
    return " + ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))
