"""The MoE expert cache on tiny random olmoe and mixtral models: exact outputs, budgets, integrity."""

import json
import os
import shutil

from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.moe import (
    CacheStats,
    ExpertStore,
    PreGating,
    make_policy,
    moe_blocks,
    offload_experts,
    parse_budget,
)
from m2r2_mlx.moe.__main__ import main as moe_cli

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from m2r2_bench.moe_controls import Oracle, ShuffledControl
from tests.tiny import tiny_model

PROMPT = list(range(3, 23))  # 20 tokens: the prompt needs more distinct experts than a 25% budget has slots
ARCHS = {"olmoe": {}, "mixtral": {"num_local_experts": 8}}  # 8 experts, top-2 in both


def greedy(model, prompt=PROMPT, n=10):
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)
    out = [int(mx.argmax(logits[0, -1]).item())]
    while len(out) < n:
        logits = model(mx.array([[out[-1]]]), cache=cache)
        out.append(int(mx.argmax(logits[0, -1]).item()))
    return out


def fresh(arch):
    return tiny_model(arch, **ARCHS[arch]).model


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """arch -> (store, greedy tokens of the all-resident model)."""
    out = {}
    for arch in ARCHS:
        model = fresh(arch)
        out[arch] = ExpertStore.export(model, tmp_path_factory.mktemp(arch) / "experts"), greedy(model)
    return out


def offloaded(arch, stores, budget, **kw):
    model = fresh(arch)
    return model, offload_experts(model, stores[arch][0], budget, **kw)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_tokens_identical_to_all_resident_at_every_budget(stores, arch, policy):
    reference = stores[arch][1]
    for budget, slots in [(1.0, 8), (0.5, 4), (0.25, 2)]:
        model, cache = offloaded(arch, stores, budget, policy=policy)
        assert set(cache.slots_per_layer.values()) == {slots}
        assert greedy(model) == reference, (budget, policy)
        # 100% is everything resident (no loads after the warm start); smaller budgets really load
        assert (cache.stats.misses == 0) == (budget == 1.0)
        assert cache.stats.hits > 0


def test_logits_equal_with_prompt_split_into_rounds(stores):
    x = mx.array([list(range(3, 83))])  # 80 tokens: 160 (token, expert) pairs take mlx-lm's sorted path
    reference = fresh("olmoe")(x)
    for budget in (1.0, 0.5, 0.25):
        model, cache = offloaded("olmoe", stores, budget)
        logits = model(x)
        if budget == 1.0:  # one round: the very same gathered matmul, so the very same bits
            assert mx.array_equal(logits, reference).item()
        else:  # rounds hand the BLAS fewer rows per call; some CPUs' kernels then round the last bit differently
            np.testing.assert_allclose(np.array(logits), np.array(reference), rtol=1e-5, atol=1e-5, err_msg=str(budget))
            assert mx.array_equal(mx.argmax(logits, -1), mx.argmax(reference, -1)).item(), budget
        assert len(cache.begin_layer(0, mx.zeros((80, 64)), range(8))) == 8 // cache.slots_per_layer[0]


def test_slot_tensors_keep_their_shape_and_are_the_models_weights(stores):
    model, cache = offloaded("olmoe", stores, 0.25)
    shapes = {(l, n): a.shape for l in cache.layers for n, a in cache.slots[l].items()}
    greedy(model)
    assert cache.stats.misses > 0
    for l, block in moe_blocks(model):
        params = dict(tree_flatten(block.switch_mlp.inner.parameters()))
        for name, a in cache.slots[l].items():
            assert a.shape == shapes[(l, name)] == (2, *a.shape[1:])
            assert params[name] is a  # the gathered matmul reads the cache's slots, not a copy
    # the model no longer holds all experts: its expert memory is the budget
    held = sum(a.nbytes for _, b in moe_blocks(model) for _, a in tree_flatten(b.switch_mlp.parameters()))
    assert held == cache.resident_bytes == 6 * 2 * stores["olmoe"][0].expert_bytes()


def test_budget_below_top_k_is_refused_naming_the_minimum(stores):
    store = stores["olmoe"][0]
    min_bytes = 2 * 6 * store.expert_bytes()
    for budget in (0.2, "12.5%", min_bytes - 1):
        with pytest.raises(M2R2Error, match=rf"minimum is 25\.0% of the experts \({min_bytes} bytes"):
            offload_experts(fresh("olmoe"), store, budget)
    assert offload_experts(fresh("olmoe"), store, min_bytes).slots_per_layer[0] == 2
    for bad in ("lots", 1.5, 0.0, -3, True):
        with pytest.raises(M2R2Error, match="expert budget"):
            parse_budget(bad)
    assert parse_budget("50%") == ("fraction", 0.5)
    assert parse_budget("2GB") == ("bytes", 2e9)
    assert parse_budget("512MiB") == ("bytes", 512 * 2**20)


