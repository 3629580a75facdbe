"""m2r2-convert checkpoint on PEFT LoRA checkpoints: the names map to the "lora" adapter form and give the same
fast stream in MLX; configs M2R2 cannot express are refused; a dry run prints the mapping."""

import json
from pathlib import Path

from m2r2_mlx.core.adapters import load_adapters
from m2r2_mlx.errors import M2R2Error

import mlx.core as mx
import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402  (after the skip: needs torch)

from m2r2_convert.peft import to_m2r2_name, to_peft_name  # noqa: E402
from m2r2_torch.modules import M2R2Adapters, new_lora_deltas  # noqa: E402

from .convert_tiny import (  # noqa: E402
    GATES,
    IDS,
    LLAMA_TARGETS,
    RANK,
    assert_same_exits,
    convert,
    convert_in_process,
    tiny_base,  # noqa: F401  (the base fixture)
)


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
    from_bin = convert_in_process(
        write_peft(tmp_path / "peft-bin", deltas, fmt="bin", fan_in_fan_out=True), lm, gates=GATES
    )
    from_safetensors = convert_in_process(peft, lm, gates=GATES)
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
        convert_in_process(folder, lm, gates=GATES)


def test_peft_layers_past_the_last_gate_are_named(base, tmp_path):
    _, lm, twin = base
    folder = write_peft(tmp_path / "peft", random_lora(twin, layers=5))
    with pytest.raises(M2R2Error, match=r"unknown key 'base_model.model.model.layers.4.*past the last gate \(4\)"):
        convert_in_process(folder, lm, gates=GATES)
    (folder / "adapter_config.json").unlink()
    with pytest.raises(M2R2Error, match="no adapter_config.json"):
        convert_in_process(folder, lm, gates=GATES)


@pytest.mark.slow
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
