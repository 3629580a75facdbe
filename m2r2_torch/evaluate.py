"""m2r2-train-torch's held-out evaluation: m2r2-train's (m2r2_mlx/training/evaluate.gate_agreement), same keys."""

from __future__ import annotations

import numpy as np
import torch

from .fast_stream import M2R2Torch


@torch.no_grad()
def heldout_agreement(
    model: M2R2Torch, rows: np.ndarray, mask: np.ndarray | None, device, autocast, batch_size: int = 4
) -> dict:
    """Top-1 agreement with the full model at every gate, the layerskip exit vs the fast stream."""
    parts, gates = model.parts, model.config.gates
    hits = {k: np.zeros(len(gates)) for k in ("layerskip", "fast", "layerskip_scored", "fast_scored")}
    total = scored = 0
    for i in range(0, len(rows), batch_size):
        ids = torch.from_numpy(rows[i : i + batch_size].astype(np.int64)).to(device)
        with autocast:
            states, final, kv = model.slow_pass(ids)
            target = parts.head(final).argmax(-1)
            naive = torch.stack([parts.head(states[g]).argmax(-1) == target for g in gates]).cpu().numpy()
            fast = torch.stack([parts.head(h).argmax(-1) == target for h in model.fast_states(states, kv)])
        fast = fast.cpu().numpy()
        hits["layerskip"] += naive.sum((1, 2))
        hits["fast"] += fast.sum((1, 2))
        total += naive[0].size
        if mask is not None:
            m = mask[i : i + batch_size]
            hits["layerskip_scored"] += naive[:, m].sum(1)
            hits["fast_scored"] += fast[:, m].sum(1)
            scored += int(m.sum())
    out = {
        "gates": list(gates),
        "layerskip": (hits["layerskip"] / total).tolist(),
        "fast": (hits["fast"] / total).tolist(),
        "tokens": total,
    }
    if mask is not None:
        out["scored"] = {
            "layerskip": (hits["layerskip_scored"] / max(scored, 1)).tolist(),
            "fast": (hits["fast_scored"] / max(scored, 1)).tolist(),
            "tokens": scored,
        }
    return out
