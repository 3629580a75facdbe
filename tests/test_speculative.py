"""Self-speculative decoding is lossless: greedy output identical to plain greedy decoding."""

from m2r2_mlx.core.adapters import new_m2r2
from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.decoding.drafters import LayerDrafter, PromptLookupDrafter
from m2r2_mlx.decoding.generate import generate
from m2r2_mlx.decoding.history import TokenHistory
from m2r2_mlx.decoding.prompt_cache import PromptCache
from m2r2_mlx.decoding.sampling import Sampling
from m2r2_mlx.decoding.stats import AnswerStats

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from .tiny import EosAs, draft_chain, speculative_generate, tiny_model
from .tiny import random_prompts as _prompts


@pytest.fixture(scope="module")
def tiny_m2r2(lm):
    base = tiny_model("llama", seed=7, vocab_size=lm.config["vocab_size"], num_hidden_layers=8)
    m = new_m2r2(base, gates=[2, 4, 6])
    mx.random.seed(8)
    m.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.02, m.parameters()))
    mx.eval(m.parameters())
    return m


@pytest.mark.parametrize(
    "gate_index", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize(
    "max_draft", [3, pytest.param(1, marks=pytest.mark.slow), pytest.param(7, marks=pytest.mark.slow)]
)
def test_greedy_identical_on_many_prompts(lm, tiny_m2r2, gate_index, max_draft):
    model, tok = tiny_m2r2.base, lm.tokenizer
    for prompt in _prompts(6, seed=gate_index * 10 + max_draft):
        plain = [e.token for e in generate(model, tok, prompt, GenerationConfig(30))]
        drafter = LayerDrafter(tiny_m2r2, gate_index)
        spec = list(speculative_generate(model, tok, prompt, drafter, GenerationConfig(30), max_draft=max_draft))
        stats = AnswerStats()
        for ev in spec:
            stats.add(ev)
        assert [e.token for e in spec] == plain
        assert sum(stats.accept_lengths) + 1 == len(spec)  # every token but the prefill's came from a round
        assert all(1 <= a <= max_draft + 1 for a in stats.accept_lengths)
        assert all(e.exit_layer == tiny_m2r2.config.gates[gate_index] for e in spec if e.drafted)


@pytest.mark.slow
def test_drafts_crossing_end_of_sequence(lm, tiny_m2r2):
    model = tiny_m2r2.base
    checked = 0
    for prompt in _prompts(12, seed=42):
        plain = [e.token for e in generate(model, lm.tokenizer, prompt, GenerationConfig(30))]
        eos = plain[len(plain) // 2]  # a token the model does emit mid-answer becomes the end
        tok = EosAs(lm.tokenizer, eos)
        want = [e.token for e in generate(model, tok, prompt, GenerationConfig(30))]
        got = list(
            speculative_generate(model, tok, prompt, LayerDrafter(tiny_m2r2, 2), GenerationConfig(30), max_draft=7)
        )
        assert [e.token for e in got] == want
        assert got[-1].token == eos and got[-1].finish_reason == "stop"
        checked += 1
    assert checked == 12


def test_cache_after_speculation_matches_plain(lm, tiny_m2r2):
    model = tiny_m2r2.base
    prompt = _prompts(1, seed=5)[0]
    c1, c2 = PromptCache(model), PromptCache(model)
    list(generate(model, lm.tokenizer, prompt, GenerationConfig(25), cache=c1))
    list(
        speculative_generate(
            model, lm.tokenizer, prompt, LayerDrafter(tiny_m2r2, 1), GenerationConfig(25), cache=c2, max_draft=5
        )
    )
    # the plain loop feeds its last token ahead of time; compare the common positions
    n = min(len(c1), len(c2))
    assert c1.tokens[:n] == c2.tokens[:n] and n >= len(prompt) + 23
    for a, b in zip(c1.layers, c2.layers):
        assert b.offset == len(c2)
        np.testing.assert_allclose(np.array(a.keys[..., :n, :]), np.array(b.keys[..., :n, :]), atol=1e-4)


@pytest.fixture(scope="module")
def repeated_prompts(lm, tiny_m2r2) -> tuple[list, list]:
    """Prompts that repeat themselves (prompt lookup has something to find), and plain greedy's answers to them."""
    prompts = [p + p for p in _prompts(5, seed=3)]
    return prompts, [
        [e.token for e in generate(tiny_m2r2.base, lm.tokenizer, p, GenerationConfig(30))] for p in prompts
    ]


@pytest.mark.parametrize("kind", ["layerskip", "trimmed-vocab", "threshold", "lookup"])
def test_every_drafter_is_lossless(lm, tiny_m2r2, repeated_prompts, kind):
    model, tok = tiny_m2r2.base, lm.tokenizer
    prompts, plains = repeated_prompts
    emitted = sorted({t for p in plains for t in p})  # the trimmed head covers the tokens the model emits
    drafter = {
        "layerskip": LayerDrafter(tiny_m2r2, 1, adapters=False),
        "trimmed-vocab": LayerDrafter(tiny_m2r2, 0, vocab=emitted[: max(1, 3 * len(emitted) // 4)]),
        "threshold": LayerDrafter(tiny_m2r2, 1, threshold=0.5),
        "lookup": PromptLookupDrafter(),
    }[kind]
    drafted = 0
    for prompt, plain in zip(prompts, plains):
        spec = list(speculative_generate(model, tok, prompt, drafter, GenerationConfig(30), max_draft=4))
        assert [e.token for e in spec] == plain
        drafted += sum(e.drafted for e in spec)
    if kind != "threshold":
        assert drafted > 0  # the drafter did propose tokens that were accepted


def test_prompt_lookup_copies_the_latest_match():
    class Cache:
        tokens = [5, 6, 7, 1, 2, 9, 5, 6, 8, 4, 5]

    drafts, q = draft_chain(PromptLookupDrafter(max_ngram=2), Cache, 6, 3, None, eos_ids={4})
    assert drafts == [8, 4] and q is None  # "5 6" last seen before "8 4"; stops at the end token
    assert draft_chain(PromptLookupDrafter(), Cache, 3, 3, None, eos_ids=set())[0] == []  # 3 never seen


def _draft_confidences(tiny_m2r2, prompts) -> list[float]:
    """The first draft's probability after each prompt, as LayerDrafter's threshold reads it."""
    confs = []
    for p in prompts:
        cache = PromptCache(tiny_m2r2.base)
        mx.eval(cache.forward(p[:-1]))
        logits = tiny_m2r2.draft_logits(mx.array(p[-1]), 0, cache.layers)
        confs.append(mx.softmax(logits.astype(mx.float32)).max().item())
    return confs


def test_threshold_cuts_drafts_and_stays_lossless(lm, tiny_m2r2):
    """Below the threshold drafting stops: the unsure draft is verified as the last one; greedy output stays plain
    greedy's, and each call leaves the cache as it found it."""
    model, tok = tiny_m2r2.base, lm.tokenizer
    prompts = _prompts(6, seed=11)
    threshold = float(np.median(_draft_confidences(tiny_m2r2, prompts)))  # some drafts pass, some do not
    drafter = LayerDrafter(tiny_m2r2, 0, threshold=threshold)
    lengths = []
    for p in prompts:
        cache = PromptCache(model)
        mx.eval(cache.forward(p[:-1]))
        offsets = [c.offset for c in cache.layers]
        drafts, _ = draft_chain(drafter, cache, p[-1], 4, Sampling(), eos_ids=set())
        assert [c.offset for c in cache.layers] == offsets
        lengths.append(len(drafts))
    assert min(lengths) >= 1 and max(lengths) > 1  # the unsure draft is still proposed; sure ones go on
    for p in prompts[:3]:
        plain = [e.token for e in generate(model, tok, p, GenerationConfig(20))]
        assert [
            e.token for e in speculative_generate(model, tok, p, drafter, GenerationConfig(20), max_draft=4)
        ] == plain


def test_token_history_grows_without_changing_what_it_handed_out():
    history = TokenHistory(range(250))
    before = history.view()
    history.extend(range(1000, 1100))  # past the first buffer: a new one
    history.append(7)
    assert len(history) == 351 and history.last == 7
    assert before.tolist() == list(range(250))  # a view handed out earlier still reads its tokens
    assert history.view().tolist() == [*range(250), *range(1000, 1100), 7]
    found = PromptLookupDrafter().continuation(TokenHistory([5, 6, 7, 1, 5, 6]).view(), 3)
    assert found == ([7, 1, 5], 2)  # lookup reads the view as it reads a list (matched: the 2-gram 5 6)
