"""Speculative planners (protocols.Planner): what each step drafts and verifies.

``VerifyAll`` verifies every proposal (prompt lookup alone is this planner with one drafter). ``CostPlanner``, the
default, verifies what is expected to beat a plain step: the draft at position i is accepted with probability pi
(the product of acceptance rates up to it, learnt per drafter and position); verifying n positions yields
1 + sum(pi) tokens in c(n) seconds (costs.StepCosts), and the prefix with the most tokens per second is kept. The
fast stream drafts only where its drafts are expected to pay for its draft steps, and while what they returned
in this conversation says they do (probing now and then while it does not). The arithmetic and the measurements
that justify each piece: docs/speculative.md.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from ..estimates import Rates
from .costs import StepCosts
from .draft import Draft, LookupMatch
from .protocols import Drafter, DraftRequest, Outcome, StepPlan


class VerifyAll:
    """Every proposal verified; the model drafter (if any) drafts after them on every step."""

    def __init__(self, drafters: list[Drafter]):
        self.drafts = any(not d.free for d in drafters)

    def plan(self, draft: Draft, request: DraftRequest) -> StepPlan:
        return StepPlan(len(draft), request if self.drafts and request.room(draft) > 0 else None)

    def observe(self, outcome: Outcome) -> None:
        pass


class Selection(NamedTuple):
    """A prefix chosen for verification: its positions (the root included), the tokens they are expected to yield
    and their seconds; ``reach``: each position's probability of acceptance, over the whole draft."""

    n: int
    tokens: float
    seconds: float
    reach: list[float]


