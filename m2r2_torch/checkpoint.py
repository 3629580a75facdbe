"""m2r2-train-torch's adapters on disk: warm starts (--init), checkpoints (--resume) and the outputs, a PyTorch
checkpoint in OUTPUT/torch/ converted into an MLX adapters folder in OUTPUT/ by m2r2-convert's own code."""

from __future__ import annotations

import json
from pathlib import Path

from m2r2_mlx.atomic import atomic_folder
from m2r2_mlx.core.config import ADAPTERS_FILE, AdapterMetrics, M2R2Config, even_gates
from m2r2_mlx.core.draft_vocab import rank_tokens, save_draft_vocab
from m2r2_mlx.core.integrity import record_hashes
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.training.config import TrainConfig
from m2r2_mlx.training.data import DATA_CACHE, DISTILL_LOG, mask_path

import numpy as np
import torch

from .fast_stream import M2R2Torch
from .modules import M2R2Adapters

CHECKPOINT = "checkpoint"  # OUTPUT/checkpoint: adapters, optimizer and step, for --resume
TORCH_DIR = "torch"  # OUTPUT/torch: the PyTorch checkpoint (adapters.pt + m2r2_config.json), m2r2-convert's input
TORCH_WEIGHTS = "adapters.pt"
KEEP = (DATA_CACHE, mask_path(DATA_CACHE).name, DISTILL_LOG, CHECKPOINT, TORCH_DIR)  # survive the MLX folder's write


def read_torch_adapters(folder: Path) -> dict[str, torch.Tensor]:
    """An adapters folder's weights as torch tensors (MLX writes safetensors that safetensors.torch reads)."""
    from safetensors.torch import load_file

    path = folder / ADAPTERS_FILE
    try:
        return load_file(str(path))
    except Exception as e:
        raise M2R2Error(f"{path} cannot be read ({type(e).__name__}); it is missing or truncated") from None


def load_module(lm, cfg: M2R2Config, state: dict[str, torch.Tensor], where) -> M2R2Adapters:
    module = M2R2Adapters.from_config(cfg, lm.model.model.layers)
    try:
        module.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    except RuntimeError as e:
        raise M2R2Error(f"the weights in {where} do not fit its m2r2_config.json ({str(e).splitlines()[0]})") from None
    return module


def build_adapters(config: TrainConfig, lm) -> tuple[M2R2Adapters, M2R2Config]:
    """New adapters (gates or every, rank, context feature), or those of ``config.init``, and their config."""
    if config.init:
        folder = Path(config.init)
        cfg = M2R2Config.load(folder)
        lm.check_adapters(cfg, folder)
        if config.rank and config.adapter_rank != cfg.adapter_rank:
            rank = config.adapter_rank if isinstance(config.rank, int) else ",".join(map(str, config.rank))
            raise M2R2Error(
                f"--rank {rank} differs from the --init adapters' rank {cfg.adapter_rank}; drop "
                "--rank (widening warm starts is m2r2-train's --init --rank)"
            )
        if config.context_feature and not cfg.context_feature:
            raise M2R2Error("--context-feature adds a context feature to new adapters only; drop it with --init")
        cfg.extra, cfg.metrics = {}, AdapterMetrics()  # this run measures its own
        return load_module(lm, cfg, read_torch_adapters(folder), folder), cfg
    gates = list(config.gates) if config.gates else even_gates(lm.num_layers, config.every)
    cfg = lm.m2r2_config(gates, adapter_rank=config.adapter_rank or 64, context_feature=config.context_feature)
    return M2R2Adapters.from_config(cfg, lm.model.model.layers), cfg


def freeze_untrained(model: M2R2Torch, gate_indices: list[int] | None) -> None:
    """ARLA is never trained here (m2r2-train --stage arla does that); with --train-gates, neither are the other
    intervals' adapters (nor, outside the first interval, the context feature)."""
    m2r2 = model.m2r2
    if m2r2.arla is not None:
        m2r2.arla.requires_grad_(False)
    if gate_indices is None:
        return
    for j, (start, stop) in enumerate(model.config.intervals()):
        if j not in gate_indices:
            for i in range(start, stop):
                m2r2.adapters[i].requires_grad_(False)
            if j == 0 and m2r2.context is not None:
                m2r2.context.requires_grad_(False)


def save_checkpoint(module: M2R2Adapters, cfg: M2R2Config, opt, step: int, out: Path) -> None:
    with atomic_folder(out / CHECKPOINT) as tmp:
        torch.save(module.state_dict(), tmp / TORCH_WEIGHTS)
        torch.save(opt.state_dict(), tmp / "optimizer.pt")
        cfg.save(tmp)
        (tmp / "state.json").write_text(json.dumps({"step": step}))


def load_checkpoint(lm, out: Path) -> tuple[M2R2Adapters, M2R2Config, dict, int]:
    ck = out / CHECKPOINT
    cfg = M2R2Config.load(ck)
    lm.check_adapters(cfg, ck)
    module = load_module(lm, cfg, torch.load(ck / TORCH_WEIGHTS, weights_only=True, map_location="cpu"), ck)
    opt_state = torch.load(ck / "optimizer.pt", weights_only=True, map_location="cpu")
    return module, cfg, opt_state, json.loads((ck / "state.json").read_text())["step"]


def write_outputs(module: M2R2Adapters, cfg: M2R2Config, out: Path, rows: np.ndarray, lm) -> str:
    """OUTPUT/torch/ (adapters.pt and m2r2_config.json: the PyTorch checkpoint), then OUTPUT/ itself as an MLX
    adapters folder converted from it by m2r2-convert's code, with draft_vocab.json counted on the rows. Without
    mlx (a GPU machine), the conversion is left to m2r2-convert: the message says how."""
    with atomic_folder(out / TORCH_DIR) as tmp:
        torch.save({k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}, tmp / TORCH_WEIGHTS)
        cfg.save(tmp)
        record_hashes(tmp)
    tokens, cover = rank_tokens(rows, int(lm.config["vocab_size"]))
    try:
        from m2r2_mlx.models.registry import load_model

        from m2r2_convert.checkpoint import plan_conversion, write_conversion
        from m2r2_convert.sources import read_checkpoint
    except ImportError as e:  # no mlx here
        save_draft_vocab(out / TORCH_DIR, tokens, cover, source=f"m2r2-train-torch rows: {rows.size} tokens")
        return (
            f"wrote {out / TORCH_DIR} ({e.name} is not installed here, so no MLX folder); convert it where mlx is: "
            f"m2r2-convert {out / TORCH_DIR} --base {lm.name} -o ADAPTERS"
        )
    conversion = plan_conversion(read_checkpoint(out / TORCH_DIR), load_model(str(lm.path), tokenizer=False))
    conversion.config.base_model = cfg.base_model  # the name it was trained under (an alias), not the folder
    write_conversion(conversion, out, force=True, keep=KEEP)
    save_draft_vocab(out, tokens, cover, source=f"m2r2-train-torch rows: {rows.size} tokens")
    return f"wrote {out} (try: m2r2-chat --model {cfg.base_model} --adapters {out} --mode speculative)"
