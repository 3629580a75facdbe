"""The MoEfied SmolLM2 (m2r2_tools.moefy) on a real slice: its first 4 layers cut into 8 experts, top-2.

It loads through mlx-lm's own loader by model_type; with every expert chosen it is the dense slice;
its experts offload to an expert store and cache, and decoding within a budget, with any predictor
(the fused-row M2R2 one included), gives the all-resident model's tokens. Bad input is one line.
"""

import json
import shutil
from pathlib import Path

from m2r2_mlx.core.adapters import new_m2r2
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.models.moefied_llama import ModelArgs, MoefiedMLP
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.moe import ExpertStore, PrefetchPlanner, moe_blocks, offload_experts
from m2r2_mlx.moe.fused_predictor import prediction_plan
from m2r2_mlx.moe.metering import metered
from m2r2_mlx.moe.planner import PlannerConfig
from m2r2_mlx.moe.predictors import PREDICTORS, PredictorInputs
from m2r2_mlx.moe.profiles import PROFILES, get_profile
from m2r2_mlx.moe.serve import offload_with_predictor

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm import load as mlx_lm_load

from m2r2_bench.moe_controls import Oracle, ShuffledControl
from m2r2_bench.moe_rows import greedy
from m2r2_tools.moefy_layers import balanced_kmeans, layer_pass, moefy_layer

from .inprocess import run_main

LAYERS, EXPERTS, TOP_K = 4, 8, 2
QUESTIONS = Path(__file__).parents[1] / "bench" / "data" / "question.jsonl"  # Spec-Bench's, shipped with the bench


def corpus(folder: Path) -> Path:
    """A fixed corpus a fresh clone always has: Spec-Bench's question turns as paragraphs (real English prose and
    code). Fixed, so that the slice's routers and held-out text do not move when the docs change."""
    turns = [t for line in QUESTIONS.read_text().splitlines() for t in json.loads(line)["turns"]]
    path = folder / "corpus.txt"
    path.write_text("\n\n".join(t.strip() for t in turns if t.strip()))
    return path


def _moefy(*args, check=True):
    r = run_main("m2r2_tools.moefy", *args)
    if check:
        assert r.returncode == 0, r.stderr[-2000:]
    return r


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("moefy") / "smollm2-moe-slice"
    text = corpus(out.parent)
    _moefy(
        "-o",
        str(out),
        "--layers",
        str(LAYERS),
        "--experts",
        str(EXPERTS),
        "--top-k",
        str(TOP_K),
        "--tokens",
        "2048",
        "--heldout-tokens",
        "512",
        "--router-steps",
        "60",
        "--text",
        str(text),
    )
    return out


@pytest.fixture(scope="module")
def store(folder, tmp_path_factory):
    return ExpertStore.export(load_model(str(folder), tokenizer=False).model, tmp_path_factory.mktemp("s") / "x")


@pytest.fixture(scope="module")
def prompt(folder):
    return np.load(folder / "heldout.npy")[:24]


