"""Drafts: verification accepts a draft exactly where plain decoding would have produced it, and hybrid and
cost-planned speculative decoding stays greedy-exact, across the end-of-sequence token and under a repetition
penalty. The speculative options' checks are tested here too."""

from m2r2_mlx.core.adapters import new_m2r2
from m2r2_mlx.decoding.config import DecodeConfig, GenerationConfig
from m2r2_mlx.decoding.costs import StepCosts
from m2r2_mlx.decoding.draft import Draft, verify
from m2r2_mlx.decoding.drafters import LayerDrafter, PromptLookupDrafter
from m2r2_mlx.decoding.generate import generate
from m2r2_mlx.decoding.methods import make_decoder
from m2r2_mlx.decoding.planner import CostPlanner, VerifyAll
from m2r2_mlx.decoding.sampling import Sampling
from m2r2_mlx.decoding.speculative import Speculator, SpeculatorSettings
from m2r2_mlx.decoding.stats import AnswerStats
from m2r2_mlx.errors import M2R2Error

import mlx.core as mx
import pytest

from m2r2_tui.render import token_text

from .tiny import EosAs, randomize, tiny_model
from .tiny import random_prompts as _prompts


def test_a_draft_is_a_chain_of_sourced_tokens():
    draft = Draft.root(7)
    draft.add(11, "grammar")
    for t in (12, 13):
        draft.add(t, "lookup")
    draft.add(21, "fast", mx.ones(4) / 4)
    assert (
        len(draft) == 5 and draft.keep(3).tokens == [7, 11, 12] and draft.keep(3).sources == ["", "grammar", "lookup"]
    )
    assert draft.describe() == "fast 1 + grammar 1 + lookup 2" and Draft.root(7).describe() == "plain"


def test_greedy_verification_accepts_up_to_the_first_miss():
    logits = mx.eye(32)[mx.array([11, 12, 30, 5])] * 10  # the model's argmax after each position
    draft = Draft.root(7)
    for t in (11, 12, 13):
        draft.add(t, "lookup")
    verified = verify(logits, draft, Sampling())
    assert (verified.accepted, verified.token) == (2, 30)  # 11 and 12 accepted; 13 is not the model's 30
    whole = verify(mx.eye(32)[mx.array([11, 12, 13, 5])] * 10, draft, Sampling())
    assert (whole.accepted, whole.token) == (3, 5)  # every draft accepted: the model's token after the last


@pytest.fixture(scope="module")
def tiny_m2r2(lm):
    base = tiny_model("llama", seed=7, vocab_size=lm.config["vocab_size"], num_hidden_layers=8)
    m = new_m2r2(base, gates=[2, 4, 6])
    randomize(m, scale=0.02, seed=8)
    return m


def verify_all(model, tok, drafters, max_draft: int) -> Speculator:
    return Speculator(model, tok, drafters, VerifyAll(drafters), SpeculatorSettings(max_draft))


def cost_planned(model, tok, drafters, max_draft: int = 8, **costs) -> Speculator:
    planner = CostPlanner(drafters, StepCosts(draft_fraction=0.2, **costs))
    return Speculator(model, tok, drafters, planner, SpeculatorSettings(max_draft))


def engines(m2r2, tok):
    model = m2r2.base
    both = lambda prior=None: [PromptLookupDrafter(prior=prior or 0.5), LayerDrafter(m2r2, 0, prior=prior)]  # noqa: E731
    return {
        "fast, always": verify_all(model, tok, [LayerDrafter(m2r2, 1)], 5),
        "hybrid, always": verify_all(model, tok, both(), 6),
        "hybrid, cost": cost_planned(model, tok, both(prior=0.9)),
    }


def collect(events) -> AnswerStats:
    stats = AnswerStats()
    for ev in events:
        stats.add(ev)
    return stats


def test_hybrid_and_cost_planned_drafting_are_greedy_exact(lm, tiny_m2r2):
    model = tiny_m2r2.base
    for name, engine in engines(tiny_m2r2, lm.tokenizer).items():
        drafted = 0
        for prompt in _prompts(3, seed=len(name)):
            prompt = prompt + prompt[:6]  # a repeat: lookup has something to copy
            plain = [e.token for e in generate(model, lm.tokenizer, prompt, GenerationConfig(30))]
            got = list(engine(prompt, None, GenerationConfig(30)))
            stats = collect(got)
            assert [e.token for e in got] == plain, name
            drafted += sum(stats.drafted_by.values())
            assert sum(stats.accept_lengths) + 1 == len(got)
            assert all(e.spec.source in ("lookup", "fast") for e in got if e.drafted)
        assert drafted > 0, f"{name}: no draft was ever accepted, so nothing was tested"


