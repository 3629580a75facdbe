"""When drafting pays: the speculative engine's acceptance rates, its planner, and its bounded exploration.

A verification forward over n positions costs c(n) seconds and a draft step of the fast stream d (costs.py:
StepCosts, in plain steps measured on the running machine). A drafted node is accepted with probability pi = the
product, along its path, of each node's acceptance rate given its parent was accepted (per drafter, depth and
signal: the fast stream's draft probability, lookup's matched n-gram length). A step that drafts for D seconds
and verifies n nodes yields E = 1 + sum(pi) tokens in D + c(n) seconds. The planner adds nodes in order of pi
while each raises E / time, and runs the fast stream only when the nodes it is expected to add pay for its draft
steps. Plain decoding is the tree with the root alone, so drafting happens only where it is expected to beat it.

Rates are Beta posteriors over counts that decay every step: estimates follow the text (a passage being copied,
then new writing), and a drafter left unused grows uncertain until its optimistic estimate (mean + one standard
deviation) pays again, when it is tried. Between those, ``Exploration`` verifies a proposal the planner turned
down now and then, from a budget of a small share of decoding time: no estimate can keep a drafter off for long
while the text would make it pay, and what that costs is bounded.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass, field

from .costs import StepCosts
from .tree import DraftTree

CONFIDENCE_EDGES = (0.1, 0.2, 0.4, 0.6, 0.8)  # fast-stream draft probability buckets


def bucket(kind: str, signal: float | None) -> int:
    """The signal's bucket: -1 when unknown (before drafting), else the fast stream's confidence bucket or
    lookup's n-gram length (1, 2, 3+)."""
    if signal is None:
        return -1
    if kind == "lookup":
        return min(int(signal), 3)
    return bisect.bisect_right(CONFIDENCE_EDGES, signal)


@dataclass
class Acceptance:
    """Acceptance rate of each drafter's proposals by depth (1, 2, 3, 4+) and signal bucket."""

    priors: dict[str, float]
    strength: float = 2.0  # prior pseudo-observations
    decay: float = 0.995  # per step: a count is worth half after ~140 steps
    counts: dict = field(default_factory=lambda: defaultdict(lambda: [0.0, 0.0]))  # key -> [accepted, proposed]

    @staticmethod
    def key(kind: str, depth: int, b: int) -> tuple:
        return kind, min(depth, 4), b

    def _posterior(self, kind: str, depth: int, signal: float | None) -> tuple[float, float]:
        a, n = self.counts[self.key(kind, depth, bucket(kind, signal))]
        if signal is not None and n < 1:  # a bucket barely seen: the depth's overall rate is the better guess
            a, n = self.counts[self.key(kind, depth, -1)]
        prior = self.priors.get(kind, 0.5)
        alpha, beta = a + self.strength * prior, (n - a) + self.strength * (1 - prior)
        mean = alpha / (alpha + beta)
        return mean, math.sqrt(mean * (1 - mean) / (alpha + beta + 1))

    def rate(self, kind: str, depth: int, signal: float | None = None) -> float:
        return self._posterior(kind, depth, signal)[0]

    def optimistic(self, kind: str, depth: int, signal: float | None = None) -> float:
        """Mean + one standard deviation: what a proposal is worth trying at while its rate is uncertain."""
        mean, std = self._posterior(kind, depth, signal)
        return min(mean + std, 1.0)

    def observe(self, kind: str, depth: int, signal: float | None, accepted: bool) -> None:
        for b in {bucket(kind, signal), -1}:
            c = self.counts[self.key(kind, depth, b)]
            c[0] += accepted
            c[1] += 1

    def tick(self) -> None:
        self._scale(self.decay)

    def new_text(self, keep: float = 0.25) -> None:
        """A new answer is new text: what earlier answers taught counts for ``keep`` of its weight, a prior
        rather than a verdict, so a drafter that failed on one answer is tried early on the next."""
        self._scale(keep)

    def _scale(self, factor: float) -> None:
        for c in self.counts.values():
            c[0] *= factor
            c[1] *= factor


@dataclass
class ShadowChain:
    """Prompt lookup's chain checked against the tokens plain decoding emits while the planner verifies nothing:
    what verifying it would have accepted, for free. Greedy verification accepts a proposal exactly when it is the
    token plain decoding emits next; sampled verification accepts a proposal that came with no distribution with
    the probability plain decoding emits it. So lookup's rates follow the text through a plain stretch as they do
    while it verifies, and a span being copied is seen at its first token, not when a probe comes by. One chain
    at a time, as one verification would test it."""

    tokens: list[int] = field(default_factory=list)
    signal: float | None = None
    depth: int = 0

    def open(self, tokens: list[int], signal: float | None) -> None:
        self.tokens, self.signal, self.depth = list(tokens), signal, 0

    @property
    def active(self) -> bool:
        return bool(self.tokens)

    def resolve(self, token: int) -> tuple[int, float | None, bool]:
        """The next token emitted: (the depth it tested, the chain's signal, whether it was the proposal). The
        chain closes at its first miss or its end."""
        self.depth += 1
        hit = self.tokens[self.depth - 1] == token
        if not hit or self.depth == len(self.tokens):
            self.tokens = []
        return self.depth, self.signal, hit


