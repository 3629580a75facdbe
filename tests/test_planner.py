"""The planner protocol: the engine's step is the same for every planner, and the trivial planner (verify every
proposal) with prompt lookup alone is prompt lookup decoding, token for token and step for step. The cost
planner's arithmetic: it verifies only what pays, whole chains where they pay as a whole, and sends the fast
stream only where its drafts pay for their steps."""

from __future__ import annotations

from m2r2_mlx.decoding.config import DecodeConfig, GenerationConfig
from m2r2_mlx.decoding.costs import StepCosts
from m2r2_mlx.decoding.draft import Draft, LookupMatch
from m2r2_mlx.decoding.drafters import PromptLookupDrafter
from m2r2_mlx.decoding.methods import make_decoder
from m2r2_mlx.decoding.planner import CostPlanner, VerifyAll
from m2r2_mlx.decoding.prompt_cache import PromptCache
from m2r2_mlx.decoding.protocols import DraftRequest, Outcome, Planner, StepPlan
from m2r2_mlx.decoding.sampling import Sampling
from m2r2_mlx.decoding.speculative import Speculator, SpeculatorSettings
from m2r2_mlx.decoding.stats import AnswerStats

import mlx.core as mx
import numpy as np

from .tiny import EosAs, tiny_model

V = 24


def reference_lookup(model, prompt: list[int], max_tokens: int, max_draft: int) -> tuple[list[int], list[int]]:
    """Prompt lookup decoding written out plainly: each step copies the continuation of the context's last n-gram,
    runs the full model once over [y, drafts], keeps the drafts up to the first that differs from its argmax and
    appends the model's own token. Returns the tokens and the tokens per step."""
    cache, lookup = PromptCache(model), PromptLookupDrafter()
    y = int(mx.argmax(cache.forward(prompt)[-1]).item())
    out, per_step = [y], []
    while len(out) < max_tokens:
        drafts, _ = lookup.continuation(prompt + out, min(max_draft, max_tokens - len(out) - 1))
        targets = np.array(mx.argmax(cache.forward([y, *drafts]), axis=-1)).tolist()
        k = next((i for i, d in enumerate(drafts) if d != targets[i]), len(drafts))
        cache.trim(len(drafts) - k)
        y = targets[k]
        out += [*drafts[:k], y]
        per_step.append(k + 1)
    return out[:max_tokens], per_step


def test_verify_all_with_lookup_alone_is_prompt_lookup_decoding(lm):
    """Every token of the prompt appears in it, so lookup always has a proposal (no plain stretch): the engine's
    steps are the reference's, one for one."""
    model = tiny_model("llama", seed=5, vocab_size=V, num_hidden_layers=2).model
    prompt = [int(t) for t in np.random.default_rng(0).permutation(V)] * 2
    tok = EosAs(lm.tokenizer, eos=10**6)
    drafters = [PromptLookupDrafter()]
    engine = Speculator(model, tok, drafters, VerifyAll(drafters), SpeculatorSettings(3, "lookup"))
    assert isinstance(engine.planner, Planner)
    stats = AnswerStats()
    tokens = [(stats.add(ev), ev.token)[1] for ev in engine(prompt, None, GenerationConfig(40))]
    want, per_step = reference_lookup(model, prompt, 40, 3)
    assert tokens == want
    assert stats.accept_lengths == per_step[: len(stats.accept_lengths)] and sum(stats.accept_lengths) == 39
    assert stats.accepted_per_step > 1.2  # the test exercises accepted drafts


def test_the_lookup_mode_is_the_trivial_planner_with_lookup(lm):
    decoder = make_decoder(lm, DecodeConfig("lookup"))
    assert isinstance(decoder.planner, VerifyAll) and [d.kind for d in decoder.free] == ["grammar", "lookup"]
    assert decoder.model_drafter is None
    assert isinstance(make_decoder(lm, DecodeConfig("speculative")).planner, CostPlanner)


class PlainOnly:
    """A planner that never drafts and keeps every outcome."""

    def __init__(self):
        self.outcomes = []

    def plan(self, draft, request):
        return StepPlan(1)

    def observe(self, outcome):
        self.outcomes.append(outcome)


