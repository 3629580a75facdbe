"""When drafting pays: the speculative engine's step costs and acceptance rates, learnt as it decodes.

A verification forward over n positions costs c(n) seconds and a draft step of the fast stream d, both measured
on the running machine. A drafted node is accepted with probability pi = the product, along its path, of each
node's acceptance rate given its parent was accepted (per drafter, depth and signal: the fast stream's draft
probability, lookup's matched n-gram length). A step that drafts for D seconds and verifies n nodes yields
E = 1 + sum(pi) tokens in D + c(n) seconds. The planner adds nodes in order of pi while each raises E / time, and
runs the fast stream only when the nodes it is expected to add pay for its draft steps. Plain decoding is the
tree with the root alone, so drafting happens only where it is expected to beat it.

Rates are Beta posteriors over counts that decay every step: estimates follow the text (a passage being copied,
then new writing), and a drafter left unused grows uncertain until its optimistic estimate (mean + one standard
deviation) pays again, when it is tried: exploration that costs little where a drafter keeps losing.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import defaultdict, deque
from dataclasses import dataclass, field

from .tree import DraftTree

CONFIDENCE_EDGES = (0.1, 0.2, 0.4, 0.6, 0.8)  # fast-stream draft probability buckets


class StepCosts:
    """Seconds per verification step (by positions verified) and per fast-stream draft step.

    A step's time is its wall-clock time, everything a step does but the fast stream's drafting (priced apart);
    a plain step's is the pipelined one, what plain decoding itself would take. Times are kept per context-length
    bucket (below 512 positions, then each doubling): attention makes a wide verification dearer, against a
    plain step, the longer the context. Each size's time is the median of its latest measurements (a forward
    that a busy machine or a first-time shape slowed down does not move it). A size measured fewer than twice
    reads a line through the others, weighted by how often each was measured; a bucket with fewer than two
    sizes borrows the nearest bucket's, scaled by their plain steps."""

    def __init__(self, draft_fraction: float, smoothing: float = 0.2, window: int = 15, max_weight: int = 10):
        self.tables: dict[int, dict[int, deque]] = {}  # context bucket -> positions verified -> seconds
        self.context = 0  # positions in the cache now: which bucket verify_cost reads and observe_verify feeds
        self.provisional: set[tuple[int, int]] = set()  # (bucket, size) whose times are calibration's so far
        self.draft: float | None = None
        self.draft_fraction = draft_fraction  # before any draft step is timed: that share of a one-token forward
        self.smoothing, self.window, self.max_weight = smoothing, window, max_weight

    @staticmethod
    def context_bucket(context: int) -> int:
        return max(0, int(context).bit_length() - 9)  # 0: < 512 positions, 1: < 1024, 2: < 2048, ...

    @property
    def times(self) -> dict[int, deque]:
        return self.tables.setdefault(self.context_bucket(self.context), {})

    @property
    def verify(self) -> dict[int, float]:
        """The current bucket's median seconds per size."""
        return {n: statistics.median(ts) for n, ts in sorted(self.times.items())}

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def observe_verify(self, n: int, seconds: float, provisional: bool = False) -> None:
        """``provisional``: a bare forward timed before decoding (calibration), replaced by the size's first
        whole-step measurement in this bucket, since a whole step also pays for what surrounds the forward."""
        key = (self.context_bucket(self.context), n)
        times = self.times.setdefault(n, deque(maxlen=self.window))
        if provisional:
            self.provisional.add(key)
        elif key in self.provisional:
            self.provisional.discard(key)
            times.clear()
        times.append(seconds)

    def observe_draft(self, seconds_per_step: float) -> None:
        self.draft = self._ema(self.draft, seconds_per_step)

    @property
    def calibrated(self) -> bool:
        return any(len(t) >= 2 for t in self.tables.values())

    def _line(self, times: dict[int, deque], n: int) -> float | None:
        """Seconds for ``n`` positions from one bucket's measurements; None below two sizes measured."""
        if len(times.get(n, ())) >= 2:
            return statistics.median(times[n])
        if len(times) < 2:
            return None
        xs = sorted(times)
        ys = [statistics.median(times[x]) for x in xs]
        ws = [min(len(times[x]), self.max_weight) for x in xs]
        total = sum(ws)
        mx = sum(w * x for w, x in zip(ws, xs)) / total
        my = sum(w * y for w, y in zip(ws, ys)) / total
        slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / max(
            sum(w * (x - mx) ** 2 for w, x in zip(ws, xs)), 1e-12
        )
        return max(my + max(slope, 0.0) * (n - mx), 1e-6)

    def verify_cost(self, n: int) -> float:
        here = self.context_bucket(self.context)
        cost = self._line(self.times, n)
        if cost is not None:
            return cost
        others = sorted((b for b, t in self.tables.items() if b != here and len(t) >= 2), key=lambda b: abs(b - here))
        if others:
            near = self.tables[others[0]]
            scale = 1.0
            if len(self.times.get(1, ())) and len(near.get(1, ())):
                scale = statistics.median(self.times[1]) / statistics.median(near[1])
            return self._line(near, n) * scale
        ys = [statistics.median(t) for t in self.times.values()]
        base = ys[0] if ys else 1.0
        first = min(self.times) if self.times else 1
        return base * (1 + 0.05 * (n - first))  # until a second size is timed

    def extra(self, n: int) -> float:
        """Seconds that verifying one more position adds to an n-position step: never negative, though two
        sizes' medians may be out of order on a noisy machine."""
        return max(self.verify_cost(n + 1) - self.verify_cost(n), 0.0)

    def draft_cost(self) -> float:
        return self.draft if self.draft is not None else self.draft_fraction * self.verify_cost(1)


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
        for c in self.counts.values():
            c[0] *= self.decay
            c[1] *= self.decay


class Planner:
    """Chooses, each step, which proposals to verify and whether the fast stream drafts."""

    def __init__(self, costs: StepCosts, acceptance: Acceptance, max_nodes: int):
        self.costs, self.acceptance, self.max_nodes = costs, acceptance, max_nodes

    def reach(self, tree: DraftTree) -> list[float]:
        """pi per node: the probability that verification accepts it (1 for the root), on optimistic rates:
        verifying one more position costs little, and a proposal never verified would never be learnt about."""
        pi = [1.0]
        for node in range(1, len(tree)):
            rate = max(
                self.acceptance.optimistic(k, tree.depths[node], tree.signal.get((k, node))) for k in tree.sources[node]
            )
            pi.append(pi[tree.parents[node]] * rate)
        return pi

    def select(self, tree: DraftTree) -> tuple[list[int], float, float]:
        """The nodes worth verifying (root first), the tokens they are expected to yield and the verification's
        seconds: nodes join in order of pi while each raises tokens per second (a parent always before its
        children). Time already spent drafting is spent either way, so it does not count."""
        pi = self.reach(tree)
        chosen, tokens, seconds = [0], 1.0, self.costs.verify_cost(1)
        for node in sorted(range(1, len(tree)), key=lambda i: (-pi[i], tree.depths[i])):
            if len(chosen) > self.max_nodes:
                break
            extra = self.costs.extra(len(chosen))
            if tree.parents[node] in chosen and pi[node] * seconds > tokens * extra:
                chosen.append(node)
                tokens += pi[node]
                seconds += extra
        return sorted(chosen), tokens, seconds

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