@pytest.mark.slow
def test_folder_loads_with_mlx_lm_and_routes_top_k(folder):
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "moefied_llama" and cfg["num_hidden_layers"] == LAYERS
    model, tokenizer = mlx_lm_load(str(folder))  # mlx-lm's own loader, by model_type
    blocks = moe_blocks(model)
    assert [i for i, _ in blocks] == list(range(LAYERS))
    assert all(
        b.top_k == TOP_K and b.switch_mlp.gate_proj.weight.shape == (EXPERTS, 1536 // EXPERTS, 576) for _, b in blocks
    )
    assert tokenizer.encode("Hello") == load_model("smollm2").tokenizer.encode("Hello")
    record = json.loads((folder / "moefy.json").read_text())
    q = record["quality"]
    # a real split: worse than the dense slice, yet the router beats chance at finding the heaviest groups
    assert q["moe_ppl"] > q["dense_ppl"] and 0 < q["greedy_agreement"] < 1
    assert all(layer["router_recall_of_top_groups"] > TOP_K / EXPERTS for layer in record["layers"])


@pytest.mark.slow
def test_every_expert_chosen_is_the_dense_ffn(prompt):
    """Grouping and routing only partition the FFN: with all experts chosen (and the dense down projections,
    --no-refit) the block computes the dense FFN."""
    lm = load_model("smollm2", tokenizer=False)
    layer = lm.model.model.layers[2]
    _, x, mass = layer_pass(layer, lm.model.model.embed_tokens(mx.array(prompt[None].astype(np.int32))), 1)
    weights, stats, _ = moefy_layer(layer, x, mass, EXPERTS, EXPERTS, router_steps=5, cluster_tokens=64, seed=0)
    block = MoefiedMLP(ModelArgs.from_dict({**lm.config, "num_experts": EXPERTS, "num_experts_per_tok": EXPERTS}))
    block.load_weights(list(weights.items()))
    a, b = block(mx.array(x)), layer.mlp(mx.array(x))
    assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item(), float(mx.abs(a - b).max())
    assert stats["router_mass"] == pytest.approx(1.0) and stats["oracle_mass"] == pytest.approx(1.0)


def test_balanced_kmeans_groups_coactivating_rows_equally():
    rng = np.random.default_rng(0)
    base = rng.normal(size=(4, 64))
    rows = np.repeat(base, 8, axis=0) + 0.01 * rng.normal(size=(32, 64))  # 4 true groups of 8
    assign = balanced_kmeans(rows, 4)
    assert np.bincount(assign).tolist() == [8, 8, 8, 8]
    assert all(len(set(assign[g * 8 : (g + 1) * 8])) == 1 for g in range(4))


def _m2r2(lm):
    m = new_m2r2(lm, gates=[1, 2, 3], rank=8)
    mx.random.seed(1)  # nonzero adapters: the fast row really differs from the slow one
    m.update(tree_map(lambda p: 0.1 * mx.random.normal(p.shape), m.parameters()))
    return m


@pytest.mark.slow
@pytest.mark.parametrize("method", ["none", "pregating", "fast", "fast-fused"])
def test_budgeted_decoding_gives_the_resident_tokens(folder, store, prompt, method):
    reference, _ = greedy(load_model(str(folder), tokenizer=False).model, prompt, 10)
    lm = load_model(str(folder), tokenizer=False)
    inputs = PredictorInputs(m2r2=_m2r2(lm) if method.startswith("fast") else None)
    cache, predictor = offload_with_predictor(lm.model, store, 0.25, PREDICTORS[method], inputs)
    assert cache.slots_per_layer == {i: TOP_K for i in range(LAYERS)}
    if cache.planner is not None:
        cache.planner.governor = None  # every decode step predicts (the governor's own test is below)
    tokens, _ = greedy(lm.model, prompt, 10, on_prefilled=cache.reset)
    assert tokens == reference
    s = cache.stats
    assert s.steps == 9 and s.misses > 0
    if method == "fast-fused":
        # gates 1/2/3: the exit after layer 0 predicts layers 1-2, after layer 1 layer 3; layers 0-1 carry the fast row
        assert {l for l, st in s.layers.items() if st.predicted} == {1, 2, 3}
        assert all(s.layers[l].predicted == 9 * TOP_K for l in (1, 2, 3))
        assert predictor.fast_layer_passes == 2 * 9 and 0 < s.recall <= 1
        predictor.detach()
        assert all(type(layer).__name__ != "_FusedTap" for layer in lm.model.layers)
    cache.close()


def test_fused_prediction_plan_for_smollm2_gates():
    assert prediction_plan([(0, 1), (1, 2), (2, 3)], 4, [0, 1, 2, 3]) == {1: [1, 2], 2: [3]}
    # the packaged adapters' gates 6/12/18/24 on 30 layers: a whole interval of lead from the second exit on
    intervals = [(0, 6), (6, 12), (12, 18), (18, 24)]
    assert prediction_plan(intervals, 30, list(range(30))) == {
        6: list(range(6, 18)),
        12: list(range(18, 24)),
        18: list(range(24, 30)),
    }


@pytest.mark.slow
def test_bad_input_is_one_clear_line(folder, store, tmp_path):
    with pytest.raises(M2R2Error, match="minimum is 25.0%"):  # a budget below top-k
        offload_experts(load_model(str(folder), tokenizer=False).model, store, 0.2)
    with pytest.raises(M2R2Error, match="unknown device profile 'laptop'.*macbook"):
        get_profile("laptop")
    assert set(PROFILES) == {"macbook", "pcie-gpu", "here"}
    with pytest.raises(M2R2Error, match="no SwitchGLU mixture-of-experts"):  # a model without experts
        ExpertStore.export(load_model("smollm2", tokenizer=False).model, tmp_path / "dense")
    assert not (tmp_path / "dense").exists()

    damaged = tmp_path / "damaged"
    shutil.copytree(store.folder, damaged)
    layer_file = damaged / "layer_001.safetensors"
    data = bytearray(layer_file.read_bytes())
    data[-5] ^= 0xFF  # altered: same size, one expert's bytes changed
    layer_file.write_bytes(bytes(data))
    with pytest.raises(M2R2Error, match="fails its checksum"):
        ExpertStore.open(damaged).read(1, EXPERTS - 1)
    layer_file.write_bytes(bytes(data[:-100]))  # truncated
    with pytest.raises(M2R2Error, match="truncated or altered"):
        ExpertStore.open(damaged)

    for args, says in [
        (["--experts", "7"], "does not divide"),
        (["--top-k", "17"], "--top-k between"),
        ([], "already exists"),
        (["--text", str(tmp_path / "nope.txt")], "not found; check --text"),
    ]:
        out = folder if not args else tmp_path / "never"
        r = _moefy("-o", str(out), "--layers", "1", *args, check=False)
        assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-500:]
        assert len(r.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "never").exists()  # nothing half-written


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("m2r2-bench") is None, reason="package not installed (pip install -e .)")
def test_bench_unknown_profile_is_one_line():
    r = run_main("m2r2_bench.specbench", "--moe", "--profile", "laptop")
    assert r.returncode != 0 and "unknown device profile 'laptop'" in r.stderr and "pcie-gpu" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