def test_a_plain_stretch_times_only_tokens_that_queued_the_next_step(lm):
    """A plain step's time is what drafting is priced against. The stretch's first token waited for its own
    forward, and its last queued none (where evaluation runs at once, as on MLX's CPU, its forward ran in the step
    before): neither is timed; every token between is."""
    model = tiny_model("llama", seed=5, vocab_size=V, num_hidden_layers=2).model
    planner = PlainOnly()
    engine = Speculator(model, EosAs(lm.tokenizer, eos=10**6), [PromptLookupDrafter()], planner, SpeculatorSettings(3))
    tokens = [ev.token for ev in engine(list(range(V)), None, GenerationConfig(12))]
    assert len(tokens) == 12 and all(o.plain for o in planner.outcomes) and len(planner.outcomes) == 11
    timed = [o.seconds is not None for o in planner.outcomes]
    assert timed == [False] + [True] * 9 + [False]


class FastStream:
    """The model drafter as the planner sees it (kind, prior, free): the arithmetic needs no model."""

    kind, free, prior, exit_layer = "fast", False, 0.5, 6


def cost_planner(verify_1: float, verify_8: float, rate: float, draft: float = 0.01) -> CostPlanner:
    """A planner whose costs were measured (a plain step, a verification of 8) and whose rates are held at
    ``rate`` by a strong prior."""
    costs = StepCosts(draft_fraction=0.2)
    costs.observe_plain(verify_1)
    for _ in range(2):
        costs.observe_verify(8, verify_8)
    costs.observe_draft(draft)
    planner = CostPlanner([PromptLookupDrafter(prior=rate), FastStream()], costs)
    planner.priors["fast"] = rate
    planner.rates.strength = 1000
    return planner


def lookup_chain() -> Draft:
    draft = Draft.root(1)
    for t in (2, 3, 4):
        draft.add(t, "lookup")
    return draft


def request(limit: int = 4) -> DraftRequest:
    return DraftRequest(None, [1, 2, 3, 4, 1], limit, Sampling(), set())


def test_the_cost_planner_verifies_only_what_pays():
    plan = cost_planner(0.050, 0.060, 0.8).plan(lookup_chain(), request())
    assert plan.keep == 4 and plan.draft is None  # cheap positions, likely drafts: no fast stream
    assert cost_planner(0.050, 0.400, 0.3).plan(lookup_chain(), request()).plain  # a position costs a token
    cheap = cost_planner(0.050, 0.060, 0.9, draft=0.002).plan(lookup_chain(), request(limit=8))
    assert cheap.keep == 4 and cheap.draft is not None and cheap.draft.room(lookup_chain()) == 5  # after lookup's


def test_lookups_first_tokens_are_verified_as_lookup_alone_verifies_them():
    """The floor: where the costs say no position pays, lookup's first continuation is still verified as far as
    the lookup mode goes (and no further), so the engine never verifies less of it than lookup alone."""
    planner = cost_planner(0.050, 0.400, 0.3)
    assert planner.plan(lookup_chain(), request()).plain
    planner.lookup_floor = 2
    plan = planner.plan(lookup_chain(), request())
    assert plan.keep == 3 and plan.draft is None
    grammar = Draft.root(1)
    grammar.add(5, "grammar")
    for t in (2, 3, 4):
        grammar.add(t, "lookup")
    assert planner.plan(grammar, request()).keep == 4  # the grammar's forced text, then lookup's first two


def test_a_chain_that_pays_as_a_whole_is_verified_whole():
    """Best-prefix selection: where the first extra position costs much more than the next ones (this CPU's
    curve), a first proposal that alone would not pay, followed by ones that are sure once it is accepted (a
    copied span), is verified with them."""
    costs = StepCosts()
    costs.observe_plain(0.050)
    for n, ratio in ((2, 1.3), (4, 1.34), (8, 1.42)):
        for _ in range(2):
            costs.observe_verify(n, 0.050 * ratio)
    planner = CostPlanner([PromptLookupDrafter()], costs)
    for depth, accepted in ((1, 25), (2, 98), (3, 98)):
        for i in range(100):
            planner.rates.observe(planner.keys("lookup", depth), i < accepted)
    first = lookup_chain().keep(2)
    assert planner.plan(first, request()).plain  # 1.25 tokens for 1.3 plain steps: alone it does not pay
    assert planner.plan(lookup_chain(), request()).keep == 4  # 1.74 for 1.34 (4 positions)


