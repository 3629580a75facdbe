"""Uniform access to the parts of an mlx-lm decoder, without copying its model file.

mlx-lm's decoders (llama, phi3, qwen2, olmoe, mixtral, ...) share one shape:
``model.model.embed_tokens``, ``model.model.layers`` (each called as
``layer(h, mask, cache)``), ``model.model.norm`` and ``lm_head`` or tied
embeddings. M2R2 drives those parts itself to read residual states at the gates.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask

from ..errors import M2R2Error
from .identity import config_hash  # noqa: F401  (re-exported: adapters name a base by it)


class BaseParts:
    def __init__(self, model):
        inner = getattr(model, "model", None)
        missing = [p for p in ("embed_tokens", "layers", "norm") if not hasattr(inner, p)]
        if missing:
            raise M2R2Error(
                f"{type(model).__module__} has no model.{'/'.join(missing)}; M2R2 needs an mlx-lm decoder "
                "with embed_tokens, layers and norm (llama, phi3, qwen2, olmoe, mixtral, ...)"
            )
        self.model = model
        self.inner = inner
        self.tied = bool(getattr(model.args, "tie_word_embeddings", False)) or not hasattr(model, "lm_head")

    @property
    def layers(self):
        return self.inner.layers

    @property
    def num_layers(self) -> int:
        return len(self.inner.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.model.args.hidden_size)

    def embed(self, ids: mx.array) -> mx.array:
        return self.inner.embed_tokens(ids)

    def head(self, h: mx.array) -> mx.array:
        """Final norm + LM head: the base model's exit, applied to any residual state."""
        h = self.inner.norm(h)
        return self.inner.embed_tokens.as_linear(h) if self.tied else self.model.lm_head(h)

    @property
    def head_weight(self) -> mx.array:
        return self.inner.embed_tokens.weight if self.tied else self.model.lm_head.weight

    def head_rows(self, h: mx.array, rows: mx.array) -> mx.array:
        """Logits for a subset of the vocabulary only (``rows``): the LM head's cost shrinks with it."""
        weight = self.head_weight
        if weight.dtype == mx.uint32:  # a quantized head: no cheap row gather, use the full one
            return self.head(h)[..., rows]
        return self.inner.norm(h) @ weight[rows].T

    def mask(self, h: mx.array, cache) -> mx.array | str | None:
        return create_attention_mask(h, cache)

    def run_layers(self, h, start: int, stop: int, mask, cache=None) -> mx.array:
        for i in range(start, stop):
            h = self.layers[i](h, mask, cache=None if cache is None else cache[i])
        return h


class SubsetHead:
    """Final norm + LM head over a fixed subset of the vocabulary, for decoding one token at a time.

    The subset's rows of the head are gathered once (4,096 of SmolLM2's 49,152: 9 MB of the
    113 MB a full head reads per call), so each call reads only those. Logit k belongs to
    token ``ids[k]``.
    """

    def __init__(self, parts: BaseParts, ids):
        self.parts = parts
        self.ids = mx.array(list(ids))
        self.vocab_size = int(parts.model.args.vocab_size)
        weight = parts.head_weight
        self.weight = None if weight.dtype == mx.uint32 else weight[self.ids]  # quantized: full head, then pick
        if self.weight is not None:
            mx.eval(self.weight)

    def __len__(self) -> int:
        return self.ids.size

    def __call__(self, h: mx.array) -> mx.array:
        if self.weight is None:
            return self.parts.head(h)[..., self.ids]
        return self.parts.inner.norm(h) @ self.weight.T

    def full(self, values: mx.array, fill: float = -mx.inf) -> mx.array:
        """Per-subset-token values spread over the whole vocabulary, ``fill`` elsewhere: -inf for logits
        (a distribution on the subset), 0 for probabilities."""
        out = mx.full((self.vocab_size,), fill, dtype=values.dtype)
        out[self.ids] = values.reshape(-1)
        return out