MACBOOK = get_profile("macbook")


def _decode(folder, store, budget, predictor=None, planner=PlannerConfig(), trace=None, tokens=16, fixed=None):
    """(tokens, decode seconds, stats, planner decisions, the run's trace) at ``budget`` on the macbook profile's
    device clock (every time, the stall included, modelled: the figures are the same on every run; ``fixed``: op
    kinds' costs added to the profile's, for a test's own ops)."""
    lm = load_model(str(folder), tokenizer=False)
    clock = MACBOOK.clock()
    clock.fixed.update(fixed or {})
    scale = MACBOOK.device_scale(store.expert_weights(), store.expert_bytes())
    plan = PrefetchPlanner(planner) if planner else None
    cache = offload_experts(lm.model, store, budget, clock=clock, device_scale=scale, planner=plan)
    if predictor is not None:
        predictor.attach(cache)
    cache.trace = {} if trace else None
    pricing = MACBOOK.metering(store.expert_weights(), lm.model.args.hidden_size)
    with metered(clock, pricing, lm.model, *(predictor.own_modules() if predictor is not None else [])):
        prompt = np.load(folder / "heldout.npy")[:24]
        tokens, seconds = greedy(lm.model, prompt, tokens, on_prefilled=cache.reset, clock=clock)
    cache.close()
    return tokens, seconds, cache.stats, plan.decisions if plan else None, cache.trace


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.25, 0.375, 0.5])
def test_with_random_predictions_the_planner_is_lru_within_3_percent(folder, store, budget):
    """Random experts: the loader issues (almost) nothing, so the cache is LRU: same misses, same bytes read,
    decode time on the device clock within 4% of LRU's."""
    lru_tokens, lru_s, lru, _, _ = _decode(folder, store, budget, planner=None)
    tokens, seconds, s, decisions, _ = _decode(folder, store, budget, ShuffledControl(seed=0))
    assert tokens == lru_tokens
    loaded = decisions["loaded"]
    assert loaded <= max(3, 0.01 * decisions["considered"]) and s.total("prefetch_loads") == loaded
    # the hit rate is read at its mean, so a guess or two that happened to hit early may load before the counts
    # show chance: each such load may displace one expert that LRU kept
    assert abs(s.misses - lru.misses) <= 2 * loaded  # a displaced expert may be missed twice before it is back
    assert abs(s.bytes_moved - lru.bytes_moved) <= 3 * loaded * store.expert_bytes()
    assert lru_s / seconds >= 0.96  # 24 tokens: a guess that loaded is a read out of few


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.25, 0.375, 0.5])
def test_true_routes_planned_hide_most_of_lrus_loads(folder, store, budget):
    """The oracle (true routes, two layers ahead, into the next token's first layers) through the planner, on the
    macbook profile's device clock: loads move ahead of the pass, none wasted, no more of them than LRU makes; most
    of LRU's on-demand loads are gone and the decode is faster than LRU's. What is left: the first layer at 25%
    (2 slots, top-2: both hold the current token's experts, which a prefetch never evicts), the planner's first
    steps (its calibration starts at a 25% prior) and loads arriving late (two layers of lead)."""
    lru_tokens, lru_s, lru, _, trace = _decode(folder, store, budget, planner=None, trace=True)
    # the planner's choices with the predictor always running (whether it pays for itself: the governor's test)
    oracle = Oracle(trace, lookahead=2)
    tokens, seconds, s, decisions, _ = _decode(folder, store, budget, oracle, planner=PlannerConfig(governed=False))
    assert tokens == lru_tokens and decisions["loaded"] > 0 and s.total("prefetch_wasted") == 0
    assert s.misses + s.total("prefetch_loads") <= lru.misses
    assert s.misses <= 0.65 * lru.misses
    assert s.stall_s < lru.stall_s and seconds < lru_s, (seconds, lru_s, s.stall_s, lru.stall_s)


