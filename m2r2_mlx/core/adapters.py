"""Adapters folders: ``adapters.safetensors`` + ``m2r2_config.json``, written atomically."""

from __future__ import annotations

import shutil
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..atomic import atomic_folder, refuse_existing
from ..checksums import RECORD
from ..errors import M2R2Error
from ..models.base_model import BaseParts, SubsetHead, config_hash
from ..models.registry import variant_note
from .config import ADAPTERS_FILE, CONFIG_FILE, M2R2Config, even_gates
from .draft_vocab import load_draft_vocab
from .fast_stream import ContextFeature, M2R2Model
from .integrity import record_hashes, verify_adapters


def config_for_base(lm, gates: list[int], **fields) -> M2R2Config:
    """An M2R2Config for a loaded base model, which it records (name and config hash) so that
    load_adapters can refuse another base; ``fields`` are the other M2R2Config fields."""
    parts = BaseParts(lm.model)
    return M2R2Config(
        gates=gates,
        num_layers=parts.num_layers,
        hidden_size=parts.hidden_size,
        base_model=str(lm.name),
        base_config_hash=config_hash(lm.config),
        **fields,
    )


def new_m2r2(
    lm,
    gates: list[int] | None = None,
    every: int = 6,
    rank: int = 64,
    arla_dim: int = 64,
    *,
    arla: bool = False,
    lora_targets: list[str] | None = None,
    lora_scale: float = 1.0,
) -> M2R2Model:
    """Fresh (zero-initialised) adapters for a loaded base model: parallel bottlenecks, or LoRA
    deltas on the projections named in ``lora_targets``; ARLA weights too if ``arla``."""
    gates = gates or even_gates(len(lm.model.layers), every)
    form = (
        {"adapter_form": "lora", "lora_targets": list(lora_targets), "lora_scale": lora_scale} if lora_targets else {}
    )
    cfg = config_for_base(lm, gates, adapter_rank=rank, arla_dim=arla_dim, arla=arla, **form)
    return M2R2Model(lm.model, cfg)


def widen_adapters(m2r2: M2R2Model, ranks: int | list[int], seed: int = 0) -> M2R2Model:
    """The same model with wider bottlenecks (``ranks``: one, or one per gate interval), computing the
    same function: each layer keeps its trained rows, its new ``down`` rows are drawn as nn.Linear draws
    them (from a key fixed by ``seed`` and the layer, so a rebuild draws the same) and its new ``up``
    columns are zero. Warm-starts a wider interval from trained adapters."""
    cfg = m2r2.config
    if cfg.adapter_form != "parallel_bottleneck":
        raise M2R2Error("only bottleneck adapters can be widened; LoRA ranks are fixed by their checkpoint")
    wide = M2R2Model(m2r2.base, replace(cfg, adapter_rank=ranks))
    for i, (new, old) in enumerate(zip(wide.adapters, m2r2.adapters)):
        grow = new.down.weight.shape[0] - old.down.weight.shape[0]
        if grow < 0:
            raise M2R2Error(
                f"layer {i}: rank {new.down.weight.shape[0]} is narrower than the adapters' "
                f"{old.down.weight.shape[0]}; adapters can only be widened"
            )
        d = old.down.weight.shape[1]
        fresh = mx.random.uniform(-(d**-0.5), d**-0.5, (grow, d), key=mx.random.key(seed * 10_000 + i))
        new.norm.weight = old.norm.weight
        new.down.weight = mx.concatenate([old.down.weight, fresh.astype(old.down.weight.dtype)], axis=0)
        new.up.weight = mx.concatenate([old.up.weight, mx.zeros((d, grow), dtype=old.up.weight.dtype)], axis=1)
    if getattr(m2r2, "arla", None) is not None:
        wide.arla = m2r2.arla
    if getattr(m2r2, "context", None) is not None:
        wide.context = m2r2.context
    wide.exit_head = m2r2.exit_head
    mx.eval(wide.parameters())
    return wide


def add_context_feature(m2r2: M2R2Model) -> M2R2Model:
    """Give the first interval a context feature (fast_stream.ContextFeature), zero-initialised: the model
    computes what it did until it trains."""
    if not m2r2.config.context_feature:
        m2r2.config.context_feature = True
        m2r2.context = ContextFeature(m2r2.config.hidden_size)
        mx.eval(m2r2.context.parameters())
    return m2r2


def save_adapters(
    m2r2: M2R2Model,
    folder: str | Path,
    overwrite: bool = False,
    keep: tuple[str, ...] = (),
    carry_from: Path | None = None,
) -> Path:
    """Write the folder atomically; ``keep`` names files of an existing folder to carry over (a data cache);
    ``carry_from``: another adapters folder whose other files (an exit vocabulary) the new one keeps."""
    folder = Path(folder)
    refuse_existing(folder, overwrite)
    with atomic_folder(folder, keep=keep) as tmp:
        mx.save_safetensors(str(tmp / ADAPTERS_FILE), dict(tree_flatten(m2r2.parameters())), metadata={"format": "mlx"})
        m2r2.config.save(tmp)
        for other in sorted(Path(carry_from).iterdir()) if carry_from is not None else ():
            if other.is_file() and other.name not in (ADAPTERS_FILE, CONFIG_FILE, RECORD):
                shutil.copy(other, tmp / other.name)
    record_hashes(folder)  # after the rename: the files carried over are recorded too
    return folder


def load_adapters(lm, folder: str | Path) -> M2R2Model:
    """Load adapters for ``lm``; refuse adapters made for another base model."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise M2R2Error(f"adapters folder {folder} not found; check --adapters")
    cfg = M2R2Config.load(folder)
    verify_adapters(folder)  # before any weight is read: damaged adapters fail here, in one line
    have = config_hash(lm.config)
    # another variant of the same model (phi3's 4-bit conversion for adapters trained on phi3-bf16): allowed, said
    variant = variant_note(cfg.base_model, lm.name)
    same_shape = cfg.num_layers == len(lm.model.layers) and cfg.hidden_size == BaseParts(lm.model).hidden_size
    if (cfg.base_config_hash != have and variant is None) or not same_shape:
        raise M2R2Error(
            f"adapters in {folder} were made for base {cfg.base_model!r} (config {cfg.base_config_hash}), "
            f"not for {lm.name!r} (config {have}); use adapters trained for this model, or train them with m2r2-train"
        )
    if variant is not None:
        print(variant, file=sys.stderr)
    path = folder / ADAPTERS_FILE
    try:  # a config whose sizes no array takes (a rank past 2**31) fails here too
        m2r2 = M2R2Model(lm.model, cfg)
        weights = mx.load(str(path))
        m2r2.load_weights(list(weights.items()), strict=True)
    except Exception as e:
        raise M2R2Error(
            f"{path} cannot be loaded ({type(e).__name__}: {' '.join(str(e).split())[:120]}); it is missing, "
            "truncated or from another config"
        ) from None
    mx.eval(m2r2.parameters())
    if cfg.exit_vocab:
        ids = load_draft_vocab(folder, cfg.exit_vocab, otherwise="set exit_vocab to 0 in its m2r2_config.json")
        m2r2.exit_head = SubsetHead(m2r2.parts, ids)
    return m2r2
