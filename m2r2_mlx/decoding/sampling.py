"""Token distributions and the verification rule of speculative decoding.

The target distribution is exactly what plain sampling draws from (mlx-lm's
sampler: top-p on the untempered log-probabilities, then temperature), so
speculative sampling reproduces plain sampling's distribution, not a variant.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def sampling_probs(logits: mx.array, s: Sampling) -> mx.array:
    """Probabilities (float32, last axis) that plain sampling with ``s`` draws tokens from."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if 0 < s.top_p < 1:
        logprobs = apply_top_p(logprobs, s.top_p)
    return mx.softmax(logprobs / s.temperature, axis=-1)


def sample_from(probs: mx.array) -> int:
    return int(mx.random.categorical(mx.log(probs)).item())


def verify(logits: mx.array, drafts: list[int], q: mx.array | None, s: Sampling) -> tuple[int, int]:
    """How many drafts the full model accepts, and the token it emits after them.

    ``logits`` (K+1, vocab) are the full model's on [y, d_1..d_K]. Greedy: accept the
    longest prefix equal to the full model's argmax. Sampling (Leviathan et al.): accept
    d_i with probability min(1, p_i(d_i) / q_i(d_i)); on the first rejection emit a
    sample of norm(max(0, p_i - q_i)); if all pass, a sample of p_(K+1). ``q`` (K, vocab)
    holds the draft distributions; None means deterministic drafts (one-hot q).
    """
    if s.greedy:
        targets = mx.argmax(logits, axis=-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == targets[a]:
            a += 1
        return a, targets[a]
    p = sampling_probs(logits, s)
    k = len(drafts)
    if k:
        idx = mx.array(drafts)
        p_d = p[mx.arange(k), idx]
        q_d = mx.ones((k,)) if q is None else q[mx.arange(k), idx]
        ratio = mx.minimum(p_d / mx.maximum(q_d, 1e-20), 1.0)
        passed = (mx.random.uniform(shape=(k,)) < ratio).tolist()
        for i, ok in enumerate(passed):
            if not ok:
                q_i = mx.zeros_like(p[i]).at[drafts[i]].add(1.0) if q is None else q[i]
                residual = mx.maximum(p[i] - q_i, 0.0)
                total = residual.sum()
                return i, sample_from(mx.where(total > 0, residual / total, p[i]))
    return k, sample_from(p[k])
