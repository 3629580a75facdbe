"""Dynamic early exit: deferred KV fill is exact, tau above 1 is plain decoding, exits only at gates,
deeper gates ask more with scaled thresholds."""

from m2r2_mlx.core.adapters import new_m2r2
from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.decoding.early_exit import ExitPolicy, gate_thresholds
from m2r2_mlx.decoding.generate import generate
from m2r2_mlx.decoding.prompt_cache import PromptCache
from m2r2_mlx.decoding.stats import AnswerStats

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from experiments.exit_variants import exit_walker

from .tiny import EosAs, early_exit_generate, tiny_model

PROMPTS = [[5, 17, 99, 3, 42, 7], [64, 2, 88, 11], [9, 9, 30, 31, 32, 33, 34, 35]]


@pytest.fixture(scope="module")
def tiny_m2r2(lm):
    base = tiny_model("llama", seed=21, vocab_size=lm.config["vocab_size"], num_hidden_layers=8)
    m = new_m2r2(base, gates=[2, 4, 6])
    mx.random.seed(22)
    m.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.02, m.parameters()))
    mx.eval(m.parameters())
    return m


def full_cache(model, tokens):
    cache = PromptCache(model)
    cache.forward(tokens)
    return cache


def assert_cache_is_full_models(model, cache):
    ref = full_cache(model, cache.tokens)
    for a, b in zip(ref.layers, cache.layers):
        assert b.offset == len(cache.tokens)  # every position filled at every layer
        np.testing.assert_allclose(
            np.array(b.keys[..., : b.offset, :]), np.array(a.keys[..., : a.offset, :]), atol=2e-4
        )
        np.testing.assert_allclose(
            np.array(b.values[..., : b.offset, :]), np.array(a.values[..., : a.offset, :]), atol=2e-4
        )


def test_tau_above_every_probability_is_plain_decoding(lm, tiny_m2r2):
    model = tiny_m2r2.base
    for prompt in PROMPTS:
        plain = [e.token for e in generate(model, lm.tokenizer, prompt, GenerationConfig(20))]
        got = list(
            early_exit_generate(tiny_m2r2, lm.tokenizer, prompt, GenerationConfig(20), policy=ExitPolicy(tau=1.01))
        )
        assert [e.token for e in got] == plain
        assert all(e.exit_layer == 8 for e in got)


def mixed(i):  # exits at every depth in turn, and full passes between them
    return [2, 6, None, 4, 2, 2, None, 6][i % 8]


@pytest.mark.parametrize(
    "source, schedule, fused",
    [
        ("fast", None, True),
        ("fast", None, False),
        ("layerskip", None, True),
        ("fast", mixed, True),
        ("fast", mixed, False),
        ("layerskip", mixed, True),
    ],
)
def test_deferred_kv_fill_gives_the_full_models_cache(lm, tiny_m2r2, source, schedule, fused):
    model = tiny_m2r2.base
    exits = set()
    for prompt in PROMPTS:
        cache = PromptCache(model)
        events = list(
            early_exit_generate(
                tiny_m2r2,
                lm.tokenizer,
                prompt,
                GenerationConfig(16),
                policy=ExitPolicy(tau=0.0),
                cache=cache,
                walker=exit_walker(source=source, schedule=schedule, fused=fused),
            )
        )
        exits |= {e.exit_layer for e in events[1:]}
        assert cache.tokens == prompt + [e.token for e in events[:-1]]
        assert_cache_is_full_models(model, cache)
    assert min(exits) < 8  # tokens did exit early, so pending tokens were filled


def test_exits_only_at_allowed_gates(lm, tiny_m2r2):
    for gates in (None, [4], [4, 6]):
        allowed = set(gates or tiny_m2r2.config.gates) | {8}
        events = list(
            early_exit_generate(
                tiny_m2r2,
                lm.tokenizer,
                PROMPTS[0],
                GenerationConfig(12),
                policy=ExitPolicy(tau=0.0),
                walker=exit_walker(gates=gates),
            )
        )
        assert {e.exit_layer for e in events[1:]} <= allowed
        assert min(e.exit_layer for e in events[1:]) == min(allowed)  # tau 0: the first allowed gate, never before


def test_scaled_thresholds_price_every_error_the_same():
    gates, L = [6, 12, 18, 24], 30
    taus = gate_thresholds(0.8, gates, 6, L)
    assert taus[0] == pytest.approx(0.8) and taus == sorted(taus) and taus[-1] < 1
    price = [(1 - t) / (1 - g / L) for t, g in zip(taus, gates)]  # risk accepted per unit of compute saved
    assert price == pytest.approx([price[0]] * 4)
    assert gate_thresholds(0.8, gates, 12, L)[1] == pytest.approx(0.8)  # tau belongs to the first gate checked
    assert gate_thresholds(0.8, gates, 6, L, scaled=False) == [0.8] * 4
    assert min(gate_thresholds(1.01, gates, 6, L)) > 1  # above 1 still never exits