def test_lookup_records_how_it_found_its_copy():
    """The n-gram it matched, and whether the copy continues (the last token is what lookup proposed a step
    before): lookup's acceptance rates are kept apart by these, so a copy in progress is not priced like a guess."""
    lookup = PromptLookupDrafter()
    copying = [5, 6, 7, 8, 1, 5, 6, 7]  # 5 6 7 recurs, and 7 is what lookup proposed after the 5 6 before it
    draft = Draft.root(copying[-1])
    lookup.propose(draft, DraftRequest(None, copying, 3, Sampling(), set()))
    assert draft.tokens[1:] == [8, 1, 5] and draft.lookup == LookupMatch(3, True)
    guessing = [5, 6, 7, 8, 2, 9, 6]  # only the last token recurs, and nothing proposed 6 after 2 9
    draft = Draft.root(guessing[-1])
    lookup.propose(draft, DraftRequest(None, guessing, 3, Sampling(), set()))
    assert draft.tokens[1:] == [7, 8, 2] and draft.lookup == LookupMatch(1, False)
    assert CostPlanner.keys("lookup", 2, draft.lookup) == (("lookup", 2, 1, False), ("lookup", 2))


def test_the_floor_holds_only_while_lookups_copies_pay():
    """Where the costs say no position pays, the floor verifies lookup's first copies, until verifying them is
    seen not to gain; copies that would have been accepted, scored in plain stretches, turn it back on."""
    dear = cost_planner(0.050, 0.400, 0.3)
    dear.lookup_floor = 3
    assert dear.plan(lookup_chain(), request()).keep == 4
    for _ in range(30):  # verified floors that gained nothing
        dear.observe(Outcome(lookup_chain(), 0, 9, 0.200))  # at the 4 plain steps 4 positions cost here
    assert dear.floor_gain < 0 and dear.plan(lookup_chain(), request()).plain
    cheap = cost_planner(0.050, 0.060, 0.3)
    cheap.lookup_floor, cheap.floor_gain = 3, -1.0
    for _ in range(30):  # plain stretches through copies that would all have been accepted
        chain = lookup_chain()
        for token in (2, 3, 4):
            cheap.observe(Outcome(chain, 0, token, 0.050, plain=True))
    assert cheap.floor_gain > 0 and cheap.floor(lookup_chain()) == 4


def test_a_copy_met_in_a_plain_stretch_turns_the_floor_on_once_it_covers_it():
    """After new writing turned the floor off, a copy that starts in a plain stretch is scored as soon as it has
    matched all the floor would verify (not at its end), once: the next step verifies the floor."""
    planner = cost_planner(0.050, 0.060, 0.3)
    planner.lookup_floor, planner.floor_gain = 3, -0.1
    chain = Draft.root(1)
    for t in (2, 3, 4, 5, 6, 7, 8):
        chain.add(t, "lookup")
    for token in (2, 3):
        planner.observe(Outcome(chain, 0, token, 0.050, plain=True))
    assert planner.floor_gain == -0.1  # two of the floor's three copies matched: not scored yet
    planner.observe(Outcome(chain, 0, 4, 0.050, plain=True))
    scored = planner.floor_gain
    assert scored > 0 and planner.floor(lookup_chain()) == 4
    for token in (5, 6):  # the chain goes on teaching the rates; the floor is not scored twice
        planner.observe(Outcome(chain, 0, token, 0.050, plain=True))
    assert planner.floor_gain == scored


def test_the_fast_stream_drafts_only_while_its_drafts_return_what_they_cost():
    """Rates that say a fast draft pays do not keep it drafting where its drafts, every cost counted, gain
    nothing in this conversation: it then drafts on every PROBE_EVERY-th step it would, and drafts again once a
    probe's drafts pay."""
    planner = cost_planner(0.050, 0.060, 0.9, draft=0.002)
    assert planner.plan(lookup_chain(), request(limit=8)).draft is not None

    def drafted(accepted: int) -> Outcome:
        draft = lookup_chain()
        for t in (5, 6, 7):
            draft.add(t, "fast")
        return Outcome(draft, accepted, 9, 0.065, draft_seconds=0.006, draft_steps=3)  # at the table's costs

    for _ in range(30):  # the copy accepted, every fast draft rejected
        planner.observe(drafted(3))
    assert planner.fast_gain < 0
    probes = 0
    for _ in range(2 * (CostPlanner.PROBE_EVERY + 1)):  # steps; each probe's drafts rejected again
        plan = planner.plan(lookup_chain(), request(limit=8))
        assert plan.keep == 4
        if plan.draft is not None:
            probes += 1
            assert planner.plan(lookup_chain(), request(limit=8)).draft is not None  # due until it is made
            planner.observe(drafted(3))
    assert probes == 2
    for _ in range(30):  # probes whose drafts were all accepted
        planner.observe(drafted(6))
    assert planner.fast_gain > 0 and planner.plan(lookup_chain(), request(limit=8)).draft is not None
