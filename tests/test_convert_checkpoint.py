"""m2r2-convert checkpoint: PyTorch-trained adapters give the same fast stream in MLX.

A tiny random transformers llama is saved as a model folder (the --base), which MLX loads too. Random
adapters made "in PyTorch" (m2r2_torch.modules, the trainer's own modules) are saved in each supported
layout, converted through the CLI, and the MLX exits at every gate are compared with the PyTorch fast
stream's (m2r2_torch.fast_stream) over the transformers model.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from m2r2_mlx.core.adapters import load_adapters
from m2r2_mlx.errors import M2R2Error

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402  (after the skip: needs torch)

from m2r2_convert.checkpoint import plan_conversion  # noqa: E402
from m2r2_convert.cli import parse_args  # noqa: E402
from m2r2_convert.peft import to_m2r2_name, to_peft_name  # noqa: E402
from m2r2_convert.sources import read_checkpoint  # noqa: E402
from m2r2_torch.fast_stream import M2R2Torch  # noqa: E402
from m2r2_torch.modules import M2R2Adapters, new_lora_deltas  # noqa: E402

from .torch_tiny import tiny_hf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GATES = [2, 4]
RANK, ARLA_DIM = 4, 8
LLAMA_TARGETS = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]


def run_cli(module: str, *args, timeout=600) -> subprocess.CompletedProcess:
    """A console script as a user runs it, on this checkout's code."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )


def convert(*args) -> subprocess.CompletedProcess:
    return run_cli("m2r2_convert.cli", *args)


def assert_one_line_error(r: subprocess.CompletedProcess, *fragments: str) -> None:
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# ---- the base, in MLX and in PyTorch ------------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(folder, MLX model loaded from it, the transformers model saved there: the same weights)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    twin, lm = tiny_hf("llama", folder)
    return folder, lm, twin


IDS = np.random.default_rng(3).integers(0, 101, size=(2, 9))


def mlx_exits(m2r2):
    states, _, kv = m2r2.slow_pass(mx.array(IDS))
    fast = m2r2.fast_states(states, kv)
    return [np.array(m2r2.parts.head(h)) for h in fast], fast


@torch.no_grad()
def torch_exits(twin, config, module=None):
    """Exit logits at every gate of the PyTorch fast stream with ``module`` (M2R2Adapters; None: fresh ones,
    which compute the plain fast stream)."""
    model = M2R2Torch(twin, config, module)
    states, _, kv = model.slow_pass(torch.tensor(IDS))
    fast = model.fast_states(states, kv)
    return [model.parts.head(h).numpy() for h in fast], fast


def test_transformers_llama_equals_mlx_lm(base):
    _, lm, twin = base
    with torch.no_grad():
        np.testing.assert_allclose(twin(torch.tensor(IDS)).logits.numpy(), np.array(lm.model(mx.array(IDS))), atol=1e-4)


# ---- own layout: bottleneck adapters + ARLA ---------------------------------------------


def random_adapters(dims=64, rank=RANK, gates=GATES, arla_dim=ARLA_DIM, std=0.1, seed=0, arla_exit_stats=True):
    """PyTorch adapters with every weight random, ``up`` included (a fresh ``up`` is zero)."""
    torch.manual_seed(seed)
    module = M2R2Adapters(dims, rank, gates, arla_dim, arla_exit_stats)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn_like(p) * std + (1.0 if name.endswith("norm.weight") else 0.0))
    return module


def assert_same_exits(m2r2, twin, module, atol=1e-4):
    got, fast = mlx_exits(m2r2)
    want, torch_fast = torch_exits(twin, m2r2.config, module)
    plain, _ = torch_exits(twin, m2r2.config)
    for j, (g, w, p) in enumerate(zip(got, want, plain)):
        assert np.abs(w - p).max() > 1e-2, "the adapters should move the exits"
        np.testing.assert_allclose(g, w, atol=atol, rtol=1e-4, err_msg=f"gate {GATES[j]}")
    return fast, torch_fast


