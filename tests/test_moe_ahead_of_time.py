"""M2R2 ahead-of-time expert loading: the fast stream's predictions never change the tokens;
m2r2-bench --moe runs every method end to end on a tiny OLMoE and writes its files."""

import json
from pathlib import Path

from m2r2_mlx.core.adapters import new_m2r2, save_adapters
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.moe import ExpertStore, offload_experts
from m2r2_mlx.moe.fast_predictor import FastStreamPredictor

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from m2r2_bench.moe_bench import MOE_METHODS, MoEBenchConfig, numbers
from m2r2_bench.moe_rows import greedy
from tests.tiny import tiny_model

from .inprocess import run_main

BOUNDS3 = ("lru", "belady", "oracle")
PROMPT = np.array([3, 17, 42, 8, 99, 23, 5, 61, 12, 7])


def _m2r2(lm, seed=1):
    m = new_m2r2(lm, gates=[2, 4], rank=8)
    mx.random.seed(seed)  # nonzero adapters: the fast stream really differs from the base
    m.update(tree_map(lambda p: 0.2 * mx.random.normal(p.shape), m.parameters()))
    return m


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return ExpertStore.export(tiny_model("olmoe").model, tmp_path_factory.mktemp("store") / "experts")


@pytest.mark.parametrize("budget", [0.5, 0.25])
def test_fast_stream_predictions_leave_tokens_unchanged(store, budget):
    reference, _ = greedy(tiny_model("olmoe").model, PROMPT, 12)
    lm = tiny_model("olmoe")
    cache = offload_experts(lm.model, store, budget)
    predictor = FastStreamPredictor(_m2r2(lm)).attach(cache)
    tokens, _ = greedy(lm.model, PROMPT, 12, on_prefilled=cache.reset)
    assert tokens == reference
    s = cache.stats
    assert s.steps == 11  # decode steps only: the fast stream's passes count none
    assert s.total("predicted") > 0 and 0 < s.recall <= 1
    # layers 2..5 are predicted (the intervals after the first gate); layers 0-1 are not; every decode
    # step's prediction is scored at that same step (a prediction filed under another step would be
    # scored late or pruned, and these counts would fall short)
    assert {l for l, st in s.layers.items() if st.predicted} == {2, 3, 4, 5}
    assert all(s.layers[l].predicted == 11 * cache.top_k(l) for l in (2, 3, 4, 5))
    assert predictor.fast_layer_passes == 4 * 11  # intervals [0,2) and [2,4) every decode step
    predictor.detach()
    assert all(type(layer).__name__ != "_GateTap" for layer in lm.model.layers)
    cache.close()


def _tiny_olmoe_folder(tmp_path):
    lm = tiny_model("olmoe")
    folder = tmp_path / "tiny-olmoe"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(lm.model.parameters())))
    (folder / "config.json").write_text(json.dumps(lm.config))
    save_adapters(_m2r2(lm), tmp_path / "adapters")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, lm.config["vocab_size"], 400).astype(np.uint16)
    np.save(tmp_path / "eval.npy", ids)
    for name in ("train", "heldout"):  # what the lookahead adapters are fitted and scored on
        np.save(folder / f"{name}.npy", rng.integers(0, lm.config["vocab_size"], 1024).astype(np.uint16))
    return folder


@pytest.mark.slow
def test_bench_moe_runs_every_method_and_writes_its_files(tmp_path):
    model = _tiny_olmoe_folder(tmp_path)
    out = tmp_path / "out"
    cmd = ["--moe", "--model", str(model), "--adapters", str(tmp_path / "adapters")]
    cmd += ["--prompts", str(tmp_path / "eval.npy"), "--budgets", "50,25", "--num-prompts", "2"]
    methods = [m for m in MOE_METHODS if m != "lookahead"]  # its maps are fitted by their own command
    cmd += ["--prompt-tokens", "8", "--max-tokens", "6", "--methods", ",".join(methods), "--out", str(out)]
    r = run_main("m2r2_bench.specbench", *cmd)
    assert r.returncode == 0, r.stderr[-2000:]
    run, *rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert (
        run["run"]["clock"] == "wall"
        and run["run"]["disk"]["gbps"] > 0
        and run["command"].startswith("m2r2-bench --moe")
    )
    assert {(row["method"], row["budget"]) for row in rows} == {("resident", 100.0)} | {
        (m, b) for m in methods[1:] for b in (50.0, 25.0)
    }
    assert all(row["same_as_resident"] and row["tokens_per_s"] > 0 for row in rows)
    lru, belady, oracle = ({r["method"]: r for r in rows if r["budget"] == 25.0}[m] for m in BOUNDS3)
    assert belady["hit_rate"] >= lru["hit_rate"]  # the offline optimum on demand
    assert oracle["hit_rate"] > lru["hit_rate"] and lru["read_gbps"] > 0 and lru["mb_per_token"] > 0
    assert (out / "moe_bench.png").stat().st_size > 0 and "M2R2 fast stream" in (out / "results.md").read_text()


@pytest.mark.slow  # (a subprocess; the same checks in-process: test_bench_config_is_checked_before_anything_loads)
def test_bench_moe_bad_input_is_one_line(tmp_path):
    r = run_main("m2r2_bench.specbench", "--moe", "--methods", "lru,psychic", "--prompts", tmp_path / "none.npy")
    assert r.returncode == 2 and "Traceback" not in r.stderr  # argparse's usage, then the one error line
    assert "psychic" in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(methods=("lru", "psychic")), "unknown MoE method.* psychic; choose from resident, lru, pregating"),
        (dict(profile="laptop"), "unknown device profile 'laptop'; choose one of: macbook, pcie-gpu, here"),
        (dict(profile="macbook", clock="wall"), "the wall clock measures this machine"),
        (dict(io="mmap"), "--io takes direct or cached"),
        (dict(budgets=(25.0, 0.0)), "above 0 and at most 100"),
        (dict(max_tokens=1), "--max-tokens at least 2"),
        (dict(prompts=Path("no-such-ids.npy")), "no-such-ids.npy not found"),
    ],
)
def test_bench_config_is_checked_before_anything_loads(tmp_path, change, message):
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(10))
    assert MoEBenchConfig("m", "m-m2r2", ids).clock_kind == "wall"
    assert MoEBenchConfig("m", "m-m2r2", ids, profile="macbook").clock_kind == "device"
    assert MoEBenchConfig("m", "m-m2r2", ids, clock="device").clock_kind == "device"
    with pytest.raises(M2R2Error, match=message):
        MoEBenchConfig(**{"model": "m", "adapters": "m-m2r2", "prompts": ids, **change})


def test_bench_budgets_are_numbers():
    assert numbers("100,50") == (100.0, 50.0)
    with pytest.raises(M2R2Error, match="comma-separated numbers, got '25,x'"):
        numbers("25,x")