class Planner:
    """Chooses, each step, which proposals to verify and whether the fast stream drafts."""

    def __init__(self, costs: StepCosts, acceptance: Acceptance, max_nodes: int):
        self.costs, self.acceptance, self.max_nodes = costs, acceptance, max_nodes

    def reach(self, tree: DraftTree) -> list[float]:
        """pi per node: the probability that verification accepts it (1 for the root). Prompt lookup's proposals
        are priced at their mean rates: they are free and many (trees of 3 x 8), and optimism compounded along a
        chain would verify trees far wider than they pay (probes re-measure lookup when it is left out). The
        fast stream's drafts are priced optimistically, as they were drafted: a drafter whose runs are gated by
        its estimate must be tried while that estimate is uncertain."""
        pi = [1.0]
        acceptance = self.acceptance
        for node in range(1, len(tree)):
            rate = max(
                (acceptance.rate if k == "lookup" else acceptance.optimistic)(
                    k, tree.depths[node], tree.signal.get((k, node))
                )
                for k in tree.sources[node]
            )
            pi.append(pi[tree.parents[node]] * rate)
        return pi

    def select(self, tree: DraftTree) -> tuple[list[int], float, float]:
        """The nodes worth verifying (root first), the tokens they are expected to yield and the verification's
        seconds. Nodes are taken in order of pi (a parent always before its children, its pi being at least
        theirs), and the prefix of that order with the most tokens per second is kept: a chain whose first
        proposal alone would not pay for the step can pay as a whole, since its deeper proposals, once the first
        is accepted, are likely (lookup copying a span). Time already spent drafting is spent either way, so it
        does not count."""
        pi = self.reach(tree)
        order = sorted(range(1, len(tree)), key=lambda i: (-pi[i], tree.depths[i]))[: self.max_nodes]
        tokens, seconds = 1.0, self.costs.verify_cost(1)
        best, best_rate = 1, tokens / seconds
        for n, node in enumerate(order, start=1):
            seconds += self.costs.extra(n)
            tokens += pi[node]
            if tokens / seconds > best_rate:
                best, best_rate, best_tokens, best_seconds = n + 1, tokens / seconds, tokens, seconds
        if best == 1:
            return [0], 1.0, self.costs.verify_cost(1)
        return sorted([0, *order[: best - 1]]), best_tokens, best_seconds

    def fast_pays(self, tree: DraftTree, anchor: int, kind: str, limit: int) -> bool:
        """Whether running the fast stream after node ``anchor`` (its chain drafted one step at a time) is expected
        to raise tokens per second, on optimistic rates (so that an unused drafter is tried again in time)."""
        chosen, tokens, seconds = self.select(tree)
        reach = self.reach(tree)[anchor]
        d = self.costs.draft_cost()
        best_gain, pi, n = 0.0, reach, len(chosen)
        gain_tokens, gain_seconds = 0.0, 0.0
        for depth in range(1, limit + 1):
            pi *= self.acceptance.optimistic(kind, tree.depths[anchor] + depth)
            gain_tokens += pi
            gain_seconds += d + self.costs.extra(n)
            n += 1
            best_gain = max(best_gain, (tokens + gain_tokens) / (seconds + gain_seconds) - tokens / seconds)
        return best_gain > 0

    def go_on(self, tree: DraftTree, kind: str):
        """For LayerDrafter.propose: after a draft step proposed ``node``, whether another is expected to pay (on
        the rate the draft's probability gives its node, and the next depth's overall rate)."""

        def decide(node: int, confidence: float) -> bool:
            chosen, tokens, seconds = self.select(tree)
            pi = self.reach(tree)[node] * self.acceptance.optimistic(kind, tree.depths[node] + 1)
            extra = self.costs.draft_cost() + self.costs.extra(len(chosen))
            return pi * seconds > tokens * extra

        return decide


@dataclass
class Exploration:
    """A budget for probes: verifications the planner would not choose, made to re-measure a drafter's acceptance
    (and the costs of sizes not verified lately). Every step earns ``share`` of its seconds; a probe spends what it
    cost beyond a plain step. The budget holds at most ``cap`` plain steps, so a long run does not bank probes."""

    share: float = 0.01
    cap: float = 4.0  # plain steps
    credit: float = 0.0  # seconds
    since: dict[str, int] = field(default_factory=dict)  # drafter kind -> steps since it was last verified

    def earn(self, seconds: float, plain: float) -> None:
        self.credit = min(self.credit + self.share * seconds, self.cap * plain)

    def affords(self, seconds: float) -> bool:
        return self.share > 0 and self.credit >= seconds

    def spend(self, seconds: float) -> None:
        self.credit -= max(seconds, 0.0)

    def tried(self, kind: str) -> None:
        self.since[kind] = 0

    def tick(self, kinds) -> None:
        for kind in kinds:
            self.since[kind] = self.since.get(kind, 0) + 1

    def stalest(self, kinds) -> str | None:
        """The drafter left untried longest (at least a few steps), the one a probe should test."""
        waiting = [k for k in kinds if self.since.get(k, 0) >= 4]
        return max(waiting, key=lambda k: self.since.get(k, 0), default=None)