class CostlyOracle(Oracle):
    """True routes that cost ``burn_s`` of compute (an op of kind "burn" on the device clock) per layer it predicts
    from, governed as the other predictors are (the plain oracle, a bound, always predicts)."""

    def __init__(self, trace):
        super().__init__(trace, lookahead=2)
        self.calls = 0

    def on_layer(self, layer, x):
        if self.cache.planner.wants(layer):
            self.cache.clock.op(0, kind="burn")
            self.calls += 1
            super().on_layer(layer, x)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_a_predictor_that_costs_more_than_it_saves_is_turned_off(folder, store, budget):
    """True routes at 3 ms a layer (12 ms a step, against at most a few 1 ms reads saved): the governor measures
    the cost and the savings, stops predicting and probes within 2% of the time; decode time within 3% of LRU's."""
    lru_tokens, lru_s, lru, _, trace = _decode(folder, store, budget, planner=None, trace=True, tokens=160)
    oracle = CostlyOracle(trace)  # long enough a run that the calls which measure it are within its 2%
    tokens, seconds, s, _, _ = _decode(folder, store, budget, oracle, tokens=160, fixed={"burn": 3e-3})
    assert tokens == lru_tokens
    gov = oracle.cache.planner.governor.summary()
    assert gov["cost_ms"] > gov["savings_ms"] and gov["on"] <= 0.15 * (gov["on"] + gov["off"]), gov
    assert lru_s / seconds >= 0.97, (gov, oracle.calls, s.misses, lru.misses)