def _copy(store, tmp_path):
    return shutil.copytree(store.folder, tmp_path / "experts")


def test_truncated_expert_file_is_refused_at_open(stores, tmp_path):
    folder = _copy(stores["olmoe"][0], tmp_path)
    path = folder / "layer_002.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(M2R2Error, match=r"layer_002\.safetensors is \d+ bytes.*truncated.*re-export"):
        ExpertStore.open(folder)


def _write_keeping_mtime(path, data: bytes) -> None:
    """Alter a file as bit rot does: same size, same mtime, so the open's cheap check (sizes and mtimes against
    the completion record) passes and only the expert store's own checks can tell. A normal write moves the mtime:
    the open hashes the file and fails (tests/test_cache_integrity.py)."""
    st = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_altered_header_and_missing_manifest_are_refused(stores, tmp_path):
    folder = _copy(stores["olmoe"][0], tmp_path)
    path = folder / "layer_001.safetensors"
    data = path.read_bytes()
    _write_keeping_mtime(path, data.replace(b'"shape":[96,64]', b'"shape":[64,96]', 1))
    with pytest.raises(M2R2Error, match=r"layer_001\.safetensors has a header that does not match"):
        ExpertStore.open(folder)
    (folder / "experts.json").unlink()
    with pytest.raises(M2R2Error, match="no expert store .* export one first"):
        ExpertStore.open(folder)


def test_lru_and_lfu_evict_the_expected_expert(stores):
    survivors = {}
    for policy in ("lru", "lfu"):
        _, cache = offloaded("olmoe", stores, 0.25, policy=policy)
        assert cache.resident(0) == [0, 1]
        for experts in ([0], [0], [0], [1], [2]):  # 0 is the most used, 1 the most recent
            cache.ensure(0, experts)
        survivors[policy] = cache.resident(0)
        assert cache.stats.layer(0).misses == 1
    assert survivors == {"lru": [1, 2], "lfu": [0, 2]}
    lfu = make_policy("LFU")
    for e in (7, 7, 3):
        lfu.used(e)
    lfu.inserted(9)  # a fresh load has no uses yet: the first to go
    assert lfu.victim([7, 3, 9]) == 9
    with pytest.raises(M2R2Error, match="unknown eviction policy 'fifo'; choose one of: lru, lfu"):
        make_policy("fifo")


def test_bytes_moved_equal_misses_times_expert_bytes(stores):
    model, cache = offloaded("mixtral", stores, 0.5)
    greedy(model)
    s = cache.stats
    expert = stores["mixtral"][0].expert_bytes()
    assert s.misses > 0 and s.bytes_moved == s.misses * expert == cache.loader.bytes
    assert all(l.bytes_on_demand == l.misses * expert for l in s.layers.values())
    assert s.tokens == len(PROMPT) + 9 and s.steps == 10
    assert s.bytes_per_token == pytest.approx(s.bytes_moved / s.tokens)
    assert s.summary()["layers"][3]["misses"] == s.layers[3].misses
    s.reset()
    assert s.hits == s.misses == s.bytes_moved == s.tokens == 0 and s.stall_s == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_routers_pick_the_experts_the_blocks_use(stores, arch):
    model, cache = offloaded(arch, stores, 1.0)
    cache.trace, routed = {}, {}

    def record(layer, x):
        routed[(cache.step, layer)] = sorted(set(np.array(cache.routers[layer](x)).reshape(-1).tolist()))

    cache.add_listener(record)
    greedy(model, n=4)
    assert routed == cache.trace and len(routed) == 4 * 6


@pytest.mark.parametrize("arch", ARCHS)
def test_background_pregating_is_exact_and_prefetches_what_is_used(stores, arch):
    model, cache = offloaded(arch, stores, 0.5)
    with cache:
        PreGating().attach(cache)
        assert greedy(model) == stores[arch][1]
    s = cache.stats
    assert s.total("prefetch_hits") > 0 and s.total("prefetch_loads") > 0
    assert s.total("prefetch_bytes") == s.total("prefetch_loads") * stores[arch][0].expert_bytes()
    assert 0 < s.precision <= 1 and 0 < s.recall <= 1
    assert 0 not in {l for l, st in s.layers.items() if st.predicted}  # nothing comes before the first layer


def test_side_pass_loads_count_as_prefetches(stores):
    model, cache = offloaded("olmoe", stores, 0.25)
    with cache.side_pass():
        model(mx.array([[5]]))
        cache.ensure(0, [6, 7])
    s = cache.stats
    assert s.steps == s.hits == s.misses == 0 and s.total("prefetch_loads") >= 2
    cache.ensure(0, [6, 7])
    assert s.hits == s.total("prefetch_hits") == 2 and s.misses == 0


