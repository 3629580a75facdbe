"""ARLA (Accelerated Residual Latent Attention): the exit decision at each gate.

At gate j the fast-stream residual is projected to a small latent z_j (plus a
learned per-gate embedding). One attention head, queried by z_j, reads the
token's trajectory z_1..z_j together with its velocities z_j - z_(j-1); its
output and z_j give one logit, p_exit(j) = sigmoid(logit).

With ``exit_stats`` the latent also carries three numbers read off the gate's exit
distribution (max probability, its margin over the runner-up, normalised entropy),
projected into the same latent space: the trajectory then shows how the exit's own
certainty moves from gate to gate, which the residual alone shows only indirectly.
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx import nn

from .. import host

NUM_EXIT_STATS = 3


def exit_stats(logits: mx.array) -> mx.array:
    """(..., vocab) exit logits -> (..., 3): max probability, margin over the second, entropy / log(vocab).

    One exp over the vocabulary (it is the costly part on a CPU): with e = exp(x - max) and
    Z = sum(e), p_max = 1 / Z and entropy = log Z - sum(e * (x - max)) / Z.
    """
    x = logits.astype(mx.float32)
    top2 = mx.topk(x, 2, axis=-1)
    first = top2.max(-1, keepdims=True)
    centred = x - first
    e = mx.exp(centred)
    z = e.sum(-1)
    p_first = 1 / z
    p_second = mx.exp(top2.min(-1) - first[..., 0]) / z
    entropy = (mx.log(z) - (e * centred).sum(-1) / z) / math.log(logits.shape[-1])
    return mx.stack([p_first, p_first - p_second, entropy], axis=-1)


class ARLA(nn.Module):
    """Accelerated Residual Latent Attention: p_exit at gate j from the token's latent trajectory z_1..z_j."""

    def __init__(self, dims: int, latent: int, num_gates: int, exit_stats: bool = False):
        super().__init__()
        self.norm = nn.RMSNorm(dims)
        self.proj = nn.Linear(dims, latent)
        if exit_stats:
            self.exit_proj = nn.Linear(NUM_EXIT_STATS, latent)
        self.depth = mx.zeros((num_gates, latent))  # learned per-gate embedding
        self.query = nn.Linear(latent, latent, bias=False)
        self.key = nn.Linear(2 * latent, latent, bias=False)
        self.value = nn.Linear(2 * latent, latent, bias=False)
        self.out = nn.Linear(2 * latent, 1)
        # not ``self.latent``: that name is the method below
        self.score_scale = 1 / math.sqrt(latent)

    @property
    def exit_stats(self) -> bool:
        return "exit_proj" in self

    def latent(self, h_gate: mx.array, j: int, stats: mx.array | None = None) -> mx.array:
        """z_j from the fast-stream residual at gate j, shape (..., dims) -> (..., latent); ``stats``
        (..., 3) from ``exit_stats`` of the gate's exit logits, when the head reads them."""
        z = self.proj(self.norm(h_gate)) + self.depth[j]
        if self.exit_stats:
            z = z + self.exit_proj(stats)
        return z

    def _keys_values(self, zs: mx.array) -> tuple[mx.array, mx.array]:
        # The first gate has no predecessor: its velocity is exactly zero.
        vel = mx.concatenate([mx.zeros_like(zs[..., :1, :]), zs[..., 1:, :] - zs[..., :-1, :]], axis=-2)
        x = mx.concatenate([zs, vel], axis=-1)
        return self.key(x), self.value(x)

    def __call__(self, zs: mx.array) -> mx.array:
        """Exit logit at gate n-1 from the latents of gates 0..n-1: (..., n, latent) -> (...)."""
        k, v = self._keys_values(zs)
        q = self.query(zs[..., -1, :])
        att = mx.softmax((k @ q[..., None])[..., 0] * self.score_scale, axis=-1)  # over the n gates
        a = (att[..., None] * v).sum(-2)
        return self.out(mx.concatenate([a, zs[..., -1, :]], axis=-1))[..., 0]

    def logits_all(self, zs: mx.array) -> mx.array:
        """The exit logit of every prefix 1..J at once: (..., J, latent) -> (..., J).

        Equal to calling ``self(zs[..., :n, :])`` for each n: a gate's velocity only
        depends on earlier gates, and a causal mask keeps each query to its prefix.
        """
        k, v = self._keys_values(zs)
        q = self.query(zs)
        scores = (q @ k.swapaxes(-1, -2)) * self.score_scale  # (..., J queries, J gates)
        J = zs.shape[-2]
        causal = mx.arange(J)[None, :] <= mx.arange(J)[:, None]
        att = mx.softmax(mx.where(causal, scores, -mx.inf), axis=-1)
        a = att @ v
        return self.out(mx.concatenate([a, zs], axis=-1))[..., 0]


class ARLARule:
    """Early exit's rule from ARLA: p_exit at gate j from the latents of the gates this token has passed."""

    reads_earlier_gates = True  # each gate's latent up to j, as in training: the gate planner checks a prefix

    def __init__(self, arla):
        self.arla = arla

    def __call__(self, logits: mx.array, h_exit: mx.array, gate_index: int, trail: list) -> float:
        stats = exit_stats(logits) if self.arla.exit_stats else None
        trail.append(self.arla.latent(h_exit.reshape(-1), gate_index, stats))
        return host.read(mx.sigmoid(self.arla(mx.stack(trail))))