def test_scaled_tau_asks_more_at_deeper_gates(lm, tiny_m2r2):
    """Gates at 2/4/6 of 8 layers, tau 0.8 at the first: scaled, gate 4 asks 0.867 and gate 6 0.933."""

    def run(score_after_first, scaled):
        rule = lambda logits, h, j, trail: 0.0 if j == 0 else score_after_first  # noqa: E731
        events = early_exit_generate(
            tiny_m2r2,
            lm.tokenizer,
            PROMPTS[0],
            GenerationConfig(8),
            policy=ExitPolicy(tau=0.8, rule=rule, scaled_tau=scaled),
        )
        return {e.exit_layer for e in list(events)[1:]}

    assert run(0.85, scaled=False) == {4}
    assert run(0.85, scaled=True) == {8}  # below gate 4's 0.867 and gate 6's 0.933
    assert run(0.9, scaled=True) == {4}
    assert run(0.95, scaled=True) == {4}


def test_fixed_schedule_and_second_turn_reuse(lm, tiny_m2r2):
    model = tiny_m2r2.base
    cache = PromptCache(model)
    schedule = lambda i: 2 if i % 2 else None  # noqa: E731  (odd positions exit at L2, even ones run the full model)
    events = list(
        early_exit_generate(
            tiny_m2r2,
            lm.tokenizer,
            PROMPTS[1],
            GenerationConfig(10),
            policy=ExitPolicy(tau=0.9),
            cache=cache,
            walker=exit_walker(schedule=schedule, source="layerskip"),
        )
    )
    assert [e.exit_layer for e in events[1:]] == [2 if i % 2 else 8 for i in range(1, 10)]
    assert_cache_is_full_models(model, cache)
    # a second turn reuses the cache the first one left (only the new tokens are prefilled)
    turn2 = cache.tokens + [events[-1].token, 50, 51]
    ev = next(
        iter(
            early_exit_generate(
                tiny_m2r2, lm.tokenizer, turn2, GenerationConfig(2), policy=ExitPolicy(tau=1.01), cache=cache
            )
        )
    )
    assert ev.timing.prefill_tokens == 3


def test_fused_fast_check_is_the_fast_stream_even_with_pending_tokens(lm, tiny_m2r2):
    """The fused pass gives the new token the fast state the trainer defines (ParallelKV over the whole
    sequence), also when earlier tokens are still pending in the interval's layers."""
    m, model = tiny_m2r2, tiny_m2r2.base
    (_, g2, g3), prompt = m.config.gates, PROMPTS[2]
    cache = full_cache(model, prompt[:-1])
    walker = exit_walker(schedule=lambda i: g2)(m, cache, ExitPolicy(tau=0.0))  # every token leaves at g2
    for i, tok in enumerate([prompt[-1], 40, 41]):
        walker.step(tok, i)
    assert [c for c, _ in walker.pending] == [g2, g2, g2]
    new = 42
    cache.record(new)
    h = walker._slow(m.parts.embed(mx.array([[new]])), 0, g2)  # the pending tokens join at g2, not before
    assert len(walker.pending) == 3
    slow, fast = walker._fused(h, 2)  # the third interval, [g2, g3)
    assert slow.shape[1] == 4 and not walker.pending  # the three pending tokens rode along
    ids = mx.array([cache.tokens])
    states, _, kv = m.slow_pass(ids)
    ref = m.fast_states(states, kv)[2][:, -1:]
    np.testing.assert_allclose(np.array(fast), np.array(ref), atol=1e-4)
    np.testing.assert_allclose(np.array(slow[:, -1:]), np.array(states[g3][:, -1:]), atol=1e-4)


@pytest.mark.parametrize("fused", [True, False])
def test_fused_and_unfused_layer_passes(lm, tiny_m2r2, fused):
    """Fused checks never read a layer twice: with tau above 1 (no exit) a token costs L passes;
    the unfused path pays the fast stream's interval on top, for every checked gate."""
    walker = exit_walker(fused=fused)
    policy = ExitPolicy(tau=1.01)
    events = list(
        early_exit_generate(tiny_m2r2, lm.tokenizer, PROMPTS[0], GenerationConfig(6), policy=policy, walker=walker)
    )
    stats = AnswerStats()
    for ev in events:
        stats.add(ev)
    steps = len(events) - 1  # the first token comes from the prefill
    extra = 0 if fused else sum(b - a for a, b in tiny_m2r2.config.intervals())
    assert [ev.exit.layer_passes for ev in events] == [0] + [8 + extra] * steps  # each token carries its own cost
    assert stats.layer_passes == steps * (8 + extra)