def _recall(predictor, stores, trace=None):
    model, cache = offloaded("olmoe", stores, 0.5)
    if trace is not None:
        cache.trace = trace
    predictor.attach(cache)
    greedy(model)
    return cache.stats


def test_shuffled_control_recalls_less_than_pregating_and_the_oracle(stores):
    trace = {}
    _recall(PreGating(), stores, trace)  # any run records the experts used; greedy decoding repeats them
    oracle = _recall(Oracle(dict(trace)), stores)
    pregating = _recall(PreGating(), stores)
    shuffled = _recall(ShuffledControl(seed=0), stores)
    assert oracle.recall == oracle.precision == 1.0
    assert oracle.misses < pregating.misses
    assert shuffled.recall < pregating.recall < oracle.recall
    assert shuffled.total("predicted") == pregating.total("predicted")  # the same number of experts


def test_stats_of_several_runs_add_up_to_their_sums():
    """How m2r2-bench --moe counts a row over its prompts: each prompt's stats added to one CacheStats."""
    a, b, total = CacheStats(tokens=4, steps=4, stall_s=0.5), CacheStats(tokens=6, steps=6, stall_s=0.25), CacheStats()
    a.layer(0).hits, a.layer(0).misses, a.layer(0).prefetch_loads = 3, 1, 2
    b.layer(0).hits, b.layer(1).misses, b.layer(1).predicted, b.layer(1).predicted_used = 5, 3, 4, 1
    b.layer(1).used_when_predicted, b.layer(1).bytes_on_demand = 2, 300
    total.add(a)
    total.add(b)
    assert total.tokens == 10 and total.steps == 10 and total.stall_s == 0.75
    assert total.layers[0].hits == 8 and total.hits == 8 and total.misses == 4 and total.hit_rate == 8 / 12
    assert total.precision == 1 / 4 and total.recall == 1 / 2
    assert total.loads_per_token == (4 + 2) / 10 and total.bytes_per_token == 300 / 10
    assert a.hits == 3 and b.hits == 5  # the parts are left as they were


def test_quantized_experts_are_served_exactly(tmp_path):
    def quantized():
        model = fresh("olmoe")
        nn.quantize(model, group_size=32, bits=4)
        return model

    reference = quantized()
    store = ExpertStore.export(reference, tmp_path / "q")
    assert {p["name"] for p in store.params(0)} >= {"gate_proj.scales", "down_proj.biases"}
    model = quantized()
    offload_experts(model, store, 0.25)
    assert greedy(model) == greedy(reference)


def test_store_must_match_the_model(stores, tmp_path):
    with pytest.raises(M2R2Error, match="does not match this model"):
        offload_experts(fresh("mixtral"), stores["olmoe"][0], 1.0)
    model, _ = offloaded("olmoe", stores, 1.0)
    with pytest.raises(M2R2Error, match="already offloaded"):
        offload_experts(model, stores["olmoe"][0], 1.0)
    with pytest.raises(M2R2Error, match="no SwitchGLU mixture-of-experts layers"):
        ExpertStore.export(tiny_model("llama").model, tmp_path / "dense")
    with pytest.raises(M2R2Error, match="already exists; pass force=True"):
        ExpertStore.export(fresh("olmoe"), stores["olmoe"][0].folder)


def _model_folder(path):
    lm = tiny_model("olmoe")
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(lm.model.parameters())))
    (path / "config.json").write_text(json.dumps(lm.config))
    return path


def test_a_lazily_loaded_model_never_holds_more_experts_than_the_budget(stores, tmp_path):
    model, _ = load_model(_model_folder(tmp_path), lazy=True)
    mx.synchronize()
    before = mx.get_active_memory()  # arrays of earlier tests may still be alive
    mx.reset_peak_memory()
    cache = offload_experts(model, stores["olmoe"][0], 0.25)
    assert mx.get_peak_memory() - before <= cache.resident_bytes + 4096  # (a few bytes of small arrays)
    assert cache.resident_bytes == 6 * 2 * stores["olmoe"][0].expert_bytes()  # of 6 * 8


def test_cli_exports_and_verifies_a_model_folder(tmp_path, capsys):
    _model_folder(tmp_path)
    out = tmp_path / "experts"
    assert moe_cli(["export", "--model", str(tmp_path), "-o", str(out)]) == 0
    assert moe_cli(["verify", str(out)]) == 0
    assert "6 MoE layers, 48 experts" in capsys.readouterr().out
    path = out / "layer_005.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert moe_cli(["verify", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m m2r2_mlx.moe: error: the expert store in") and "\n" not in err
    assert "layer_005.safetensors fails its checksum" in err
