"""A llama whose FFNs were split into experts (MoEfication): mlx-lm's llama with a sparse MLP per layer.

``python -m m2r2_tools.moefy`` builds one from a dense llama (SmolLM2): each layer's FFN neurons
are grouped into ``num_experts`` experts of ``intermediate_size / num_experts`` neurons, and a
linear router picks ``num_experts_per_tok`` of them per token. An expert is the FFN restricted to
its neurons, so the block's output is the plain sum of the chosen experts' outputs (no gate
weights: with every expert chosen it is the dense FFN exactly). Experts sit stacked in a
SwitchGLU (``switch_mlp``) beside the router (``gate``), the layout m2r2_mlx.moe finds experts by.

mlx-lm loads model classes from ``mlx_lm.models.<model_type>``; importing this module registers
it there under ``moefied_llama`` (m2r2_mlx.models.registry imports it), so ``mlx_lm.load`` and
m2r2's registry both load a MoEfied folder like any other model.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.switch_layers import SwitchGLU

MODEL_TYPE = "moefied_llama"


@dataclass
class ModelArgs(llama.ModelArgs):
    num_experts: int = 16
    num_experts_per_tok: int = 4
    moefied_from: dict | None = None  # what it was built from and how (recorded by moefy, not used here)


class MoefiedMLP(nn.Module):
    """Router + experts; the output is the sum of the top-k experts' outputs."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.intermediate_size % args.num_experts:
            raise ValueError(
                f"intermediate_size {args.intermediate_size} is not a multiple of num_experts {args.num_experts}"
            )
        self.num_experts = args.num_experts
        self.top_k = args.num_experts_per_tok
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.intermediate_size // args.num_experts, args.num_experts)

    def __call__(self, x: mx.array) -> mx.array:
        k = self.top_k
        indices = mx.stop_gradient(mx.argpartition(-self.gate(x), kth=k - 1, axis=-1)[..., :k])
        return self.switch_mlp(x, indices).sum(axis=-2)


class Model(llama.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        for layer in self.model.layers:
            layer.mlp = MoefiedMLP(args)


sys.modules.setdefault(f"mlx_lm.models.{MODEL_TYPE}", sys.modules[__name__])