def test_drafts_crossing_end_of_sequence(lm, tiny_m2r2):
    model = tiny_m2r2.base
    for prompt in _prompts(6, seed=77):
        prompt = prompt + prompt[:5]
        plain = [e.token for e in generate(model, lm.tokenizer, prompt, GenerationConfig(30))]
        tok = EosAs(lm.tokenizer, plain[len(plain) // 2])
        want = [e.token for e in generate(model, tok, prompt, GenerationConfig(30))]
        for engine in engines(tiny_m2r2, tok).values():
            got = list(engine(prompt, None, GenerationConfig(30)))
            assert [e.token for e in got] == want and got[-1].finish_reason == "stop"


@pytest.mark.parametrize(
    "options, says",
    [
        (dict(max_draft=0), "at least 1"),
        (dict(threshold=float("nan")), "[0, 1]"),
        (dict(threshold=-0.1), "[0, 1]"),
        (dict(gate=5), "not one of the adapters' gates"),
        (dict(method="magic"), "must be one of: plain, speculative"),
    ],
)
def test_bad_speculative_options_are_one_line(lm, options, says):
    with pytest.raises(M2R2Error, match=None) as e:
        make_decoder(lm, DecodeConfig(**{"method": "speculative", **options}))
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_greedy_exact_under_a_repetition_penalty(lm, tiny_m2r2):
    """The penalty reads each position's own history: the verifier must see the sequence up to the position, not
    the cache as the draft's forward left it."""
    model = tiny_m2r2.base
    for prompt in _prompts(3, seed=5):
        prompt = prompt + prompt[:6]
        generation = GenerationConfig.create(30, repetition_penalty=1.3, repetition_context_size=8)
        plain = [e.token for e in generate(model, lm.tokenizer, prompt, generation)]
        for name, engine in engines(tiny_m2r2, lm.tokenizer).items():
            assert [e.token for e in engine(prompt, None, generation)] == plain, name


def test_plain_stretches_are_plain_decoding(lm, tiny_m2r2):
    """Where no draft pays the engine decodes plainly with each step queued before the last token is read, and
    leaves such a stretch when a draft pays again: tokens (under a repetition penalty too) stay plain greedy's,
    and each stretch step counts as one token per step."""
    model = tiny_m2r2.base
    both = lambda: [PromptLookupDrafter(), LayerDrafter(tiny_m2r2, 0)]  # noqa: E731
    never = cost_planned(model, lm.tokenizer, both())
    never.planner.priors = {"lookup": 0.0, "fast": 0.0}
    never.planner.rates.strength = 1e6  # so sure that drafting never pays that it is never tried
    for prompt in _prompts(3, seed=11):
        prompt = prompt + prompt[:6]
        for options in (dict(), dict(repetition_penalty=1.3, repetition_context_size=8)):
            generation = GenerationConfig.create(25, **options)
            plain = [e.token for e in generate(model, lm.tokenizer, prompt, generation)]
            got = list(never(prompt, None, generation))
            assert [e.token for e in got] == plain and not any(e.drafted for e in got)
            assert collect(got).accept_lengths == [1] * (len(got) - 1) and got[-1].finish_reason == "length"
    assert not never.planner.costs.samples  # no verification of more than one position: plain steps only


def test_events_name_their_drafter_and_the_plan(lm, tiny_m2r2):
    """What the chat shows: each accepted draft's drafter (lookup copies italic) and the engine's live choice."""
    engine = engines(tiny_m2r2, lm.tokenizer)["hybrid, always"]
    prompt = _prompts(1, seed=9)[0] * 3
    events = list(engine(prompt, None, GenerationConfig(30)))
    stats = collect(events)
    assert stats.drafted > 0 and sum(stats.drafted_by.values()) == stats.drafted
    assert stats.plan and all(ev.spec.plan for ev in events[1:])
    lookup = next(ev for ev in events if ev.drafted and ev.spec.source == "lookup")
    assert "italic" in str(
        token_text(lookup.text, lookup.exit_layer, lookup.num_layers, True, lookup.spec.source).style
    )
