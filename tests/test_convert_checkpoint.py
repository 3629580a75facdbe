"""m2r2-convert checkpoint: PyTorch-trained adapters give the same fast stream in MLX.

Random adapters made "in PyTorch" for a tiny transformers llama (convert_tiny) are saved in each supported file
layout, converted through the CLI, and the MLX exits at every gate are compared with the PyTorch fast stream's
(m2r2_torch.fast_stream) over the transformers model; faulty checkpoints are one line. PEFT LoRA: test_convert_peft.
"""

import json
import shutil
import subprocess

from m2r2_mlx.core.adapters import load_adapters
from m2r2_mlx.core.config import AdapterMetrics
from m2r2_mlx.errors import M2R2Error

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from .conftest import slow_after_first

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402  (after the skip: needs torch)

from m2r2_convert.cli import parse_args  # noqa: E402

from .convert_tiny import (  # noqa: E402
    ARLA_DIM,
    GATES,
    IDS,
    RANK,
    assert_one_line_error,
    assert_same_arla,
    assert_same_exits,
    convert,
    convert_in_process,
    random_adapters,
    tiny_base,  # noqa: F401  (the base fixture)
)


def test_transformers_llama_equals_mlx_lm(base):
    _, lm, twin = base
    with torch.no_grad():
        np.testing.assert_allclose(twin(torch.tensor(IDS)).logits.numpy(), np.array(lm.model(mx.array(IDS))), atol=1e-4)


def test_state_dict_converts_to_the_same_exits_and_arla(base, tmp_path):
    folder, lm, twin = base
    module = random_adapters()
    torch.save(module.state_dict(), tmp_path / "adapters.pt")
    out = tmp_path / "out"
    r = convert(tmp_path / "adapters.pt", "--base", folder, "-o", out, "--gates", "2,4")  # the short form
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout
    m2r2 = load_adapters(lm, out)  # also checks the recorded base identity
    cfg = m2r2.config
    assert (cfg.gates, cfg.adapter_rank, cfg.arla, cfg.arla_dim, cfg.arla_exit_stats) == (
        GATES,
        RANK,
        True,
        ARLA_DIM,
        True,
    )
    assert cfg.base_model == str(folder) and cfg.extra["source_layout"] == "m2r2-pytorch"
    fast, torch_fast = assert_same_exits(m2r2, twin, module)
    assert_same_arla(m2r2, module, fast, torch_fast)


@pytest.mark.slow
def test_per_interval_ranks_are_read_from_the_shapes(base, tmp_path):
    folder, lm, twin = base
    module = random_adapters(rank=[RANK * 2, RANK])
    torch.save(module.state_dict(), tmp_path / "adapters.pt")
    r = convert(tmp_path / "adapters.pt", "--base", folder, "-o", tmp_path / "out", "--gates", "2,4")
    assert r.returncode == 0, r.stderr
    m2r2 = load_adapters(lm, tmp_path / "out")
    assert m2r2.config.adapter_rank == [RANK * 2, RANK]
    assert_same_exits(m2r2, twin, module)


