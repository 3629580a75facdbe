"""The M2R2 fast stream over a Hugging Face ``transformers`` causal LM's decoder layers (llama, phi3, qwen2, olmoe,
mixtral: whatever AutoModelForCausalLM loads with ``model.model.{embed_tokens, layers, norm, rotary_emb}``).

The layers are driven the way m2r2_mlx drives mlx-lm's: each decoder layer is called as it is, with a cache
object of our own. Every transformers attention hands its rotated keys and values to ``cache.update(k, v,
layer_idx)`` and attends over what that returns, so the cache is where M2R2's attention pattern goes in:

- slow pass: ``RecordKV`` keeps each layer's keys/values and returns them unchanged (causal self-attention);
- fast stream: ``ParallelKV`` returns [slow keys of all T positions | the fast stream's own keys], and the
  boolean mask ``parallel_mask`` (T, 2T) lets fast query t read slow keys < t and its own fast key at t:
  m2r2_mlx.core.fast_stream.ParallelKV, the training-time twin of decoding's SlowKVView.

Neither the attention code nor the attention function is replaced, so every architecture's own projections,
q/k norms (olmoe), fused qkv (phi3), biases (qwen2) and experts (olmoe, mixtral) run as transformers wrote them.
The mask is a boolean (B, 1, T, 2T) tensor, which transformers' "sdpa" attention passes to
torch.nn.functional.scaled_dot_product_attention (the base is loaded with attn_implementation="sdpa").
"""

from __future__ import annotations

import inspect

from m2r2_mlx.errors import M2R2Error

import torch
from torch import nn

from .modules import LoRASwitch, M2R2Adapters


class RecordKV:
    """The slow pass's cache: keeps every layer's keys and values, returns them as given."""

    def __init__(self):
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, keys, values, layer_idx, *args, **kwargs):
        self.kv[layer_idx] = (keys, values)
        return keys, values


class ParallelKV:
    """The fast stream's cache: [slow keys of all T positions | the fast stream's keys], stored nowhere."""

    def __init__(self, kv: list[tuple[torch.Tensor, torch.Tensor]]):
        self.kv = kv

    def update(self, keys, values, layer_idx, *args, **kwargs):
        slow_k, slow_v = self.kv[layer_idx]
        return torch.cat([slow_k, keys], dim=2), torch.cat([slow_v, values], dim=2)


def causal_mask(T: int, device=None) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]


def parallel_mask(T: int, device=None) -> torch.Tensor:
    """(1, 1, T, 2T): fast query t reads slow keys j < t and its own fast key j == t."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    return torch.cat([j < i, j == i], dim=1)[None, None]


def shift_right(x: torch.Tensor) -> torch.Tensor:
    """Each position's previous entry along the sequence axis (B, T, ...), zeros at a row's start."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


def _cache_keyword(layer) -> str:
    """What this transformers version calls a decoder layer's cache argument."""
    params = inspect.signature(type(layer).forward).parameters
    for name in ("cache", "past_key_values", "past_key_value"):
        if name in params:
            return name
    raise M2R2Error(f"{type(layer).__name__}.forward takes no cache argument; M2R2 needs one to share keys/values")


