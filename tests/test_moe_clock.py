"""The MoE device clock (m2r2_mlx/moe/clock.py): its arithmetic on hand-made traces, Belady's optimality on a small
trace, the prediction-aware eviction rule, and the bench's device figures reproducing themselves exactly."""

import itertools
import json

from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.moe import ExpertStore, PrefetchPlanner, insitu, offload_experts
from m2r2_mlx.moe.blocks import moe_blocks
from m2r2_mlx.moe.clock import DeviceClock
from m2r2_mlx.moe.lookahead import (
    LookaheadAdapterPredictor,
    LookaheadAdapters,
    LookaheadFit,
    record_routes,
    train_lookahead,
)
from m2r2_mlx.moe.metering import Metering, metered
from m2r2_mlx.moe.profiles import PROFILES

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from m2r2_bench.moe_controls import FutureRoutes
from m2r2_bench.moe_rows import greedy
from tests.test_moe_ahead_of_time import PROMPT, _tiny_olmoe_folder
from tests.tiny import tiny_model

from .inprocess import run_main

T_LINK = 1e-4 + 1e6 / 1e8  # one 1 MB transfer: latency + bytes over the link's bandwidth


def clock() -> DeviceClock:
    return DeviceClock(bandwidth=1e9, flops=1e12, launch=1e-6, sync=1e-5, link_bandwidth=1e8, link_latency=1e-4)


def test_ops_transfers_and_waits_add_up_as_the_model_says():
    c = clock()
    c.op(1e6, 1e3)  # memory-bound: 1 ms + launch
    assert c.now() == pytest.approx(1e-3 + 1e-6)
    c.op(0, 1e10)  # compute-bound: 10 ms + launch
    assert c.now() == pytest.approx(11e-3 + 2e-6)
    c.sync()
    t0 = c.now()
    assert t0 == pytest.approx(11e-3 + 2e-6 + 1e-5)
    first = c.transfer(1e6)
    second = c.transfer(1e6)  # one channel: queued behind the first
    assert (first, second) == (pytest.approx(t0 + T_LINK), pytest.approx(t0 + 2 * T_LINK))
    assert c.now() == t0  # transfers do not hold the compute stream
    c.op(15e6)  # 15 ms of compute hides the first transfer, not the second
    assert c.wait(first) == 0.0
    assert c.wait(second) == pytest.approx(t0 + 2 * T_LINK - (t0 + 15e-3 + 1e-6))
    late = c.transfer(1e6, issued=t0)  # issued in the past: it still waits for the channel
    assert late == pytest.approx(second + T_LINK)
    assert c.wait(late) == pytest.approx(T_LINK) and c.now() == pytest.approx(late)
    assert c.stalled == pytest.approx(late - (t0 + 15e-3 + 1e-6))
    assert c.link_busy == pytest.approx(3 * T_LINK)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return ExpertStore.export(tiny_model("olmoe").model, tmp_path_factory.mktemp("store") / "experts")


def device_cache(store, budget=0.25, **cache):
    """A cache on the device clock() in which every expert moves 1 MB."""
    c = clock()
    nbytes = store.expert_bytes(0)
    built = offload_experts(tiny_model("olmoe").model, store, budget, clock=c, device_scale=1e6 / nbytes, **cache)
    return built, c, nbytes


