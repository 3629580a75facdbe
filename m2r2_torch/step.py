"""One optimisation step of m2r2-train-torch: m2r2-train's schedule, batches and loss (m2r2_mlx/training), in
PyTorch, so that N processes compute the update one process computes with the whole batch."""

from __future__ import annotations

import math

from m2r2_mlx.training.config import DistillLoss

import numpy as np
import torch
import torch.nn.functional as F

from .distributed import all_sum
from .fast_stream import M2R2Torch


def lr_at(step: int, lr: float, steps: int, warmup: int = 20) -> float:
    """m2r2-train's schedule: linear warmup from lr/100, then cosine decay to lr/20."""
    warmup = min(warmup, max(steps // 10, 1))
    if step < warmup:
        return lr * 0.01 + (lr - lr * 0.01) * step / warmup
    decay = max(steps - warmup, 1)
    return lr * 0.05 + (lr - lr * 0.05) * 0.5 * (1 + math.cos(math.pi * min(step - warmup, decay) / decay))


def batch_rows(seed: int, step: int, n_rows: int, batch_size: int) -> np.ndarray:
    """The global batch of ``step``: a function of the seed and the step alone, so a resumed run draws what an
    uninterrupted one would."""
    return np.random.default_rng([seed, step]).integers(0, n_rows, batch_size)


def flat_scored(h: torch.Tensor, scored: torch.Tensor | None) -> torch.Tensor:
    """States (B, T, D) as (n, D): all positions, or those at the flat indices ``scored``."""
    flat = h.reshape(-1, h.shape[-1])
    return flat if scored is None else flat[scored]


def step_loss(
    model: M2R2Torch, ddp, ids: torch.Tensor, scored: torch.Tensor | None, loss: DistillLoss, gate_indices, world: int
):
    """(loss to differentiate, per-gate mean KL as floats). Frozen slow pass and teacher, then the fast stream
    (``ddp``: the model, wrapped for several processes).

    Under several processes the teacher's vocabulary subset is the union over all of them, and the loss is this
    process's token sum over the global token count times the world size: DDP's gradient average is then exactly
    the one-process gradient of the global batch's token mean."""
    parts, temp = model.parts, loss.temperature
    with torch.no_grad():
        states, final, kv = model.slow_pass(ids)
        final = flat_scored(final, scored).float()
        logits = parts.head(final).float()
        in_subset = torch.zeros(logits.shape[-1], dtype=torch.int32, device=ids.device)
        in_subset[logits.topk(loss.top_k, dim=-1).indices.flatten()] = 1
        rows = all_sum(in_subset, world).nonzero().flatten()
        teacher = F.log_softmax(logits[:, rows] / temp, dim=-1)
        n_global = all_sum(torch.tensor(float(final.shape[0]), device=ids.device), world)
    total, kls = 0.0, []
    for fast in ddp(states, kv, gate_indices):
        fast = flat_scored(fast, scored).float()
        student = F.log_softmax(parts.head_rows(fast, rows).float() / temp, dim=-1)
        kl = (teacher.exp() * (teacher - student)).sum(-1) * temp**2
        cos = 1 - F.cosine_similarity(fast, final, dim=-1, eps=1e-6)
        total = total + (kl + loss.align * cos).sum() * world / n_global
        kls.append(kl.detach().sum() / n_global)
    return total, [float(all_sum(k, world)) for k in kls]