def assert_same_arla(m2r2, module, fast, torch_fast):
    assert m2r2.arla.exit_stats  # the converted head reads the exit statistics, as the PyTorch one does
    stats = [np.random.default_rng(j).random((*h.shape[:-1], 3)).astype(np.float32) for j, h in enumerate(fast)]
    zs = mx.stack([m2r2.arla.latent(h, j, mx.array(s)) for j, (h, s) in enumerate(zip(fast, stats))], axis=-2)
    got = np.array(m2r2.arla.logits_all(zs))
    with torch.no_grad():
        tzs = torch.stack(
            [module.arla.latent(h, j, torch.from_numpy(s)) for j, (h, s) in enumerate(zip(torch_fast, stats))], dim=-2
        )
        want = np.stack([module.arla(tzs[..., :n, :]).numpy() for n in range(1, len(GATES) + 1)], axis=-1)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


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


def _convert_in_process(path, lm, out=None, dtype="float32", **gates):
    from m2r2_convert.checkpoint import write_conversion

    conversion = plan_conversion(read_checkpoint(path), lm, **gates)
    return conversion if out is None else (conversion, write_conversion(conversion, out, dtype=dtype))


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
    reference = _convert_in_process(tmp_path / "adapters.pt", lm, gates=GATES).targets

    # bfloat16 safetensors in, float32 out: the values are the bf16-rounded ones, exactly
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, tmp_path / "adapters.safetensors")
    conv, _ = _convert_in_process(tmp_path / "adapters.safetensors", lm, tmp_path / "bf16", gates=GATES)
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
    conv, out = _convert_in_process(shards, lm, tmp_path / "from-shards", dtype="bfloat16", gates=GATES)
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
    cfg.save(beside)
    assert _convert_in_process(beside, lm).config.gates == GATES
    with pytest.raises(M2R2Error, match="disagree"):
        _convert_in_process(beside, lm, gates=[1, 4])


# ---- PEFT LoRA ------------------------------------------------------------------------------


def random_lora(twin, rank=RANK, alpha=8, seed=2, layers=GATES[-1]) -> M2R2Adapters:
    """LoRA-form adapters with every weight random (``lora_b`` nonzero too) on the first ``layers`` layers."""
    torch.manual_seed(seed)
    targets = sorted({p.split(".")[-1] for p in LLAMA_TARGETS})
    deltas = new_lora_deltas(twin.model.layers[:layers], targets, rank, alpha / rank)
    with torch.no_grad():
        for p in deltas.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return M2R2Adapters(twin.config.hidden_size, rank, GATES, lora=deltas)


def peft_state(module: M2R2Adapters) -> dict:
    """The LoRA deltas under PEFT's names (base_model.model.model.layers.N.<path>.lora_A.weight)."""
    return {to_peft_name(k): v.detach().clone() for k, v in module.state_dict().items()}


def write_peft(folder: Path, deltas, fmt="safetensors", **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    state = peft_state(deltas)
    if fmt == "safetensors":
        save_file(state, folder / "adapter_model.safetensors")
    else:
        torch.save(state, folder / "adapter_model.bin")
    adapter_config = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": 8,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": sorted({p.split(".")[-1] for p in LLAMA_TARGETS}),
        **config,
    }
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config))
    return folder


def test_peft_names():
    peft = "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"
    assert to_peft_name("lora.3.self_attn.q_proj.lora_a.weight") == peft
    assert (
        to_m2r2_name(peft)
        == to_m2r2_name(peft.replace("lora_A", "lora_A.default"))
        == "lora.3.self_attn.q_proj.lora_a.weight"
    )
    assert to_m2r2_name("base_model.model.lm_head.weight") is None