class CostPlanner:
    """Verifies what is expected to beat a plain step. The floor, verified whatever the rates say: the grammar's
    forced text, and then the first ``lookup_floor`` tokens of lookup's copy (as far as prompt lookup alone verifies
    it) while verifying them pays in this conversation (``floor_gain``: what they gained, in plain steps, over the
    latest copies, verified or scored in plain stretches)."""

    GAIN_WEIGHT = 0.1  # an observation's weight in floor_gain and fast_gain: they follow the latest ten or so
    PROBE_EVERY = 16  # while the model drafter does not pay, every 16th step it would draft still drafts

    def __init__(self, drafters: list[Drafter], costs: StepCosts, lookup_floor: int = 0):
        self.priors = {d.kind: d.prior for d in drafters}
        model = next((d for d in drafters if not d.free), None)
        self.model_kind = None if model is None else model.kind  # "fast" or "layerskip"
        self.costs, self.lookup_floor = costs, lookup_floor
        self.rates = Rates(strength=2.0, decay=0.995)
        self.unverified: tuple[Draft, int, bool] | None = None  # a plain stretch's proposals, the position it
        # reached, and whether the floor was scored on them
        self.floor_gain = 1.0  # the floor starts on: lookup's copies pay until they are seen not to
        self.fast_gain = 1.0  # the same for the model drafter's drafts, per drafting step
        self.fast_waited = 0  # steps it sat out since it last drafted

    @staticmethod
    def keys(kind: str, position: int, match: LookupMatch | None = None) -> tuple:
        """Finest first (Rates): lookup's copies by how they were found (the n-gram matched, whether the copy
        continues), then by position alone; positions 1, 2, 3, 4+."""
        coarse = (kind, min(position, 4))
        if kind == "lookup" and match is not None:
            return ((*coarse, match.ngram, match.continuing), coarse)
        return (coarse,)

    def rate(self, kind: str, position: int, match: LookupMatch | None = None) -> float:
        """The estimated acceptance rate; counts decay, so a drafter left unused drifts back to its prior and is
        tried again."""
        return self.rates.mean(self.keys(kind, position, match), self.priors.get(kind, 0.5))

    def reach(self, draft: Draft) -> list[float]:
        """pi per position (1 for the root): the probability that verification accepts it."""
        pi = [1.0]
        for i in range(1, len(draft)):
            pi.append(pi[-1] * self.rate(draft.sources[i], i, draft.lookup))
        return pi

    def floor(self, draft: Draft, copies: bool | None = None) -> int:
        """The positions verified whatever the rates say: the grammar's forced text, then (``copies``; default:
        while they pay) up to ``lookup_floor`` of lookup's copy after it (the root counts)."""
        n = 1
        while n < len(draft) and draft.sources[n] == "grammar":
            n += 1
        copied, copies = n, self.floor_gain > 0 if copies is None else copies
        while copies and n < len(draft) and draft.sources[n] == "lookup" and n - copied < self.lookup_floor:
            n += 1
        return n

    def observe_floor(self, draft: Draft, accepted: int) -> None:
        """What verifying the floor's copy of ``draft`` gained (``accepted``: drafts accepted, or that would have
        been), in plain steps: its accepted copies less the positions' cost beyond a plain step."""
        grammar = self.floor(draft, copies=False) - 1
        k = self.floor(draft, copies=True) - 1 - grammar  # the copy's positions in the floor
        if k <= 0:
            return
        gain = min(max(accepted - grammar, 0), k) - (self.costs.ratio(grammar + k + 1) - self.costs.ratio(grammar + 1))
        self.floor_gain += self.GAIN_WEIGHT * (gain - self.floor_gain)

    def select(self, draft: Draft) -> Selection:
        """The prefix with the most tokens per second, or the floor where that is longer."""
        pi = self.reach(draft)
        tokens, seconds = 1.0, self.costs.verify_cost(1)
        best = Selection(1, tokens, seconds, pi)
        for n in range(1, len(draft)):
            tokens, seconds = tokens + pi[n], seconds + self.costs.extra(n)
            if tokens / seconds > best.tokens / best.seconds:
                best = Selection(n + 1, tokens, seconds, pi)
        return self.at_least_floor(draft, best)

    def at_least_floor(self, draft: Draft, chosen: Selection) -> Selection:
        """``chosen``, or the floor where that is longer."""
        floor = self.floor(draft)
        if floor <= chosen.n:
            return chosen
        return Selection(floor, sum(chosen.reach[:floor]), self.costs.verify_cost(floor), chosen.reach)

    def draft_steps(self, chosen: Selection, limit: int) -> int:
        """How many fast-stream drafts after the ``chosen`` prefix (up to ``limit``) give its verification the most
        tokens per second, the draft steps included; 0 where none beats verifying the prefix alone."""
        n, tokens, seconds = chosen.n, chosen.tokens, chosen.seconds
        pi, step, best, steps = chosen.reach[n - 1], self.costs.draft_cost(), tokens / seconds, 0
        for k in range(1, limit + 1):
            pi *= self.rate(self.model_kind, n + k - 1)
            tokens, seconds = tokens + pi, seconds + step + self.costs.extra(n + k - 1)
            if tokens / seconds > best:
                best, steps = tokens / seconds, k
        return steps

    def plan(self, draft: Draft, request: DraftRequest) -> StepPlan:
        chosen = self.select(draft)
        draft = draft.keep(chosen.n)
        room = request.room(draft)
        if room <= 0 or self.model_kind is None or draft.tokens[-1] in request.eos_ids:
            return StepPlan(chosen.n)
        steps = self.draft_steps(chosen, room)
        if not steps or not self.drafting_pays():
            return StepPlan(chosen.n)
        return StepPlan(chosen.n, replace(request, limit=chosen.n - 1 + steps, planned=True))

    def observe(self, outcome: Outcome) -> None:
        draft = outcome.draft
        if outcome.plain:
            self.score_unverified(draft, outcome.token)
        else:
            self.unverified = None
            for i in range(1, min(outcome.accepted + 2, len(draft))):  # put to the test: up to the first rejected
                self.tested(draft, i, i <= outcome.accepted)
            self.observe_floor(draft, outcome.accepted)
            self.observe_drafting(outcome)
        if outcome.seconds is not None:
            self.costs.observe(outcome)
            self.rates.tick()

    def drafting_pays(self) -> bool:
        """The rates say a model draft pays; it drafts while its drafts gained in this conversation, and while they
        did not, on every PROBE_EVERY-th such step, to find out when they pay again."""
        if self.fast_gain > 0 or self.fast_waited >= self.PROBE_EVERY:
            return True  # a probe stays due until a drafting step is observed (a plain stretch asks twice)
        self.fast_waited += 1
        return False

    def observe_drafting(self, outcome: Outcome) -> None:
        """What the step's model drafts gained, in plain steps: those accepted, less their draft steps and the
        positions they added to the verification. The rates price a draft before it is made; this measures what
        drafting returned, every cost included (the first draft pass over the kept prefix is dearer than the
        next)."""
        if not outcome.draft_steps:
            return
        self.fast_waited = 0
        if outcome.seconds is None or not self.costs.plains:
            return  # not timed, or no plain step yet to price it against
        draft, n = outcome.draft, len(outcome.draft)
        drafted = [i for i in range(1, n) if draft.sources[i] == self.model_kind]
        accepted = sum(i <= outcome.accepted for i in drafted)
        spent = outcome.draft_seconds / self.costs.plain_seconds()
        added = self.costs.ratio(n) - self.costs.ratio(n - len(drafted))
        self.fast_gain += self.GAIN_WEIGHT * (accepted - spent - added - self.fast_gain)

    def tested(self, draft: Draft, i: int, accepted: bool) -> None:
        self.rates.observe(self.keys(draft.sources[i], i, draft.lookup), accepted)

    def score_unverified(self, proposals: Draft, token: int) -> None:
        """A plain step's ``token`` scores the free drafters' unverified ``proposals`` as verification would (a
        copied token is accepted where it equals the model's), following them while they match: a plain stretch
        keeps teaching the rates, and ends where the text starts to repeat. The floor is scored as soon as the
        chain has matched all the floor would verify, so a copy that starts in a plain stretch turns it back on
        without waiting for the copy's end."""
        draft, i, scored = self.unverified or (proposals, 0, False)
        self.unverified = None
        if i + 1 >= len(draft):
            return
        hit = draft.tokens[i + 1] == token
        self.tested(draft, i + 1, hit)
        if not scored and (not hit or i + 1 >= self.floor(draft, copies=True) - 1 or i + 2 >= len(draft)):
            self.observe_floor(draft, i + 1 if hit else i)  # what its floor would have gained
            scored = True
        if hit and i + 2 < len(draft):
            self.unverified = (draft, i + 1, scored)