def test_prefetches_arrive_in_order_and_a_late_one_stalls_exactly_until_it_lands(store):
    cache, c, nbytes = device_cache(store)
    land = c.op_seconds(2e6, 0)  # an arrived expert's copy into its slot
    x = mx.zeros((1, 64))
    cache.begin_layer(0, x, [0])
    cache.prefetch(1, [5, 6])  # layer 1 at this step: queued at t0, 5 then 6
    t0 = c.now()
    c.op(1.5 * T_LINK * 1e9)  # compute for 1.5 transfers
    assert c.now() == pytest.approx(t0 + 1e-6 + 1.5 * T_LINK)
    cache.begin_layer(1, x, [5, 6])
    before = c.now()
    cache.ensure(1, [5])  # 5 arrived at t0 + T; 6 (due at t0 + 2T) is not needed yet
    assert cache.is_resident(1, 5) and not cache.is_resident(1, 6)
    assert c.now() == pytest.approx(before + land)  # no wait: only the landing copy
    before = c.now()
    cache.ensure(1, [6])  # waits for its arrival, then lands it
    assert c.now() == pytest.approx(t0 + 2 * T_LINK + land)
    st = cache.stats.layer(1)
    assert (st.late_prefetches, st.prefetch_hits, st.misses) == (1, 2, 0)
    assert cache.stats.stall_s == pytest.approx(c.now() - before + land)
    before = c.now()
    cache.ensure(1, [7])  # on demand: the channel is idle, so one transfer and its landing
    assert c.now() == pytest.approx(before + T_LINK + land) and cache.stats.layer(1).misses == 1
    assert cache.loader.reads == 3 and c.link_busy == pytest.approx(3 * T_LINK)


def test_a_load_on_demand_goes_ahead_and_an_unneeded_queued_prefetch_is_cancelled_unread(store):
    cache, c, _ = device_cache(store)
    land = c.op_seconds(2e6, 0)
    x = mx.zeros((1, 64))
    cache.begin_layer(0, x, [0])
    t0 = c.now()
    cache.prefetch(0, [2, 3], step=cache.step + 1)  # the next step's layer 0: 2 on the channel now, 3 queued
    cache.prefetch(1, [6, 7])  # queued behind them
    cache.begin_layer(1, x, [7])  # the pass reaches layer 1 needing 7, not 6: 6 is cancelled while queued
    assert cache.stats.prefetch_dropped == 1 and not cache.in_flight(1, 6) and cache.in_flight(1, 7)
    cache.ensure(1, [7])  # 7 goes on the channel next, ahead of the prefetch of 3 queued before it
    # it arrives at t0 + 2T, then lands with 2 (arrived at t0 + T); 3 is on the channel until t0 + 3T
    assert c.now() == pytest.approx(t0 + 2 * T_LINK + 2 * land) and cache.stats.layer(1).late_prefetches == 1
    assert c.link_free == pytest.approx(t0 + 3 * T_LINK)
    c.op(5 * T_LINK * 1e9)
    cache.begin_layer(2, x, [0])
    cache.ensure(2, [0])
    assert cache.loader.reads == 3 and cache.loader.cancelled == 1  # 2, 7 and 3: never 6


def misses(cache, routes) -> int:
    x = mx.zeros((1, 64))
    for step in range(max(s for s, _ in routes) + 1):
        cache.begin_layer(0, x, routes[(step, 0)])
        cache.ensure(0, routes[(step, 0)])
    return cache.stats.layer(0).misses


def optimum(resident: list[int], slots: int, routes) -> int:
    """The fewest misses any eviction choices give (exhaustive search)."""
    best = {frozenset(resident): 0}
    for step in range(max(s for s, _ in routes) + 1):
        need, nxt = routes[(step, 0)], {}
        for held, n in best.items():
            missing = [e for e in need if e not in held]
            keep = [e for e in held if e not in need]
            room = slots - len(need)
            for kept in itertools.combinations(keep, min(room, len(keep))):
                state = frozenset(kept) | frozenset(need)
                nxt[state] = min(nxt.get(state, 1 << 30), n + len(missing))
        best = nxt
    return min(best.values())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_belady_makes_the_fewest_misses_any_eviction_can(store, seed):
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(8, 0.5))  # skewed routing, as a real router's
    routes = {(s, 0): sorted(rng.choice(8, size=2, replace=False, p=weights).tolist()) for s in range(14)}
    counts = {}
    for policy in ("lru", "belady"):
        future = FutureRoutes()
        cache, _, _ = device_cache(store, 0.5, policy=future.policy if policy == "belady" else "lru")  # 4 of 8: 0-3
        future.follow(cache)
        future.set(routes)
        cache.reset()
        counts[policy] = misses(cache, routes)
    assert counts["belady"] == optimum([0, 1, 2, 3], 4, routes) <= counts["lru"]


