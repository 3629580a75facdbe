"""The M2R2 fast stream on tiny models of several architectures."""

from m2r2_mlx.core.adapters import add_context_feature, load_adapters, new_m2r2, save_adapters
from m2r2_mlx.errors import M2R2Error

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from .tiny import CONFIGS, tiny_model
from .tiny import random_ids as _ids
from .tiny import randomize as _randomize

ARCHS = list(CONFIGS)


@pytest.mark.parametrize("arch", ARCHS)
def test_shapes(arch):
    lm = tiny_model(arch)
    m = new_m2r2(lm, gates=[2, 4])
    states, final, kv = m.slow_pass(_ids())
    fast = m.fast_states(states, kv)
    assert [f.shape for f in fast] == [(2, 9, 64)] * 2
    assert m.parts.head(fast[0]).shape == (2, 9, 101)
    assert len(m.adapters) == 4  # one per fast-stream layer, none past the last gate


@pytest.mark.parametrize("arch", ARCHS)
def test_zero_adapters_equal_plain_base_layers(arch):
    lm = tiny_model(arch)
    m = new_m2r2(lm, gates=[2, 4])
    ids = _ids()
    states, final, kv = m.slow_pass(ids)
    # whole sequences (training path): equal up to float rounding of a longer softmax
    for fast, gate in zip(m.fast_states(states, kv), m.config.gates):
        np.testing.assert_allclose(np.array(fast), np.array(states[gate]), atol=2e-5, rtol=1e-5)
    # the base model's own logits come out of the slow pass unchanged
    np.testing.assert_allclose(np.array(m.parts.head(final)), np.array(lm.model(ids)), atol=1e-5)
    # decode time: one new token over a cached prefix, exactly the slow layers' result
    cache = make_prompt_cache(lm.model)
    lm.model(ids[:, :-1], cache=cache)
    h = m.parts.embed(ids[:, -1:])
    fast = m.fast_exit_state(h, 0, cache)
    slow = m.parts.run_layers(h, 0, 2, None, cache)  # writes the token's K/V, as the base would
    assert mx.array_equal(fast, slow).item()


@pytest.mark.parametrize("arch,context", [("llama", False), ("olmoe", False), ("llama", True)])
def test_training_path_equals_decode_path(arch, context):
    """Teacher-forced whole-sequence fast states match token-by-token decode over the shared cache, on the
    early-exit path (fast_exit_state) and the drafter's (draft_state); with a context feature the first
    interval reads the previous position's final residual in both."""
    lm = tiny_model(arch)
    m = new_m2r2(lm, gates=[2, 5])
    if context:
        add_context_feature(m)
    _randomize(m)
    ids = _ids(T=8, B=1)
    states, final, kv = m.slow_pass(ids)
    fast = m.fast_states(states, kv)
    for t in (0, 3, 7):
        cache = make_prompt_cache(lm.model)
        if t:
            lm.model(ids[:, :t], cache=cache)
        h_prev = final[:, t - 1 : t] if t else None  # a row's first position has none: zeros in training
        for j, (start, _stop) in enumerate(m.config.intervals()):
            h_start = states[start][:, t : t + 1]
            got = m.fast_exit_state(h_start, j, cache, h_prev=h_prev)
            np.testing.assert_allclose(np.array(got[:, 0]), np.array(fast[j][:, t]), atol=1e-4, rtol=1e-4)
        drafted = m.draft_state(ids[0, t], 0, cache, h_prev=h_prev)  # writes provisional K/V: checked last
        np.testing.assert_allclose(np.array(drafted), np.array(fast[0][0, t]), atol=1e-4, rtol=1e-4)


def test_fast_stream_owns_no_kv_cache():
    lm = tiny_model("llama")
    m = new_m2r2(lm, gates=[3])
    _randomize(m)
    ids = _ids(T=6, B=1)
    cache = make_prompt_cache(lm.model)
    lm.model(ids, cache=cache)
    before = [(c.offset, np.array(c.keys[..., : c.offset, :]), c.keys.shape) for c in cache]
    m.fast_exit_state(m.parts.embed(ids[:, -1:]), 0, cache)
    after = [(c.offset, np.array(c.keys[..., : c.offset, :]), c.keys.shape) for c in cache]
    for (o1, k1, s1), (o2, k2, s2) in zip(before, after):
        assert o1 == o2 and s1 == s2 and np.array_equal(k1, k2)
    # the only parameters are the adapters
    assert all(name.startswith("adapters.") for name, _ in tree_flatten(m.parameters()))


