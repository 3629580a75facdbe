"""The first interval's context feature: the previous position's final residual, projected into its start."""

from m2r2_mlx.core.adapters import add_context_feature, load_adapters, new_m2r2, save_adapters
from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.decoding.drafters import LayerDrafter
from m2r2_mlx.decoding.early_exit import ExitPolicy
from m2r2_mlx.decoding.generate import generate
from m2r2_mlx.decoding.prompt_cache import PromptCache

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from .tiny import early_exit_generate, speculative_generate, tiny_model
from .tiny import random_ids as _ids
from .tiny import random_prompts as _prompts
from .tiny import randomize as _randomize


def test_zero_initialised_feature_changes_nothing():
    lm = tiny_model("llama")
    m = new_m2r2(lm, gates=[2, 4])
    _randomize(m)
    states, _, kv = m.slow_pass(_ids())
    before = m.fast_states(states, kv)
    add_context_feature(m)
    assert m.config.context_feature
    for a, b in zip(before, m.fast_states(states, kv)):
        assert mx.array_equal(a, b).item()
    _randomize(m, seed=2)  # once trained, the first interval reads it (test_fast_stream: as decoding does)
    after = m.fast_states(states, kv)
    assert not np.allclose(np.array(after[0]), np.array(before[0]), atol=1e-3)


def test_cache_keeps_the_final_states_of_its_positions():
    lm = tiny_model("llama")
    ids = _ids(T=10, B=1)[0].tolist()
    plain, kept = PromptCache(lm.model), PromptCache(lm.model)
    kept.keep_states = True
    a, b = plain.forward(ids[:6]), kept.forward(ids[:6])
    assert mx.array_equal(a, b).item()  # the split forward is the model's own, bit for bit
    m = new_m2r2(lm, gates=[2])
    _, final, _ = m.slow_pass(mx.array([ids[:6]]))
    np.testing.assert_allclose(np.array(kept.states), np.array(final[0]), atol=1e-5)
    kept.forward(ids[6:])
    kept.trim(2)  # verification rejected two drafts: states[-1] is the last kept position's
    _, final, _ = m.slow_pass(mx.array([ids[:8]]))
    np.testing.assert_allclose(np.array(kept.states[-1]), np.array(final[0, -1]), atol=1e-5)


@pytest.fixture(scope="module")
def ctx_m2r2(lm):
    base = tiny_model("llama", seed=7, vocab_size=lm.config["vocab_size"], num_hidden_layers=8)
    m = add_context_feature(new_m2r2(base, gates=[2, 4, 6]))
    mx.random.seed(8)
    m.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.02, m.parameters()))
    m.context.proj.weight = mx.random.normal(m.context.proj.weight.shape) * 0.5  # a feature strong enough to matter
    mx.eval(m.parameters())
    return m


