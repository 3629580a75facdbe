"""M2R2 training objective: per-gate distillation to the final layer plus residual alignment."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def teacher_targets(parts, final_state: mx.array, temperature: float):
    """Frozen targets from the slow stream: final log-probs (temperature-scaled) and state."""
    logits = parts.head(final_state)
    return mx.stop_gradient(nn.log_softmax(logits.astype(mx.float32) / temperature, axis=-1))


def gate_loss(parts, fast_state, final_state, teacher_logp, temperature: float, align_weight: float, weights=None):
    """KL(p_final || p_gate) * T^2 + align_weight * (1 - cos(h_fast, h_final)), averaged over tokens."""
    student_logp = nn.log_softmax(parts.head(fast_state).astype(mx.float32) / temperature, axis=-1)
    kl = (mx.exp(teacher_logp) * (teacher_logp - student_logp)).sum(-1) * temperature**2
    cos = 1.0 - (fast_state * final_state).sum(-1) / (
        mx.linalg.norm(fast_state, axis=-1) * mx.linalg.norm(final_state, axis=-1) + 1e-6
    )
    per_token = kl + align_weight * cos
    if weights is None:
        return per_token.mean(), kl.mean()
    denom = mx.maximum(weights.sum(), 1.0)
    return (per_token * weights).sum() / denom, (kl * weights).sum() / denom
