"""Draft trees: one forward over a tree gives every node the logits it would get decoded alone, commit leaves the
cache exactly as sequential decoding would, and tree/hybrid/cost-planned speculative decoding stays greedy-exact.
The planner's arithmetic and the speculative options' checks are tested here too."""

from m2r2_mlx.core.adapters import new_m2r2
from m2r2_mlx.decoding.config import DecodeConfig, GenerationConfig
from m2r2_mlx.decoding.costs import StepCosts
from m2r2_mlx.decoding.decoders import make_decoder
from m2r2_mlx.decoding.drafters import LayerDrafter, PromptLookupDrafter
from m2r2_mlx.decoding.generate import generate
from m2r2_mlx.decoding.planner import CostPlanner, VerifyAll
from m2r2_mlx.decoding.prompt_cache import PromptCache
from m2r2_mlx.decoding.speculative import Speculator
from m2r2_mlx.decoding.stats import AnswerStats
from m2r2_mlx.decoding.tree import DraftTree
from m2r2_mlx.errors import M2R2Error

import numpy as np
import pytest

from m2r2_tui.render import token_text

from .tiny import EosAs, randomize, tiny_model
from .tiny import random_prompts as _prompts

ARCHS = ["llama", "phi3", "qwen2", "olmoe", "mixtral"]


def a_tree() -> DraftTree:
    """Root 7; a chain 11-12-13, a branch 21-22 at the root, a branch 31 after 11 and a shared node 11 proposed
    twice (by two drafters)."""
    tree = DraftTree.root(7)
    a = tree.add_chain(0, [11, 12, 13], "lookup")
    tree.add_chain(0, [21, 22], "fast")
    tree.add(a[0], 31, "fast")
    tree.add(0, 11, "fast")  # the same token again: shares node a[0]
    return tree


def test_tree_structure():
    tree = a_tree()
    assert len(tree) == 7 and tree.sources[1] == {"lookup", "fast"}
    assert tree.children(0) == [1, 4] and tree.path(6) == [0, 1, 6] and tree.depths == [0, 1, 2, 3, 1, 2, 2]
    kept = tree.keep([2, 5])  # closed under parents
    assert kept.tokens == [7, 11, 12, 21, 22] and kept.parents == [-1, 0, 1, 0, 3]
    mask = np.array(tree.mask(2))
    assert mask.shape == (7, 9) and mask[:, :2].all()
    assert mask[3, 2:].tolist() == [True, True, True, True, False, False, False]
    assert mask[6, 2:].tolist() == [True, True, False, False, False, False, True]


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_logits_equal_each_path_decoded_alone(arch):
    model = tiny_model(arch, seed=3).model
    prompt, tree = [5, 9, 17, 2, 33], a_tree()
    cache = PromptCache(model)
    cache.forward(prompt)
    logits = np.array(cache.forward_tree(tree))
    for node in range(len(tree)):
        alone = PromptCache(model)
        want = alone.forward(prompt + [tree.tokens[i] for i in tree.path(node)])[-1]
        np.testing.assert_allclose(logits[node], np.array(want), atol=1e-4, err_msg=f"{arch} node {node}")


@pytest.mark.parametrize("arch", ["llama", "olmoe"])
@pytest.mark.parametrize("leaf", [3, 5, 6])
def test_commit_leaves_the_cache_as_sequential_decoding(arch, leaf):
    model = tiny_model(arch, seed=4).model
    prompt, tree = [5, 9, 17, 2, 33], a_tree()
    cache = PromptCache(model)
    cache.forward(prompt)
    cache.forward_tree(tree)
    path = tree.path(leaf)
    cache.commit(path, len(tree))
    seq = prompt + [tree.tokens[i] for i in path]
    assert cache.tokens == seq and all(layer.offset == len(seq) for layer in cache.layers)
    alone = PromptCache(model)
    want = alone.forward(seq + [40])[-1]
    np.testing.assert_allclose(np.array(cache.forward([40])[-1]), np.array(want), atol=1e-4)


@pytest.fixture(scope="module")
def tiny_m2r2(lm):
    base = tiny_model("llama", seed=7, vocab_size=lm.config["vocab_size"], num_hidden_layers=8)
    m = new_m2r2(base, gates=[2, 4, 6])
    randomize(m, scale=0.02, seed=8)
    return m


def verify_all(model, tok, drafters, max_draft: int, width: int = 1) -> Speculator:
    return Speculator(model, tok, drafters, VerifyAll(drafters), max_draft=max_draft, width=width)


def cost_planned(model, tok, drafters, max_draft: int = 8, width: int = 3, **costs) -> Speculator:
    planner = CostPlanner(drafters, max_draft * width, StepCosts(draft_fraction=0.2, **costs))
    return Speculator(model, tok, drafters, planner, max_draft=max_draft, width=width)


def engines(m2r2, tok):
    model = m2r2.base
    both = lambda prior=None: [PromptLookupDrafter(prior=prior or 0.5), LayerDrafter(m2r2, 0, prior=prior)]  # noqa: E731
    return {
        "width 3, always": verify_all(model, tok, [LayerDrafter(m2r2, 1)], 5, 3),
        "hybrid, always": verify_all(model, tok, both(), 6, 2),
        "hybrid, cost": cost_planned(model, tok, both(prior=0.9)),
    }


def collect(events) -> AnswerStats:
    stats = AnswerStats()
    for ev in events:
        stats.add(ev)
    return stats


def test_trees_and_hybrid_drafting_are_greedy_exact(lm, tiny_m2r2):
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
            assert all(e.source in ("lookup", "fast") for e in got if e.drafted)
        assert drafted > 0, f"{name}: no draft was ever accepted, so nothing was tested"


def test_tree_drafts_crossing_end_of_sequence(lm, tiny_m2r2):
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
        (dict(tree_width=0), "tree width"),
        (dict(tree_width=99), "tree width"),
        (dict(gate=5), "not one of the adapters' gates"),
        (dict(drafter="magic"), "unknown drafter"),
        (dict(planner="sometimes"), "unknown planner"),
    ],
)
def test_bad_speculative_options_are_one_line(lm, options, says):
    with pytest.raises(M2R2Error, match=None) as e:
        make_decoder(lm, DecodeConfig("speculative", **options))
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_greedy_exact_under_a_repetition_penalty(lm, tiny_m2r2):
    """The penalty reads each position's own history: the verifier must see the sequence up to the node, not the
    cache as the tree forward left it."""
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
    assert stats.plan and all(ev.plan for ev in events[1:])
    lookup = next(ev for ev in events if ev.source == "lookup")
    assert "italic" in str(token_text(lookup.text, lookup.exit_layer, lookup.num_layers, True, lookup.source).style)
