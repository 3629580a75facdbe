"""A PyTorch reference of M2R2's adapters, ARLA and fast stream: the layout m2r2-convert reads.

Train adapters in PyTorch with these modules (or any with the same state-dict names
and shapes), save ``torch.save(M2R2Adapters(...).state_dict(), "adapters.pt")`` and
convert it with ``m2r2-convert adapters.pt --base MODEL -o OUT``. Names, shapes and
math are those of m2r2_mlx (fast_stream.BottleneckAdapter, arla.ARLA, lora.LoRADelta);
torch's nn.Linear stores (out, in) like MLX's, so weights carry over untransposed.

The fast stream needs only the base's decoder layers, called as
``layer(h, slow_kv=None, deltas=None) -> (h, (k, v))``: ``slow_kv`` given, the layer
runs as the fast stream (attention reads the slow keys/values of earlier positions
and its own for the current one); ``deltas`` maps projection paths inside the layer
("self_attn.q_proj") to LoRA deltas. ``LlamaReference`` is a minimal llama decoder
with that interface, equal to mlx-lm's llama, for checking the conversion end to end.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dims))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class BottleneckAdapter(nn.Module):
    """delta = up(silu(down(rmsnorm(h)))), added to a fast-stream layer's output; ``up`` starts at zero."""

    def __init__(self, dims: int, rank: int):
        super().__init__()
        self.norm = RMSNorm(dims)
        self.down = nn.Linear(dims, rank, bias=False)
        self.up = nn.Linear(rank, dims, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.up(F.silu(self.down(self.norm(h))))


class ARLA(nn.Module):
    """Accelerated Residual Latent Attention: the exit logit at gate j from the latents z_1..z_j."""

    def __init__(self, dims: int, latent: int, num_gates: int, exit_stats: bool = False):
        super().__init__()
        self.norm = RMSNorm(dims)
        self.proj = nn.Linear(dims, latent)
        self.exit_proj = nn.Linear(3, latent) if exit_stats else None  # (max prob, margin, entropy / log V)
        self.depth = nn.Parameter(torch.zeros(num_gates, latent))
        self.query = nn.Linear(latent, latent, bias=False)
        self.key = nn.Linear(2 * latent, latent, bias=False)
        self.value = nn.Linear(2 * latent, latent, bias=False)
        self.out = nn.Linear(2 * latent, 1)

    def latent(self, h_gate: torch.Tensor, j: int, stats: torch.Tensor | None = None) -> torch.Tensor:
        z = self.proj(self.norm(h_gate)) + self.depth[j]
        return z if self.exit_proj is None else z + self.exit_proj(stats)

    def forward(self, zs: torch.Tensor) -> torch.Tensor:
        vel = torch.cat([torch.zeros_like(zs[..., :1, :]), zs[..., 1:, :] - zs[..., :-1, :]], dim=-2)
        x = torch.cat([zs, vel], dim=-1)
        q, k, v = self.query(zs[..., -1, :]), self.key(x), self.value(x)
        att = torch.softmax((k @ q[..., None])[..., 0] / math.sqrt(zs.shape[-1]), dim=-1)
        a = (att[..., None] * v).sum(-2)
        return self.out(torch.cat([a, zs[..., -1, :]], dim=-1))[..., 0]


class M2R2Adapters(nn.Module):
    """What an adapters folder holds (bottleneck form), under the MLX names: adapters.{i}.*, arla.*."""

    def __init__(self, dims: int, rank: int | list[int], gates: list[int], arla_dim: int | None = None,
                 arla_exit_stats: bool = False):
        super().__init__()
        ranks = rank if isinstance(rank, list) else [rank] * len(gates)  # one per gate interval
        spans = zip([0, *gates[:-1]], gates, ranks)
        self.adapters = nn.ModuleList(
            BottleneckAdapter(dims, r) for start, stop, r in spans for _ in range(start, stop)
        )
        self.arla = ARLA(dims, arla_dim, len(gates), arla_exit_stats) if arla_dim else None


class LoRADelta(nn.Module):
    """PEFT's LoRA on one projection: scale * lora_B(lora_A(x)), with PEFT's names."""

    def __init__(self, in_dims: int, out_dims: int, rank: int, scale: float):
        super().__init__()
        self.lora_A = nn.Linear(in_dims, rank, bias=False)
        self.lora_B = nn.Linear(rank, out_dims, bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.lora_B(self.lora_A(x))


# ---- the two streams ---------------------------------------------------------------------


def intervals(gates: list[int]) -> list[tuple[int, int]]:
    return list(zip([0, *gates[:-1]], gates))


def slow_pass(layers, h: torch.Tensor, gates: list[int]):
    """The frozen base: states at g_0 and at every gate, the final state, and every layer's K/V."""
    states, kv = {0: h}, []
    for i, layer in enumerate(layers):
        h, layer_kv = layer(h)
        kv.append(layer_kv)
        if i + 1 in gates:
            states[i + 1] = h
    return states, h, kv


def fast_states(layers, states: dict, kv: list, gates: list[int], adapters=None, deltas=None) -> list[torch.Tensor]:
    """The fast stream's state at every gate, teacher-forced on the slow stream.

    Interval j restarts from the slow state at g_(j-1); layer i adds ``adapters[i](h)``
    (bottleneck form) and/or runs with ``deltas[i]`` on its projections (LoRA form).
    """
    out = []
    for start, stop in intervals(gates):
        h = states[start]
        for i in range(start, stop):
            y, _ = layers[i](h, slow_kv=kv[i], deltas=deltas[i] if deltas else None)
            h = y + adapters[i](h) if adapters is not None else y
        out.append(h)
    return out


# ---- a minimal llama decoder, equal to mlx-lm's llama --------------------------------------


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of positions 0..T-1 on (B, heads, T, D), rotating the two halves (mlx-lm's default)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = torch.arange(x.shape[-2], dtype=torch.float32)[:, None] * inv_freq[None]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def _project(linear: nn.Linear, path: str, x: torch.Tensor, deltas) -> torch.Tensor:
    y = linear(x)
    return y + deltas[path](x) if deltas and path in deltas else y


class LlamaAttention(nn.Module):
    def __init__(self, dims: int, heads: int, kv_heads: int, rope_theta: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.rope_theta = heads, kv_heads, dims // heads, rope_theta
        self.q_proj = nn.Linear(dims, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dims, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dims, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, dims, bias=False)

    def forward(self, x: torch.Tensor, slow_kv=None, deltas=None):
        B, T, _ = x.shape

        def heads(name: str, n: int) -> torch.Tensor:
            return (
                _project(getattr(self, name), f"self_attn.{name}", x, deltas)
                .view(B, T, n, self.head_dim)
                .transpose(1, 2)
            )

        q = rope(heads("q_proj", self.heads), self.rope_theta)
        k = rope(heads("k_proj", self.kv_heads), self.rope_theta)
        v = heads("v_proj", self.kv_heads)
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        if slow_kv is None:  # slow stream: causal self-attention
            keys, values, allowed = k, v, j <= i
        else:  # fast stream: slow keys of earlier positions, then its own key for the current one
            keys, values = torch.cat([slow_kv[0], k], dim=2), torch.cat([slow_kv[1], v], dim=2)
            allowed = torch.cat([j < i, j == i], dim=1)
        repeat = self.heads // self.kv_heads  # grouped-query attention: query head h reads kv head h // repeat
        keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
        scores = (q @ keys.transpose(-1, -2)) / math.sqrt(self.head_dim)
        att = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ values
        out = _project(self.o_proj, "self_attn.o_proj", att.transpose(1, 2).reshape(B, T, -1), deltas)
        return out, (k, v)


class LlamaMLP(nn.Module):
    def __init__(self, dims: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden, bias=False)
        self.up_proj = nn.Linear(dims, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dims, bias=False)

    def forward(self, x: torch.Tensor, deltas=None) -> torch.Tensor:
        gate = _project(self.gate_proj, "mlp.gate_proj", x, deltas)
        up = _project(self.up_proj, "mlp.up_proj", x, deltas)
        return _project(self.down_proj, "mlp.down_proj", F.silu(gate) * up, deltas)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, dims: int, hidden: int, heads: int, kv_heads: int, eps: float, rope_theta: float):
        super().__init__()
        self.self_attn = LlamaAttention(dims, heads, kv_heads, rope_theta)
        self.mlp = LlamaMLP(dims, hidden)
        self.input_layernorm = RMSNorm(dims, eps)
        self.post_attention_layernorm = RMSNorm(dims, eps)

    def forward(self, h: torch.Tensor, slow_kv=None, deltas=None):
        r, kv = self.self_attn(self.input_layernorm(h), slow_kv, deltas)
        h = h + r
        return h + self.mlp(self.post_attention_layernorm(h), deltas), kv


class LlamaReference(nn.Module):
    """A llama decoder with tied embeddings; parameter names are those of mlx-lm's ``model.model``."""

    def __init__(self, config: dict):
        super().__init__()
        dims = config["hidden_size"]
        self.embed_tokens = nn.Embedding(config["vocab_size"], dims)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                dims,
                config["intermediate_size"],
                config["num_attention_heads"],
                config.get("num_key_value_heads", config["num_attention_heads"]),
                config["rms_norm_eps"],
                config.get("rope_theta", 10000.0),
            )
            for _ in range(config["num_hidden_layers"])
        )
        self.norm = RMSNorm(dims, config["rms_norm_eps"])

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + tied LM head: the exit applied at a gate."""
        return self.norm(h) @ self.embed_tokens.weight.T