def test_a_load_on_demand_never_evicts_a_predicted_expert_while_an_unpredicted_one_is_resident(store):
    cache, _, _ = device_cache(store, 0.25, planner=PrefetchPlanner())  # 2 slots holding 0 and 1; 0 the least recent
    cache.tokens_now = 1
    cache.prefetch(0, [0], step=cache.step + 1)  # predicted (resident: no load)
    cache.ensure(0, [5])
    assert cache.resident(0) == [0, 5]  # LRU alone would have evicted 0
    scores = np.full(8, 0.01)
    scores[0], scores[5] = 0.9, 0.3
    cache.prefetch(0, [0, 5], step=cache.step + 1, scores=scores)  # both named now: the less likely goes first
    cache.ensure(0, [7])
    assert cache.resident(0) == [0, 7]


def test_metering_charges_each_projection_at_the_device_bytes_per_weight():
    model = tiny_model("olmoe").model
    weights = sum(v.size for k, v in tree_flatten(model.parameters()) if "weight" in k)
    charged = {}
    for name, wb in (("as held", None), ("4-bit", 0.5625)):
        c = DeviceClock(bandwidth=1e9, flops=1e18, launch=0, sync=0, link_bandwidth=1, link_latency=0)
        with metered(c, Metering(weight_bytes=wb, other_kernels=0), model):
            mx.eval(model(mx.array([[3, 17]])))
        charged[name] = c.now() * 1e9  # bytes: 1 GB/s and free FLOPs
    assert 0 < charged["4-bit"] < charged["as held"] / 4 < weights * 1.1


def test_every_profile_builds_a_clock_and_the_device_ones_keep_their_ratio():
    for p in PROFILES.values():
        assert p.clock().now() == 0.0
    assert PROFILES["here"].ratio is None
    assert 2.0 < PROFILES["macbook"].ratio < 2.6 and 2.5 < PROFILES["pcie-gpu"].ratio < 3.0


@pytest.mark.slow
def test_the_device_clock_reproduces_itself_exactly(tmp_path):
    model = _tiny_olmoe_folder(tmp_path)
    results = []
    for run in ("a", "b"):
        out = tmp_path / run
        cmd = ["--moe", "--model", str(model), "--adapters", str(tmp_path / "adapters")]
        cmd += ["--prompts", str(tmp_path / "eval.npy"), "--budgets", "50,25", "--num-prompts", "2"]
        cmd += ["--prompt-tokens", "8", "--max-tokens", "6", "--profile", "macbook"]
        cmd += ["--methods", "lru,pregating-planned,fast-fused,oracle", "--out", str(out)]
        r = run_main("m2r2_bench.specbench", *cmd)
        assert r.returncode == 0, r.stderr[-2000:]
        run, *rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
        assert run["run"]["clock"] == "device"
        results.append(rows)
    keys = ("tokens_per_s", "stall_ms_per_token", "hit_rate", "loads_per_token")
    figures = [[tuple(row.get(k) for k in keys) for row in rows] for rows in results]
    assert figures[0] == figures[1]
    assert all(row["tokens_per_s"] > 0 and row["same_as_resident"] for row in results[0])