def test_exit_head_over_a_vocabulary_subset(lm, tiny_m2r2):
    """Checks scored over a subset: exited tokens come from it (the subset's own argmax), a check that never
    exits is plain decoding, and the cache is still the full model's."""
    from m2r2_mlx.models.base_model import SubsetHead

    model, parts = tiny_m2r2.base, tiny_m2r2.parts
    ids = list(range(0, lm.config["vocab_size"], 3))[:200]
    head = SubsetHead(parts, ids)
    h = mx.random.normal((1, 1, parts.hidden_size))
    np.testing.assert_allclose(np.array(head(h)), np.array(parts.head(h)[..., mx.array(ids)]), atol=1e-5)
    spread = head.full(head(h)[0, -1])
    assert spread.shape == (lm.config["vocab_size"],) and int(mx.argmax(spread).item()) in ids
    assert mx.isinf(spread).sum().item() == lm.config["vocab_size"] - len(ids)
    for prompt in PROMPTS[:2]:
        plain = [e.token for e in generate(model, lm.tokenizer, prompt, GenerationConfig(12))]
        never = list(
            early_exit_generate(
                tiny_m2r2, lm.tokenizer, prompt, GenerationConfig(12), policy=ExitPolicy(tau=1.01, exit_head=head)
            )
        )
        assert [e.token for e in never] == plain
        cache = PromptCache(model)
        always = list(
            early_exit_generate(
                tiny_m2r2,
                lm.tokenizer,
                prompt,
                GenerationConfig(12),
                policy=ExitPolicy(tau=0.0, exit_head=head),
                cache=cache,
            )
        )
        assert all(e.token in ids and e.exit_layer == 2 for e in always[1:])
        assert_cache_is_full_models(model, cache)


def test_gates_off_decode_as_plain(lm, tiny_m2r2):
    """Where no exit ever happens (tau above 1), the planner stops checking: the tokens are plain decoding's and
    the later tokens run no check at all."""
    from m2r2_mlx.decoding.exit_planner import GatePlanner

    prompt, planner = [3, 4, 5, 6], GatePlanner(tiny_m2r2.config.gates, tiny_m2r2.parts.num_layers)
    plain = [e.token for e in generate(tiny_m2r2.base, lm.tokenizer, prompt, GenerationConfig(40))]
    events = list(
        early_exit_generate(
            tiny_m2r2, lm.tokenizer, prompt, GenerationConfig(40), policy=ExitPolicy(tau=1.01), planner=planner
        )
    )
    assert [e.token for e in events] == plain
    assert not any(planner.checked())
    # once no gate is checked, each token is one forward of the whole model, queued before the previous is read
    L = tiny_m2r2.parts.num_layers
    assert [(e.exit.layer, e.exit.layer_passes, e.exit.token_layers) for e in events[-10:]] == [(L, L, L)] * 10

    # an answer that ends at an end token read after the next forward was queued: the cache ends before it, as
    # after any answer, and holds the full model's keys and values
    cache, end = PromptCache(tiny_m2r2.base), 30
    eos = EosAs(lm.tokenizer, eos=plain[end])
    tokens = [
        e.token
        for e in early_exit_generate(
            tiny_m2r2, eos, prompt, GenerationConfig(40), policy=ExitPolicy(tau=1.01), planner=planner, cache=cache
        )
    ]
    assert tokens == plain[: plain.index(plain[end]) + 1]
    assert [int(t) for t in cache.tokens] == prompt + tokens[:-1]
    assert_cache_is_full_models(tiny_m2r2.base, cache)


def test_a_rule_that_reads_earlier_gates_gets_its_checks_as_a_prefix(lm, tiny_m2r2):
    """ARLA scores gate j from the latents of every gate up to j, as it was trained: where the planner would check
    a gate after one it skips, the ARLA rule checks neither (no trail with a gap); max-softmax confidence, which
    reads one gate, keeps the planner's plan."""
    from dataclasses import replace

    from m2r2_mlx.core.arla import ARLARule
    from m2r2_mlx.core.fast_stream import M2R2Model
    from m2r2_mlx.decoding.early_exit import EarlyExit
    from m2r2_mlx.decoding.exit_planner import GatePlanner, StepFit

    planner = GatePlanner(tiny_m2r2.config.gates, tiny_m2r2.parts.num_layers)
    planner.fit = StepFit([1.0, 0.1, 0.5, 0.0])  # a machine where a check costs half a layer pass
    for _ in range(200):  # gate 0 never exits, gate 1 always does
        planner.observe({0: False, 1: True}, 8, 0, 2, None)
    assert planner.checked()[:2] == [False, True]
    with_arla = M2R2Model(tiny_m2r2.base, replace(tiny_m2r2.config, arla=True))
    with_arla.update(tiny_m2r2.parameters())  # the same adapters, and a (random) ARLA head
    mx.eval(with_arla.parameters())
    cache = PromptCache(tiny_m2r2.base)
    by_confidence = EarlyExit(tiny_m2r2, cache, ExitPolicy(0.5), planner=planner)
    by_arla = EarlyExit(with_arla, cache, ExitPolicy(0.5, rule=ARLARule(with_arla.arla)), planner=planner)
    assert by_confidence.planned_checks() == planner.checked()
    assert by_arla.planned_checks() == [False] * len(planner.checked())
    events = list(
        early_exit_generate(
            with_arla, lm.tokenizer, PROMPTS[0], GenerationConfig(8), policy=by_arla.policy, planner=planner
        )
    )
    assert len(events) == 8
