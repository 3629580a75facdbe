"""Tiny random transformers decoders saved as model folders, loaded by both PyTorch and MLX (the same weights)."""

from __future__ import annotations

from pathlib import Path

from m2r2_mlx.models.registry import load_model

import numpy as np
import torch
from mlx.utils import tree_flatten
from transformers import AutoConfig, AutoModelForCausalLM

from .tiny import CONFIGS

# transformers' defaults for these ids (phi3's pad 32000) lie outside the tiny vocabulary of 101
SPECIAL_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_hf(arch: str, folder: Path, seed: int = 0):
    """A random transformers model of ``arch`` (tests.tiny's config), saved in ``folder``: (torch model, MLX lm)."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(**CONFIGS[arch], **SPECIAL_IDS)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.requires_grad_(False)
    model.save_pretrained(folder)
    return model, load_model(str(folder), tokenizer=False)


def mlx_state(m2r2) -> dict[str, torch.Tensor]:
    """An MLX M2R2Model's parameters as a PyTorch state dict (the same names)."""
    return {k: torch.tensor(np.array(v)) for k, v in tree_flatten(m2r2.parameters())}