@pytest.mark.parametrize("max_draft", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_speculative_with_the_feature_is_lossless(lm, ctx_m2r2, max_draft):
    model, tok = ctx_m2r2.base, lm.tokenizer
    drafter = LayerDrafter(ctx_m2r2, 0)
    assert drafter.keeps_states
    for prompt in _prompts(5, seed=max_draft):
        plain = [e.token for e in generate(model, tok, prompt, GenerationConfig(24))]
        spec = [
            e.token
            for e in speculative_generate(model, tok, prompt, drafter, GenerationConfig(24), max_draft=max_draft)
        ]
        assert spec == plain


def test_drafts_read_the_verified_final_state(lm, ctx_m2r2):
    """The first draft after verification reads the cache's last final state; without it the draft differs."""
    prompt = _prompts(1, seed=5)[0]
    cache = PromptCache(ctx_m2r2.base)
    cache.keep_states = True
    y = int(mx.argmax(cache.forward(prompt)[-1]).item())
    with_state = ctx_m2r2.draft_logits(mx.array(y), 0, cache.layers, h_prev=cache.states[-1])
    states, _, kv = ctx_m2r2.slow_pass(mx.array([prompt + [y]]))
    fast = ctx_m2r2.fast_states(states, kv)[0]  # teacher-forced: y's start reads the prompt's last final state
    np.testing.assert_allclose(np.array(with_state), np.array(ctx_m2r2.parts.head(fast[0, -1])), atol=1e-3)
    for layer in cache.layers[:2]:  # the draft's provisional K/V
        layer.trim(1)
    without = ctx_m2r2.draft_logits(mx.array(y), 0, cache.layers)
    assert not np.allclose(np.array(without), np.array(with_state), atol=1e-3)


def test_early_exit_with_the_feature(lm, ctx_m2r2):
    model, tok = ctx_m2r2.base, lm.tokenizer
    for prompt in _prompts(3, seed=9):
        plain = [e.token for e in generate(model, tok, prompt, GenerationConfig(20))]
        never = [
            e.token
            for e in early_exit_generate(ctx_m2r2, tok, prompt, GenerationConfig(20), policy=ExitPolicy(tau=1.5))
        ]
        assert never == plain
        exits = [
            e.exit_layer
            for e in early_exit_generate(ctx_m2r2, tok, prompt, GenerationConfig(20), policy=ExitPolicy(tau=0.0))
        ]
        assert set(exits[1:]) == {2}  # tau 0: every token after the prefill's leaves at the first gate


def test_saved_and_loaded_with_the_adapters(tmp_path):
    lm = tiny_model("llama")
    m = add_context_feature(new_m2r2(lm, gates=[2, 4], rank=8))
    _randomize(m)
    back = load_adapters(lm, save_adapters(m, tmp_path / "ad"))
    assert back.config == m.config and back.config.context_feature
    want, got = dict(tree_flatten(m.parameters())), dict(tree_flatten(back.parameters()))
    assert want.keys() == got.keys() and any(k.startswith("context.") for k in got)
    assert all(mx.array_equal(want[k], got[k]).item() for k in want)


def test_the_stand_in_is_what_a_second_draft_reads(lm, ctx_m2r2):
    """evaluate.first_gate_by_context's stand-in: the context a second draft reads at decode time, where the
    first draft's exit state takes the place of a final state not computed yet. (A second draft also attends to
    the first draft's provisional K/V; the ablation keeps the slow stream's, as here, to isolate the feature.)"""
    from m2r2_mlx.training.evaluate import first_gate_by_context

    ids = _prompts(1, seed=11)[0] + [5, 17]
    cache = PromptCache(ctx_m2r2.base)
    cache.keep_states = True
    cache.forward(ids[:-2])
    first = ctx_m2r2.draft_state(mx.array(ids[-2]), 0, cache.layers, h_prev=cache.states[-1])
    for layer in cache.layers[:2]:  # the first draft's provisional K/V, replaced by the slow stream's
        layer.trim(1)
    cache.forward(ids[-2:-1])
    second = ctx_m2r2.draft_state(mx.array(ids[-1]), 0, cache.layers, h_prev=first)
    states, _, kv = ctx_m2r2.slow_pass(mx.array([ids]))
    h = first_gate_by_context(ctx_m2r2, states, kv)
    np.testing.assert_allclose(np.array(h["final"][0, -2]), np.array(first), atol=1e-4)
    np.testing.assert_allclose(np.array(h["stand-in"][0, -1]), np.array(second), atol=1e-4)
    assert not np.allclose(np.array(h["final"][0, -1]), np.array(second), atol=1e-3)  # the stand-in changes it


def test_context_feature_ablation_counts():
    from m2r2_mlx.training.evaluate import context_feature_ablation, exit_matches, row_batches

    # a gate near the top of a shallow model, so that enough exits are right to count after them
    m = add_context_feature(new_m2r2(tiny_model("llama", seed=7, num_hidden_layers=3), gates=[2]))
    mx.random.seed(8)
    m.context.proj.weight = mx.random.normal(m.context.proj.weight.shape) * 0.3
    rows = np.array(_ids(T=12, B=4))
    r = context_feature_ablation(m, row_batches(rows, batch_size=2))
    assert r["tokens"] == 4 * 11  # every position but each row's first
    right = np.array(exit_matches(m, mx.array(rows), slice(None))[1][0])
    assert r["final"][0] == pytest.approx(right[:, 1:].mean())  # the plain agreement figure, first gate
    assert r["after a right exit"] == right[:, :-1].sum() > 0  # positions 1.. whose previous exit (0..) was right
    assert r["final"][1] == pytest.approx((right[:, 1:] & right[:, :-1]).sum() / right[:, :-1].sum())
    assert r["stand-in"][0] != r["final"][0] and r["none"][0] != r["final"][0]  # this feature matters
