"""M2R2's trainable modules in PyTorch, under the names and with the math of m2r2_mlx.

``M2R2Adapters`` holds what an adapters folder holds: bottleneck adapters (``adapters.{i}.*``) or LoRA deltas
(``lora.{i}.self_attn.q_proj.lora_a.weight``, ...), the first interval's context feature (``context.*``) and ARLA
(``arla.*``). Its ``state_dict()`` is the "m2r2-pytorch" layout m2r2-convert reads: the names are exactly the
MLX parameter names of m2r2_mlx.core (fast_stream.BottleneckAdapter / ContextFeature, lora.LoRADelta, arla.ARLA),
and torch's nn.Linear stores (out, in) like MLX's, so weights carry over untransposed.

Nothing here needs the base model: m2r2_torch.fast_stream runs these modules over a transformers decoder.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

from m2r2_mlx.errors import M2R2Error

import torch
import torch.nn.functional as F
from torch import nn

NUM_EXIT_STATS = 3


class RMSNorm(nn.Module):
    """mlx.nn.RMSNorm (eps 1e-5), computed in float32."""

    def __init__(self, dims: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dims))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


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


class ContextFeature(nn.Module):
    """scale * proj(rmsnorm(h_final at t-1)), added to the first interval's start; ``proj`` starts at zero and
    ``scale`` is dims^-1/2 (why: m2r2_mlx.core.fast_stream.ContextFeature)."""

    def __init__(self, dims: int):
        super().__init__()
        self.norm = RMSNorm(dims)
        self.proj = nn.Linear(dims, dims, bias=False)
        nn.init.zeros_(self.proj.weight)
        self.scale = dims**-0.5

    def forward(self, h_prev: torch.Tensor) -> torch.Tensor:
        return self.scale * self.proj(self.norm(h_prev))


def exit_stats(logits: torch.Tensor) -> torch.Tensor:
    """(..., vocab) exit logits -> (..., 3): max probability, its margin over the second, entropy / log(vocab)."""
    x = logits.float()
    top2 = x.topk(2, dim=-1).values
    centred = x - top2[..., :1]
    e = centred.exp()
    z = e.sum(-1)
    p_first = 1 / z
    p_second = (top2[..., 1] - top2[..., 0]).exp() / z
    entropy = (z.log() - (e * centred).sum(-1) / z) / math.log(logits.shape[-1])
    return torch.stack([p_first, p_first - p_second, entropy], dim=-1)


class ARLA(nn.Module):
    """Accelerated Residual Latent Attention: the exit logit at gate j from the latents z_1..z_j."""

    def __init__(self, dims: int, latent: int, num_gates: int, exit_stats: bool = False):
        super().__init__()
        self.norm = RMSNorm(dims)
        self.proj = nn.Linear(dims, latent)
        self.exit_proj = nn.Linear(NUM_EXIT_STATS, latent) if exit_stats else None
        self.depth = nn.Parameter(torch.zeros(num_gates, latent))
        self.query = nn.Linear(latent, latent, bias=False)
        self.key = nn.Linear(2 * latent, latent, bias=False)
        self.value = nn.Linear(2 * latent, latent, bias=False)
        self.out = nn.Linear(2 * latent, 1)
        self.score_scale = 1 / math.sqrt(latent)

    def latent(self, h_gate: torch.Tensor, j: int, stats: torch.Tensor | None = None) -> torch.Tensor:
        z = self.proj(self.norm(h_gate)) + self.depth[j]
        return z if self.exit_proj is None else z + self.exit_proj(stats)

    def _keys_values(self, zs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vel = torch.cat([torch.zeros_like(zs[..., :1, :]), zs[..., 1:, :] - zs[..., :-1, :]], dim=-2)
        x = torch.cat([zs, vel], dim=-1)
        return self.key(x), self.value(x)

    def forward(self, zs: torch.Tensor) -> torch.Tensor:
        """Exit logit at gate n-1 from the latents of gates 0..n-1: (..., n, latent) -> (...)."""
        k, v = self._keys_values(zs)
        q = self.query(zs[..., -1, :])
        att = torch.softmax((k @ q[..., None])[..., 0] * self.score_scale, dim=-1)
        a = (att[..., None] * v).sum(-2)
        return self.out(torch.cat([a, zs[..., -1, :]], dim=-1))[..., 0]

    def logits_all(self, zs: torch.Tensor) -> torch.Tensor:
        """The exit logit of every prefix 1..J at once (a causal mask over gates): (..., J, latent) -> (..., J)."""
        k, v = self._keys_values(zs)
        scores = (self.query(zs) @ k.transpose(-1, -2)) * self.score_scale
        J = zs.shape[-2]
        causal = torch.ones(J, J, dtype=torch.bool, device=zs.device).tril()
        att = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        return self.out(torch.cat([att @ v, zs], dim=-1))[..., 0]


class LoRADelta(nn.Module):
    """scale * lora_b(lora_a(x)) on one projection (m2r2_mlx.core.lora.LoRADelta); ``lora_b`` starts at zero."""

    def __init__(self, in_dims: int, out_dims: int, rank: int, scale: float):
        super().__init__()
        self.lora_a = nn.Linear(in_dims, rank, bias=False)
        self.lora_b = nn.Linear(rank, out_dims, bias=False)
        nn.init.zeros_(self.lora_b.weight)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.lora_b(self.lora_a(x))


class WithDelta(nn.Module):
    """A base projection plus its delta: stands in for the projection during a fast-stream call."""

    def __init__(self, base: nn.Module, delta: LoRADelta):
        super().__init__()
        self.base, self.delta = base, delta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.delta(x)


def new_lora_deltas(layers, targets: list[str], rank: int, scale: float) -> nn.ModuleList:
    """Zero-initialised deltas for each of ``layers`` (nested ModuleDicts mirroring the layer's module paths, so
    that names read ``lora.{i}.self_attn.q_proj.lora_a.weight``) on the linear projections named in ``targets``."""
    out, matched = nn.ModuleList(), set()
    for i, layer in enumerate(layers):
        tree = nn.ModuleDict()
        for path, module in layer.named_modules():
            name = path.rsplit(".", 1)[-1]
            if name not in targets:
                continue
            if not isinstance(module, nn.Linear):
                raise M2R2Error(
                    f"LoRA target {path!r} of layer {i} is a {type(module).__name__}, not a linear projection; "
                    "choose linear projections as targets"
                )
            node = tree
            for part in path.split(".")[:-1]:
                if part not in node:
                    node[part] = nn.ModuleDict()
                node = node[part]
            node[name] = LoRADelta(module.in_features, module.out_features, rank, scale)
            matched.add(name)
        out.append(tree)
    unmatched = [t for t in targets if t not in matched]
    if unmatched:
        have = sorted({p.rsplit(".", 1)[-1] for p, m in layers[0].named_modules() if isinstance(m, nn.Linear)})
        raise M2R2Error(
            f"LoRA target {unmatched[0]!r} names no projection of the base's layers (they have: {', '.join(have)})"
        )
    return out


class LoRASwitch:
    """Swaps each layer's deltas in for the targeted projections during a fast-stream call, and the base's own
    modules back after it (m2r2_mlx.core.lora.LoRASwitch): the slow stream is the untouched base."""

    def __init__(self, layers, deltas: nn.ModuleList | None):
        self.sites = []
        for layer, tree in zip(layers, deltas or []):
            sites = []
            for path, delta in tree.named_modules():
                if isinstance(delta, LoRADelta):
                    parent_path, _, name = path.rpartition(".")
                    sites.append((layer.get_submodule(parent_path) if parent_path else layer, name, delta))
            self.sites.append(sites)

    @contextmanager
    def active(self, start: int, stop: int) -> Iterator[None]:
        swapped = []
        try:
            for sites in self.sites[start:stop]:
                for parent, name, delta in sites:
                    original = parent.get_submodule(name)
                    parent.register_module(name, WithDelta(original, delta))  # torch's own child swap
                    swapped.append((parent, name, original))
            yield
        finally:
            for parent, name, original in reversed(swapped):
                parent.register_module(name, original)


class M2R2Adapters(nn.Module):
    """What an adapters folder holds, under the MLX names: ``adapters.{i}.*`` (bottleneck form, one per fast-stream
    layer 0 .. g_J - 1, ``rank`` one or one per gate interval) or ``lora.{i}.*`` (LoRA form: ``lora``, from
    new_lora_deltas), ``context.*`` (a context feature) and ``arla.*`` (``arla_dim`` given)."""

    def __init__(
        self,
        dims: int,
        rank: int | list[int],
        gates: list[int],
        arla_dim: int | None = None,
        arla_exit_stats: bool = False,
        context_feature: bool = False,
        lora: nn.ModuleList | None = None,
    ):
        super().__init__()
        ranks = rank if isinstance(rank, list) else [rank] * len(gates)  # one per gate interval
        spans = zip([0, *gates[:-1]], gates, ranks)
        bottlenecks = [BottleneckAdapter(dims, r) for start, stop, r in spans for _ in range(start, stop)]
        self.adapters = nn.ModuleList([] if lora is not None else bottlenecks)
        self.lora = lora
        self.context = ContextFeature(dims) if context_feature else None
        self.arla = ARLA(dims, arla_dim, len(gates), arla_exit_stats) if arla_dim else None

    @classmethod
    def from_config(cls, cfg, layers) -> "M2R2Adapters":
        """Fresh (zero-initialised) modules for an M2R2Config; ``layers``: the base's decoder layers (LoRA shapes)."""
        lora = None
        if cfg.adapter_form == "lora":
            lora = new_lora_deltas(layers[: cfg.gates[-1]], cfg.lora_targets, cfg.adapter_rank, cfg.lora_scale)
        return cls(
            cfg.hidden_size,
            cfg.adapter_rank,
            cfg.gates,
            cfg.arla_dim if cfg.arla else None,
            cfg.arla_exit_stats,
            cfg.context_feature,
            lora,
        )
