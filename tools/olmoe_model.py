"""The tiny OLMoE in PyTorch: mlx-lm's ``olmoe`` written out (QK-norm attention, non-traditional RoPE, softmax top-k
router without renormalisation, SwiGLU experts), with the same weight names, so its state dict loads into mlx-lm
as it is. ``config`` is the model's config.json (tiny_olmoe.CONFIG).

Experts are computed densely with a routing mask (identical maths and gradients to the sparse gather; far faster on a
GPU at this size); the Switch load-balancing loss and the router z-loss (moe_losses) keep experts in use, as OLMoE
does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dims))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope(x, positions, theta: float):
    """Non-traditional RoPE: rotates the two halves of each head."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(0, half, device=x.device, dtype=torch.float32) / half)
    angles = positions[:, None].float() * freqs[None]
    cos, sin = angles.cos().type_as(x), angles.sin().type_as(x)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        d, h, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim, self.theta = d // h, c["rope_theta"]
        self.q_proj = nn.Linear(d, h * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(h * self.head_dim, d, bias=False)
        self.q_norm = RMSNorm(h * self.head_dim, c["rms_norm_eps"])
        self.k_norm = RMSNorm(kv * self.head_dim, c["rms_norm_eps"])

    def forward(self, x):
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x)).view(B, L, -1, self.head_dim).transpose(1, 2)
        k = self.k_norm(self.k_proj(x)).view(B, L, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, L, -1, self.head_dim).transpose(1, 2)
        pos = torch.arange(L, device=x.device)
        q, k = rope(q, pos, self.theta), rope(k, pos, self.theta)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, L, -1))


class SwitchLinear(nn.Module):
    """mlx-lm's SwitchLinear: one weight (experts, out, in)."""

    def __init__(self, i: int, o: int, e: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(e, o, i).uniform_(-(i**-0.5), i**-0.5))


class SwitchGLU(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        d, i, e = c["hidden_size"], c["intermediate_size"], c["num_experts"]
        self.gate_proj, self.up_proj, self.down_proj = (
            SwitchLinear(d, i, e),
            SwitchLinear(d, i, e),
            SwitchLinear(i, d, e),
        )


class SparseMoeBlock(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.gate = nn.Linear(c["hidden_size"], c["num_experts"], bias=False)
        self.switch_mlp = SwitchGLU(c)
        self.k, self.norm_topk_prob = c["num_experts_per_tok"], c["norm_topk_prob"]

    def forward(self, x):
        """Returns (output, router logits). All experts run, masked to the top-k: same maths as gathering."""
        B, L, D = x.shape
        xf = x.reshape(-1, D)
        logits = self.gate(xf)
        probs = logits.float().softmax(-1)
        top = probs.topk(self.k, dim=-1).indices
        weights = torch.zeros_like(probs).scatter(1, top, probs.gather(1, top))
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        s = self.switch_mlp
        gate = torch.einsum("nd,eid->nei", xf, s.gate_proj.weight)
        up = torch.einsum("nd,eid->nei", xf, s.up_proj.weight)
        act = F.silu(gate) * up * weights.type_as(xf)[..., None]
        y = torch.einsum("nei,edi->nd", act, s.down_proj.weight)
        return y.view(B, L, D), logits


class Block(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.self_attn, self.mlp = Attention(c), SparseMoeBlock(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        y, logits = self.mlp(self.post_attention_layernorm(x))
        return x + y, logits


class Inner(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList([Block(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class TinyOlmoe(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.model = Inner(config)
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        nn.init.normal_(self.model.embed_tokens.weight, std=0.02)

    def forward(self, ids):
        """Returns (logits, list of per-layer router logits)."""
        h, routers = self.model.embed_tokens(ids), []
        for layer in self.model.layers:
            h, r = layer(h)
            routers.append(r)
        return self.lm_head(self.model.norm(h)), routers


def moe_losses(routers, num_experts: int, k: int):
    """Switch load-balancing loss (E * sum_e f_e P_e, 1.0 when balanced) and router z-loss, averaged over layers."""
    balance, z = 0.0, 0.0
    for logits in routers:
        probs = logits.float().softmax(-1)
        top = probs.topk(k, dim=-1).indices
        frac = torch.zeros_like(probs).scatter(1, top, 1.0).mean(0) / k
        balance = balance + num_experts * (frac * probs.mean(0)).sum()
        z = z + torch.logsumexp(logits.float(), -1).pow(2).mean()
    return balance / len(routers), z / len(routers)