def test_other_file_layouts_give_the_same_weights(base, tmp_path):
    """bf16 safetensors, bin shards behind an index, and a folder with m2r2_config.json beside the weights."""
    _, lm, twin = base
    module = random_adapters(seed=1)
    state = module.state_dict()
    torch.save(state, tmp_path / "adapters.pt")
    reference = convert_in_process(tmp_path / "adapters.pt", lm, gates=GATES).targets

    # bfloat16 safetensors in, float32 out: the values are the bf16-rounded ones, exactly
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, tmp_path / "adapters.safetensors")
    conv, _ = convert_in_process(tmp_path / "adapters.safetensors", lm, tmp_path / "bf16", gates=GATES)
    assert {r[3] for r in conv.rows()} == {"bfloat16"}
    rounded = random_adapters(seed=1)
    rounded.load_state_dict({k: v.to(torch.bfloat16).to(torch.float32) for k, v in state.items()})
    assert_same_exits(load_adapters(lm, tmp_path / "bf16"), twin, rounded)

    # shards behind an index (pytorch_model.bin.index.json style)
    shards = tmp_path / "sharded"
    shards.mkdir()
    names = sorted(state)
    weight_map = {}
    for part, chunk in enumerate([names[: len(names) // 2], names[len(names) // 2 :]]):
        torch.save({k: state[k] for k in chunk}, shards / f"pytorch_model-0000{part + 1}-of-00002.bin")
        weight_map.update({k: f"pytorch_model-0000{part + 1}-of-00002.bin" for k in chunk})
    (shards / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    conv, out = convert_in_process(shards, lm, tmp_path / "from-shards", dtype="bfloat16", gates=GATES)
    assert conv.targets == reference
    saved = mx.load(str(out / "adapters.safetensors"))
    assert {v.dtype for v in saved.values()} == {mx.bfloat16}
    expect = dict(tree_flatten(load_adapters(lm, tmp_path / "bf16").parameters()))
    assert all(mx.array_equal(saved[k], expect[k]).item() for k in expect)

    # a folder: the gates come from the m2r2_config.json beside the weights
    beside = tmp_path / "with-config"
    beside.mkdir()
    torch.save(state, beside / "adapters.pt")
    cfg = load_adapters(lm, tmp_path / "bf16").config
    cfg.metrics = AdapterMetrics(heldout_agreement={"gates": GATES, "fast": [0.5, 0.75]})
    cfg.extra = {"recipe": {"steps": 2}}
    cfg.save(beside)
    converted = convert_in_process(beside, lm).config
    assert converted.gates == GATES and converted.metrics == cfg.metrics  # what its trainer measured, carried over
    assert converted.extra["recipe"] == {"steps": 2} and converted.extra["source_layout"] == "m2r2-pytorch"
    with pytest.raises(M2R2Error, match="disagree"):
        convert_in_process(beside, lm, gates=[1, 4])


# ---- the CLI: dry run, refusals -----------------------------------------------------------


class NotATensor:
    """Pickled into a checkpoint, it must not be unpickled (weights_only)."""


def _edit(state: dict, case: str) -> dict:
    state = dict(state)
    if case == "missing":
        del state["adapters.3.up.weight"]
    elif case == "unknown":
        state["adapters.0.extra.weight"] = torch.zeros(4)
    elif case == "shape":
        state["adapters.1.down.weight"] = torch.zeros(5, 64)
    elif case == "object":
        state["optimizer"] = NotATensor()
    elif case == "number":
        state["step"] = 3
    return state


@pytest.mark.parametrize(
    ("case", "fragments"),
    slow_after_first(
        [
            ("missing", ["missing key 'adapters.3.up.weight'"]),
            ("unknown", ["unknown key 'adapters.0.extra.weight'"]),
            ("shape", ["'adapters.1.down.weight'", "(5, 64)", "expected (4, 64)"]),
            ("object", ["objects other than tensors", "weights_only"]),
            ("number", ["'step' is a int, not a tensor"]),
        ]
    ),
)
def test_faulty_checkpoints_are_one_line_errors(base, tmp_path, case, fragments):
    folder = base[0]
    torch.save(_edit(random_adapters().state_dict(), case), tmp_path / "bad.pt")
    r = convert(tmp_path / "bad.pt", "--base", folder, "-o", tmp_path / "out", "--gates", "2,4")
    assert_one_line_error(r, "m2r2-convert: error:", *fragments)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_existing_output_needs_force(base, tmp_path):
    folder = base[0]
    torch.save(random_adapters().state_dict(), tmp_path / "adapters.pt")
    (tmp_path / "out").mkdir()
    args = [tmp_path / "adapters.pt", "--base", folder, "-o", tmp_path / "out", "--gates", "2,4"]
    assert_one_line_error(convert(*args), "already exists", "--force")
    r = convert(*args, "--force")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "adapters.safetensors").is_file()


def test_commands_and_short_form():
    assert parse_args(["ckpt.pt", "--base", "smollm2", "-o", "out"]).command == "checkpoint"
    assert parse_args(["checkpoint", "ckpt.pt", "--base", "smollm2", "--dry-run"]).dtype == "float32"
    assert parse_args(["gguf", "model.gguf", "-o", "out"]).command == "gguf"


# ---- the user path, on the embedded model ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("m2r2-convert") is None, reason="console scripts not installed (pip install -e .)")
def test_user_path_convert_then_chat(tmp_path):
    """As a user would, through the console scripts: random small PyTorch adapters for SmolLM2-135M,
    converted, then used for speculative decoding (lossless: the answer is the base model's)."""
    module = random_adapters(dims=576, rank=8, gates=[6, 12, 18, 24], arla_dim=None, std=0.01)
    torch.save(module.state_dict(), tmp_path / "adapters.pt")
    out = tmp_path / "out"

    def script(name, *args):
        return subprocess.run([shutil.which(name), *map(str, args)], capture_output=True, text=True, timeout=600)

    r = script("m2r2-convert", tmp_path / "adapters.pt", "--base", "smollm2", "-o", out)  # gates: every 6 by default
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "m2r2_config.json").read_text())["gates"] == [6, 12, 18, 24]
    r = script(
        "m2r2-chat",
        "--adapters",
        out,
        "--method",
        "speculative",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "8",
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