def test_save_load_roundtrip_and_refusals(tmp_path):
    lm = tiny_model("llama")
    m = new_m2r2(lm, gates=[2, 4], rank=8)
    _randomize(m)
    out = save_adapters(m, tmp_path / "ad")
    assert {p.name for p in out.iterdir()} == {"adapters.safetensors", "m2r2_config.json", "complete.json"}
    again = load_adapters(lm, out)
    assert again.config == m.config
    for (n1, p1), (n2, p2) in zip(tree_flatten(m.parameters()), tree_flatten(again.parameters())):
        assert n1 == n2 and mx.array_equal(p1, p2).item()
    with pytest.raises(M2R2Error, match="already exists"):
        save_adapters(m, out)
    # adapters made for another base are refused
    with pytest.raises(M2R2Error, match="were made for base"):
        load_adapters(tiny_model("qwen2"), out)
    with pytest.raises(M2R2Error, match="were made for base"):
        load_adapters(tiny_model("llama", hidden_size=32, num_attention_heads=2), out)
    # a truncated weight file is named
    data = (out / "adapters.safetensors").read_bytes()
    (out / "adapters.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(M2R2Error, match="truncated"):
        load_adapters(lm, out)


def test_bad_gates_are_refused():
    lm = tiny_model("llama")
    for gates in ([0, 3], [4, 2], [6], []):
        with pytest.raises(M2R2Error, match="gates"):
            new_m2r2(lm, gates=gates)


def test_short_training_lowers_the_loss():
    from m2r2_mlx.training.trainer import Trainer

    lm = tiny_model("llama", seed=4)
    m = new_m2r2(lm, gates=[2, 4], rank=16)
    trainer = Trainer(m, lr=3e-3, steps=40)
    ids = _ids(T=16, B=4, seed=5)
    held_out = _ids(T=16, B=4, seed=6)
    before = trainer.eval_loss(ids), trainer.eval_loss(held_out)
    for _ in range(40):
        trainer.step(ids)
    after = trainer.eval_loss(ids), trainer.eval_loss(held_out)
    assert after[0] < 0.5 * before[0]
    assert after[1] < before[1]
    # the base model is untouched
    assert all(name.startswith("adapters.") for name, _ in tree_flatten(m.trainable_parameters()))


def test_loss_on_scored_positions_is_the_loss_over_those_positions():
    """Scoring the first half of every row equals the loss of the rows cut in half: a fast-stream position sees
    only earlier ones, and the teacher's vocabulary subset is taken over the scored positions alone."""
    from m2r2_mlx.training.trainer import Trainer

    lm = tiny_model("llama", seed=4)
    m = new_m2r2(lm, gates=[2, 4], rank=16)
    trainer = Trainer(m, lr=3e-3, steps=4)
    for _ in range(3):  # adapters away from zero
        trainer.step(_ids(T=16, B=4, seed=5))
    ids = _ids(T=16, B=3, seed=7)
    first_half = mx.array(np.flatnonzero(np.arange(16)[None, :].repeat(3, 0) < 8))
    assert trainer.eval_loss(ids, first_half) == pytest.approx(trainer.eval_loss(ids[:, :8]), rel=1e-5)
    everything = mx.arange(3 * 16)
    assert trainer.eval_loss(ids, everything) == pytest.approx(trainer.eval_loss(ids), rel=1e-6)
    assert trainer.eval_loss(ids, first_half) != pytest.approx(trainer.eval_loss(ids), rel=1e-3)


def test_answer_agreement_scores_only_answer_positions():
    from m2r2_mlx.training.evaluate import agreement, answer_agreement

    lm = tiny_model("llama")
    m = new_m2r2(lm, gates=[2, 4])
    _randomize(m)
    toks = _ids(T=12, B=1)[0].tolist()
    r = answer_agreement(m, [(toks, 5)])
    assert r["tokens"] == 12 - 5  # positions 4..10 predict the answer tokens 5..11
    assert r == agreement(m, [(mx.array(toks)[None], slice(4, 11))])


def test_gate_agreement_under_a_mask_scores_the_masked_positions_alone():
    from m2r2_mlx.training.evaluate import gate_agreement

    lm = tiny_model("llama")
    m = new_m2r2(lm, gates=[2, 4])
    _randomize(m)
    rows = np.array(_ids(T=12, B=6, seed=8))
    mask = np.zeros(rows.shape, dtype=bool)
    mask[[1, 4]] = True  # two whole rows, in different batches of 4
    r = gate_agreement(m, rows, mask=mask)
    alone = gate_agreement(m, rows[[1, 4]])
    assert r["tokens"] == 72 and r["scored"]["tokens"] == 24
    assert r["scored"]["fast"] == pytest.approx(alone["fast"]) and r["scored"]["layerskip"] == pytest.approx(
        alone["layerskip"]
    )
    assert "scored" not in gate_agreement(m, rows)


def test_perfect_exit_rule_bound():
    """The bound on any exit rule: with one gate it is that gate's agreement times what an exit there saves;
    a deeper gate only adds; with every token allowed to be wrong, all leave at the first gate."""
    from m2r2_mlx.training.evaluate import answer_agreement, oracle_exit_saving

    lm = tiny_model("llama")
    one, both = new_m2r2(lm, gates=[2]), new_m2r2(lm, gates=[2, 3])
    _randomize(both)
    one.update({"adapters": both.parameters()["adapters"][:2]})  # the same first interval
    seqs = [(_ids(T=12, B=1, seed=s)[0].tolist(), 4) for s in (1, 2)]
    agree = answer_agreement(one, seqs)["fast"][0]
    assert 0 < agree < 1  # a non-trivial case
    L = one.parts.num_layers
    assert oracle_exit_saving(one, seqs) == pytest.approx(agree * (1 - 2 / L))
    assert oracle_exit_saving(both, seqs) > oracle_exit_saving(one, seqs)  # gate 3 saves the tokens gate 2 got wrong
    assert oracle_exit_saving(both, seqs, slack=0.2) > oracle_exit_saving(both, seqs)
    assert oracle_exit_saving(both, seqs, slack=1.0) == pytest.approx(1 - 2 / L)


def test_per_interval_ranks_widen_and_round_trip(tmp_path):
    """One rank per gate interval; widening keeps what trained adapters compute and saves/loads."""
    from m2r2_mlx.core.adapters import widen_adapters

    lm = tiny_model("llama")
    m = new_m2r2(lm, gates=[2, 4], rank=4)
    _randomize(m)
    wide = widen_adapters(m, [12, 4])
    assert [a.down.weight.shape[0] for a in wide.adapters] == [12, 12, 4, 4]
    assert wide.config.layer_ranks() == [12, 12, 4, 4]
    states, _, kv = m.slow_pass(_ids())
    for a, b in zip(m.fast_states(states, kv), wide.fast_states(states, kv)):
        assert mx.allclose(a, b, atol=1e-5).item()
    # the new rows are drawn, not zero (they must be able to learn), and drawn the same each time
    assert mx.abs(wide.adapters[0].down.weight[4:]).sum().item() > 0
    assert mx.array_equal(widen_adapters(m, [12, 4]).adapters[0].down.weight, wide.adapters[0].down.weight).item()
    again = load_adapters(lm, save_adapters(wide, tmp_path / "wide"))
    assert again.config.adapter_rank == [12, 4]
    assert mx.array_equal(again.adapters[1].up.weight, wide.adapters[1].up.weight).item()
    # only one gate's interval runs when asked
    assert [f.shape for f in wide.fast_states(states, kv, [1])] == [(2, 9, 64)]
    with pytest.raises(M2R2Error, match="narrower"):
        widen_adapters(wide, [4, 4])
    for bad in ([8], [8, 8, 8], [0, 4]):
        with pytest.raises(M2R2Error, match="rank"):
            new_m2r2(lm, gates=[2, 4], rank=bad)


def test_train_gates_leaves_the_other_intervals_alone():
    from m2r2_mlx.training.config import train_gate_indices
    from m2r2_mlx.training.trainer import Trainer

    lm = tiny_model("llama", seed=4)
    m = new_m2r2(lm, gates=[2, 4], rank=8)
    _randomize(m)
    before = {n: np.array(p) for n, p in tree_flatten(m.parameters())}
    trainer = Trainer(m, lr=3e-3, steps=5, gate_indices=train_gate_indices(m.config, [4]))
    for _ in range(5):
        trainer.step(_ids(T=16, B=4, seed=5))
    after = dict(tree_flatten(m.parameters()))
    changed = {n.split(".")[1] for n, p in after.items() if not np.array_equal(before[n], np.array(p))}
    assert changed == {"2", "3"}  # layers 2-3 serve the gate at 4; layers 0-1 (gate 2) did not move
    with pytest.raises(M2R2Error, match="must name gates"):
        train_gate_indices(m.config, [3])