class HFParts:
    """Uniform access to a transformers causal LM's parts (m2r2_mlx.models.base_model.BaseParts' twin)."""

    def __init__(self, model):
        inner = getattr(model, "model", None)
        missing = [p for p in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(inner, p)]
        if missing or not hasattr(model, "lm_head"):
            raise M2R2Error(
                f"{type(model).__name__} has no model.{'/'.join(missing) or 'lm_head'}; M2R2 needs a decoder with "
                "embed_tokens, layers, norm, rotary_emb and lm_head (llama, phi3, qwen2, olmoe, mixtral, ...)"
            )
        self.model, self.inner = model, inner
        self.cache_keyword = _cache_keyword(inner.layers[0])

    @property
    def layers(self):
        return self.inner.layers

    @property
    def num_layers(self) -> int:
        return len(self.inner.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(ids)

    def positions(self, h: torch.Tensor):
        """Rotary (cos, sin) and position ids of positions 0..T-1 of ``h`` (B, T, D)."""
        pos = torch.arange(h.shape[1], device=h.device)[None]
        return self.inner.rotary_emb(h, pos), pos

    def layer(self, i: int, h, mask, positions, cache) -> torch.Tensor:
        rope, pos = positions
        out = self.layers[i](
            h, attention_mask=mask, position_ids=pos, position_embeddings=rope, **{self.cache_keyword: cache}
        )
        return out[0] if isinstance(out, tuple) else out  # transformers < 5 returns a tuple

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: the base model's exit, applied to any residual state."""
        return self.model.lm_head(self.inner.norm(h))

    def head_rows(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits over a subset of the vocabulary only (``rows``): the LM head's cost shrinks with it."""
        return self.inner.norm(h) @ self.model.lm_head.weight[rows].T


class M2R2Torch(nn.Module):
    """The fast stream: ``m2r2`` (M2R2Adapters, the only parameters) over a frozen transformers base.

    ``forward`` is ``fast_states``, so that DistributedDataParallel can wrap this module; the base is not a
    submodule (a plain attribute), so neither state_dict() nor DDP sees its weights.
    """

    def __init__(self, base, config, m2r2: M2R2Adapters | None = None):
        super().__init__()
        object.__setattr__(self, "parts", HFParts(base))
        self.config = config
        if (config.num_layers, config.hidden_size) != (self.parts.num_layers, self.parts.hidden_size):
            raise M2R2Error(
                f"adapters for {config.num_layers} layers of width {config.hidden_size} do not fit this base "
                f"({self.parts.num_layers} layers of width {self.parts.hidden_size})"
            )
        self.m2r2 = m2r2 if m2r2 is not None else M2R2Adapters.from_config(config, self.parts.layers)
        object.__setattr__(self, "lora_switch", LoRASwitch(self.parts.layers, self.m2r2.lora))

    @property
    def base(self):
        return self.parts.model

    def fast_layers(self, h, start: int, stop: int, mask, positions, cache) -> torch.Tensor:
        adapters = self.m2r2.adapters
        with self.lora_switch.active(start, stop):  # LoRA deltas exist only inside this block
            for i in range(start, stop):
                out = self.parts.layer(i, h, mask, positions, cache)
                h = out + adapters[i](h) if len(adapters) else out
        return h

    def start_state(self, gate_index: int, h_start, h_prev):
        """The fast stream's state entering interval ``gate_index`` (with a context feature, the first interval
        adds the projected final residual of each token's previous position, ``h_prev``)."""
        if gate_index == 0 and h_prev is not None and self.m2r2.context is not None:
            return h_start + self.m2r2.context(h_prev)
        return h_start

    @torch.no_grad()
    def slow_pass(self, ids: torch.Tensor, *, need_kv: bool = True):
        """Frozen base over whole sequences (B, T): slow states at g_0 and every gate (and, with a context feature,
        under "prev" each position's previous final state), the final state (before the final norm), K/V."""
        parts, gates = self.parts, set(self.config.gates)
        h = parts.embed(ids)
        positions = parts.positions(h)
        mask = causal_mask(ids.shape[1], ids.device)
        record = RecordKV()
        states = {0: h}
        for i in range(parts.num_layers):
            h = parts.layer(i, h, mask, positions, record)
            if i + 1 in gates:
                states[i + 1] = h
        if self.m2r2.context is not None:
            states["prev"] = shift_right(h)
        kv = [record.kv[i] for i in range(parts.num_layers)] if need_kv else None
        return states, h, kv

    def forward(self, states: dict, kv, gate_indices=None) -> list[torch.Tensor]:
        return self.fast_states(states, kv, gate_indices)

    def fast_states(self, states: dict, kv, gate_indices=None) -> list[torch.Tensor]:
        """Fast-stream state at every gate (or at the gates ``gate_indices`` names), teacher-forced on the slow
        stream: per interval, one batched pass over whole sequences."""
        h0 = states[0]
        mask = parallel_mask(h0.shape[1], h0.device)
        positions = self.parts.positions(h0)
        cache = ParallelKV(kv)
        intervals = self.config.intervals()
        out = []
        for j in range(len(intervals)) if gate_indices is None else gate_indices:
            start, stop = intervals[j]
            h = self.start_state(j, states[start], states.get("prev"))
            out.append(self.fast_layers(h, start, stop, mask, positions, cache))
        return out
