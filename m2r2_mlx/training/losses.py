"""M2R2 training objective: per-gate distillation to the final layer plus residual alignment.

Distillation runs over a vocabulary subset: the union of the teacher's top-k tokens
at every position of the batch. On a 49k vocabulary the full LM head and softmax
cost several times the fast stream's own layers; the subset keeps nearly all of the
teacher's probability mass at a fraction of the cost. Evaluation uses the full head.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def teacher_targets(parts, final_state: mx.array, temperature: float, top_k: int = 16):
    """Vocabulary subset (union of the teacher's top-k) and the teacher's log-probs over it."""
    logits = parts.head(final_state).astype(mx.float32)
    top = mx.argpartition(-logits, top_k - 1, axis=-1)[..., :top_k]
    rows = mx.array(np.unique(np.array(top)))
    sub = logits[..., rows] / temperature
    return rows, mx.stop_gradient(nn.log_softmax(sub, axis=-1))


def gate_loss(parts, fast_state, final_state, rows, teacher_logp, temperature: float, align_weight: float):
    """KL(p_final || p_gate) * T^2 over ``rows`` + align_weight * (1 - cos(h_fast, h_final)), token mean."""
    student_logp = nn.log_softmax(parts.head_rows(fast_state, rows).astype(mx.float32) / temperature, axis=-1)
    kl = (mx.exp(teacher_logp) * (teacher_logp - student_logp)).sum(-1) * temperature**2
    cos = 1.0 - (fast_state * final_state).sum(-1) / (
        mx.linalg.norm(fast_state, axis=-1) * mx.linalg.norm(final_state, axis=-1) + 1e-6
    )
    return (kl + align_weight * cos).mean(), kl.mean()
