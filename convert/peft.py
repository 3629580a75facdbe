"""PEFT LoRA checkpoints in M2R2's terms: tensor names, rank, scale and target projections.

PEFT saves ``adapter_model.safetensors`` (or ``adapter_model.bin``) with names like
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` and an
``adapter_config.json`` with ``r``, ``lora_alpha`` and ``target_modules``. They become
the "lora" adapter form: ``lora.3.self_attn.q_proj.lora_a.weight``, scale
``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).

``lora_A`` and ``lora_B`` are ``torch.nn.Linear`` modules whatever the base layer is:
(rank, in) and (out, rank), which is also MLX's (out, in) layout, so nothing is
transposed. ``fan_in_fan_out`` (GPT-2's Conv1D bases, which store (in, out)) only
changes how PEFT merges B @ A into such a base weight, never the forward pass
x -> B(A(x)), so it needs no transposition here either.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from m2r2_mlx.errors import M2R2Error

CONFIG_FILE = "adapter_config.json"
# mlx-lm keeps Hugging Face's module names (model.layers.N.self_attn.q_proj, ...); the
# optional ".default" is PEFT's adapter name, present when a PeftModel's own state_dict() was saved
_PEFT_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])(?:\.default)?\.weight$")
_M2R2_NAME = re.compile(r"^lora\.(\d+)\.(.+)\.lora_([ab])\.weight$")


def to_m2r2_name(name: str) -> str | None:
    """The M2R2 parameter a PEFT tensor becomes, or None if it is not a decoder layer's LoRA weight."""
    m = _PEFT_NAME.match(name)
    return f"lora.{m[1]}.{m[2]}.lora_{m[3].lower()}.weight" if m else None


def to_peft_name(name: str) -> str:
    """The inverse of ``to_m2r2_name``: the name PEFT's save_pretrained gives an M2R2 LoRA weight."""
    m = _M2R2_NAME.match(name)
    if not m:
        raise ValueError(f"{name} is not an M2R2 LoRA weight name")
    return f"base_model.model.model.layers.{m[1]}.{m[2]}.lora_{m[3].upper()}.weight"


def looks_like_peft(folder: Path, names) -> bool:
    return (folder / CONFIG_FILE).is_file() or any(".lora_A." in n or ".lora_B." in n for n in names)


@dataclass
class LoraSettings:
    targets: list[str]
    rank: int
    scale: float


def read_lora_settings(folder: Path, names) -> LoraSettings:
    """Rank, scale and targets from the adapter_config.json beside the weights; what M2R2 cannot
    express (DoRA, per-module ranks, trained biases) is refused rather than dropped."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise M2R2Error(
            f"the checkpoint has PEFT LoRA tensors but no {CONFIG_FILE} beside it; "
            "copy it from the PEFT output folder (it gives r, lora_alpha, target_modules)"
        )
    try:
        cfg = json.loads(path.read_text())
        if not isinstance(cfg, dict):
            raise TypeError
    except (ValueError, TypeError):
        raise M2R2Error(f"{path} is not a JSON object; it should be the adapter_config.json PEFT wrote") from None
    kind = str(cfg.get("peft_type") or "LORA").upper()
    if kind != "LORA":
        raise M2R2Error(f"{path} describes a {kind} adapter; only LoRA checkpoints convert")
    for key, why in (
        ("use_dora", "DoRA magnitudes"),
        ("lora_bias", "LoRA biases"),
        ("rank_pattern", "per-module ranks"),
        ("alpha_pattern", "per-module alphas"),
    ):
        if cfg.get(key):
            raise M2R2Error(f"{path} sets {key}: {why} are not supported by the M2R2 lora form")
    if cfg.get("bias", "none") not in ("none", None):
        raise M2R2Error(
            f"{path} sets bias={cfg['bias']!r}: trained base biases are not supported by the M2R2 lora form"
        )
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        raise M2R2Error(f"{path} has no LoRA rank r (a positive integer)")
    rank, alpha = cfg["r"], float(cfg.get("lora_alpha", 8))  # 8 is PEFT's default lora_alpha
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    targets = cfg.get("target_modules")
    if isinstance(targets, list) and targets:
        targets = [str(t) for t in targets]
    else:
        # a regex or "all-linear": PEFT matched it against module paths; the tensors say what it matched
        targets = sorted({m[2].rsplit(".", 1)[-1] for m in map(_PEFT_NAME.match, names) if m})
        if not targets:
            raise M2R2Error(f"{path} has no target_modules list and no tensor names a layer's LoRA weight")
    return LoraSettings(targets=targets, rank=rank, scale=scale)