def test_peft_lora_converts_to_the_same_exits(base, tmp_path):
    folder, lm, twin = base
    deltas = random_lora(twin)
    peft = write_peft(tmp_path / "peft", deltas)
    out = tmp_path / "out"
    r = convert("checkpoint", peft, "--base", folder, "-o", out, "--gates", "2,4")
    assert r.returncode == 0, r.stderr
    m2r2 = load_adapters(lm, out)
    cfg = m2r2.config
    assert cfg.adapter_form == "lora" and cfg.lora_scale == 2.0 and cfg.adapter_rank == RANK
    assert set(cfg.lora_targets) == {p.split(".")[-1] for p in LLAMA_TARGETS}
    assert_same_exits(m2r2, twin, deltas)
    # the slow stream stays the base, exactly
    assert mx.array_equal(m2r2.base(mx.array(IDS)), lm.model(mx.array(IDS))).item()

    # adapter_model.bin, fan_in_fan_out set (GPT-2-style Conv1D bases): lora_A/lora_B are
    # nn.Linear either way, so the same tensors come out
    from_bin = _convert_in_process(
        write_peft(tmp_path / "peft-bin", deltas, fmt="bin", fan_in_fan_out=True), lm, gates=GATES
    )
    from_safetensors = _convert_in_process(peft, lm, gates=GATES)
    assert from_bin.targets == from_safetensors.targets
    for source in from_bin.targets:
        assert mx.array_equal(from_bin.checkpoint.tensors[source], from_safetensors.checkpoint.tensors[source]).item()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"r": 8}, "adapter_config.json says r=8"),
        ({"peft_type": "IA3"}, "only LoRA"),
        ({"target_modules": ["q_proj", "qkv_proj"]}, "'qkv_proj' names no projection"),
    ],
)
def test_peft_configs_m2r2_cannot_express_are_refused(base, tmp_path, change, message):
    _, lm, twin = base
    folder = write_peft(tmp_path / "peft", random_lora(twin), **change)
    with pytest.raises(M2R2Error, match=message):
        _convert_in_process(folder, lm, gates=GATES)


def test_peft_layers_past_the_last_gate_are_named(base, tmp_path):
    _, lm, twin = base
    folder = write_peft(tmp_path / "peft", random_lora(twin, layers=5))
    with pytest.raises(M2R2Error, match=r"unknown key 'base_model.model.model.layers.4.*past the last gate \(4\)"):
        _convert_in_process(folder, lm, gates=GATES)
    (folder / "adapter_config.json").unlink()
    with pytest.raises(M2R2Error, match="no adapter_config.json"):
        _convert_in_process(folder, lm, gates=GATES)


# ---- the CLI: dry run, refusals -----------------------------------------------------------


def test_dry_run_prints_the_mapping_and_writes_nothing(base, tmp_path):
    folder, _, twin = base
    peft = write_peft(tmp_path / "peft", random_lora(twin))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    r = convert("checkpoint", peft, "--base", folder, "--gates", "2,4", "--dry-run", "--dtype", "float16")
    assert r.returncode == 0, r.stderr
    header = r.stdout.splitlines()[0]
    assert header.split() == ["source", "name", "target", "name", "shape", "dtype"]
    row = next(
        line
        for line in r.stdout.splitlines()
        if line.startswith("base_model.model.model.layers.0.self_attn.k_proj.lora_A")
    )
    assert row.split() == [
        "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight",
        "lora.0.self_attn.k_proj.lora_a.weight",
        "4x64",
        "float32",
        "->",
        "float16",
    ]
    assert "56 tensors" in r.stdout and "nothing written" in r.stdout
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


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
    [
        ("missing", ["missing key 'adapters.3.up.weight'"]),
        ("unknown", ["unknown key 'adapters.0.extra.weight'"]),
        ("shape", ["'adapters.1.down.weight'", "(5, 64)", "expected (4, 64)"]),
        ("object", ["objects other than tensors", "weights_only"]),
        ("number", ["'step' is a int, not a tensor"]),
    ],
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
        "--mode",
        "speculative",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "8",
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