def test_lookahead_adapters_round_trip_and_predict_across_the_token_boundary(tmp_path):
    lm = tiny_model("olmoe")
    rng = np.random.default_rng(0)
    vocab = lm.config["vocab_size"]
    ids, held = rng.integers(0, vocab, 1024), rng.integers(0, vocab, 512)
    with pytest.raises(M2R2Error, match="outside the model's vocabulary of 101"):
        train_lookahead(lm, ids, held + vocab, LookaheadFit(lead=2, seq_len=32), progress=False)
    adapters, record = train_lookahead(lm, ids, held, LookaheadFit(lead=2, seq_len=32), progress=False)
    assert 0 <= record["recall_adapters"] <= 1 and record["lead"] == 2
    assert adapters.sources(0)[0] == (len(adapters.layers) - 2, -1) and adapters.sources(3)[0] == (1, 0)
    adapters.save(tmp_path, record)
    again = LookaheadAdapters.load(tmp_path)
    saved, loaded = tree_flatten(adapters.parameters()), tree_flatten(again.parameters())
    assert [k for k, _ in saved] == [k for k, _ in loaded]
    assert all(np.array_equal(np.array(a), np.array(b)) for (_, a), (_, b) in zip(saved, loaded))
    (tmp_path / "lookahead.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(M2R2Error, match="damaged or not lookahead adapters"):
        LookaheadAdapters.load(tmp_path)

    model = tiny_model("olmoe").model
    reference = greedy(model, PROMPT, 10)[0]
    store = ExpertStore.export(model, tmp_path / "experts")
    model = tiny_model("olmoe").model
    cache = offload_experts(model, store, 0.5)
    seen = []
    cache.prefetch = lambda layer, experts, step=None, scores=None: seen.append((cache.step, step, layer))
    LookaheadAdapterPredictor(again).attach(cache)
    assert greedy(model, PROMPT, 10)[0] == reference
    last = len(cache.layers) - 1
    assert any(s == now + 1 and layer == cache.layers[0] for now, s, layer in seen)  # the next token's first layer
    assert last >= 2 and len(seen) == 9 * len(cache.layers)  # one target a layer at each of the 9 decode steps


def test_an_op_kind_can_carry_its_own_fixed_cost_and_bandwidth_share():
    c = DeviceClock(
        bandwidth=1e9,
        flops=1e12,
        launch=1e-6,
        sync=0,
        link_bandwidth=1,
        link_latency=0,
        fixed={"rope": 1e-4},
        shares={"gather": 0.5},
    )
    assert c.op_seconds(0, 0, "rope") == pytest.approx(1e-4)
    assert c.op_seconds(1e6, 0, "gather") == pytest.approx(1e-6 + 2e-3)
    assert c.op_seconds(1e6, 0, "matmul") == pytest.approx(1e-6 + 1e-3)


def test_a_projection_is_charged_as_a_matmul():
    c = DeviceClock(
        bandwidth=1e18, flops=1e18, launch=0, sync=0, link_bandwidth=1, link_latency=0, fixed={"matmul": 1e-3}
    )
    model = nn.Sequential(nn.Linear(8, 8))
    with metered(c, Metering(other_kernels=0), model):
        mx.eval(model(mx.zeros((1, 8))))
    assert c.now() == pytest.approx(1e-3)


def test_the_in_situ_fit_recovers_a_known_machines_terms():
    """Ops timed on a machine with known terms (6 GB/s, 4 us a matmul, gathers at half the bandwidth, attention
    90 us beyond its bytes), timed alone at 1.25x what the running decode takes: the fit returns the running terms."""
    bandwidth, fixed, launch, alone = 6e9, 4e-6, 10e-6, 1.25
    running = [("matmul", b, fixed + b / bandwidth) for b in (4.4e4, 4.4e5, 1.3e6, 1.1e8) for _ in range(3)]
    running += [("gather", b, fixed + b / (0.5 * bandwidth)) for b in (2.2e5, 4.4e5)]
    running += [("attention", 3e4, 90e-6 + 3e4 / bandwidth)]
    untimed = 40
    steps = [sum(t for *_, t in running) + untimed * launch] * 3
    samples = [(k, b, alone * t) for k, b, t in running] * 3  # three steps' worth, every op timed alone
    f = insitu.fit_cpu(samples, steps, len(running) + untimed, launch)
    assert f["memory_gbps"] == pytest.approx(6.0, rel=1e-6)
    assert f["matmul_us"] == pytest.approx(4.0, rel=1e-4) and f["gather_share"] == pytest.approx(0.5, rel=1e-4)
    assert f["attention_us"] == pytest.approx(90.0, rel=1e-4) and f["alone_vs_running"] == pytest.approx(alone)


@pytest.mark.slow
def test_the_bench_measures_this_machines_profile_when_asked(tmp_path):
    model = _tiny_olmoe_folder(tmp_path)
    cmd = ["--moe", "--model", str(model), "--adapters", str(tmp_path / "adapters")]
    cmd += ["--prompts", str(tmp_path / "eval.npy"), "--budgets", "50", "--num-prompts", "2", "--prompt-tokens", "8"]
    cmd += ["--max-tokens", "6", "--clock", "device", "--methods", "resident,lru", "--out", str(tmp_path / "out")]
    r = run_main("m2r2_bench.specbench", *cmd)
    assert r.returncode == 0, r.stderr[-2000:]
    run, *rows = [json.loads(line) for line in (tmp_path / "out" / "rows.jsonl").read_text().splitlines()]
    profile = run["run"]["device_profile"]
    assert profile["name"] == "here" and profile["memory_gbps"] > 0 and dict(profile["fixed_us"])["load"] >= 0
    assert profile["link_gbps"] > 0 and all(row["tokens_per_s"] > 0 for row in rows)


def test_a_lookahead_predictor_reads_the_sources_it_was_fitted_on(tmp_path):
    """In a decode, each prediction equals the adapters applied to the teacher-forced router inputs of its source
    layers (this token's and the previous token's), as training pairs them."""
    lm = tiny_model("olmoe")
    vocab = lm.config["vocab_size"]
    ids, held = (np.random.default_rng(1).integers(0, vocab, n) for n in (1024, 256))
    adapters, _ = train_lookahead(lm, ids, held, LookaheadFit(lead=1, depth=3, seq_len=32), progress=False)
    assert adapters.sources(1) == [(0, 0), (len(adapters.layers) - 1, -1), (len(adapters.layers) - 2, -1)]
    model = tiny_model("olmoe").model
    store = ExpertStore.export(model, tmp_path / "experts")
    cache = offload_experts(model, store, 0.5)
    seen = []
    cache.prefetch = lambda layer, experts, step=None, scores=None: seen.append((step, layer, scores))
    LookaheadAdapterPredictor(adapters).attach(cache)
    out = greedy(model, PROMPT, 10)[0]
    fed = np.concatenate([PROMPT, out[:-1]])
    model_ref = tiny_model("olmoe").model
    blocks = dict(moe_blocks(model_ref))
    routed = record_routes(model_ref, blocks, fed[None].astype(np.int32))
    first = min(step for step, _, _ in seen)  # the first decode step's own layers are predicted within it
    checked = 0
    for step, layer, scores in seen:
        position = len(PROMPT) + step - first
        if position >= len(fed):
            continue  # the token after the last one fed
        layers = adapters.layers
        x = np.concatenate(
            [routed[layers[o]][0][0, position + offset] for o, offset in adapters.sources(layers.index(layer))]
        )
        want = mx.softmax(adapters(layer, mx.array(x[None])), axis=-1)
        assert np.allclose(scores, np.array(want)[0], atol=1e-4), (step, layer)
        checked += 1
    assert checked >= 8 * len(adapters.layers)


def test_lookahead_sources_reach_back_one_token_at_most():
    adapters = LookaheadAdapters([0, 1, 2, 3], 8, 4, lead=2, depth=3)
    assert adapters.sources(0) == [(2, -1), (1, -1), (0, -1)] and adapters.sources(3) == [(1, 0), (0, 0), (3, -1)]
    with pytest.raises(M2R2Error, match="at most 4 MoE layers"):
        LookaheadAdapters([0, 1, 2, 3], 8, 4, lead=2, depth=4)
