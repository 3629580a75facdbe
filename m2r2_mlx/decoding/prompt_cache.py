"""The model's KV cache together with the token ids it holds, and chunked prefill."""

from __future__ import annotations

from functools import cached_property
from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from .. import host
from ..errors import M2R2Error
from ..models.base_model import BaseParts
from ..tracing import NO_TRACE, Tracer

PREFILL_CHUNK = 512
KV_GROUP_SIZE = 64  # mlx-lm's default group for a quantized KV cache


class PromptCache:
    """The model's KV cache together with the exact token ids it holds.

    Knowing the tokens lets a new prompt reuse the longest common prefix: only the
    rest is prefilled, and a divergent tail (an edited or regenerated turn) is trimmed.
    """

    def __init__(self, model, max_kv_size: int | None = None, kv_bits: int | None = None, tracer: Tracer = NO_TRACE):
        self.model, self.tracer = model, tracer  # every forward runs as a "forward" phase (tracing.py)
        # mlx-lm's KV options: a rotating cache of max_kv_size positions, or keys and values quantized to kv_bits
        self.max_kv_size, self.kv_bits = max_kv_size, kv_bits
        self.layers = self._new_layers()
        # Entries may be lazy 0-d arrays (a sampled token fed back before it is read,
        # so the decode loop never waits); they are resolved on first access.
        self._tokens: list[int | mx.array] = []
        # Keep each forward's final residual states (``states``, (T, D): the final norm's input), for
        # drafters and exit rules that read the previous position's deepest state (a context feature).
        self.keep_states = False
        self.states: mx.array | None = None

    @property
    def tokens(self) -> list[int]:
        """A copy: a caller's history must not grow with the cache's next forward. Tokens fed still on the device
        are read here, all in one read."""
        lazy = [i for i, t in enumerate(self._tokens) if not isinstance(t, int)]
        if lazy:
            for i, t in zip(lazy, host.read(mx.stack([self._tokens[i].reshape(()) for i in lazy]))):
                self._tokens[i] = int(t)
        return list(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    @cached_property
    def parts(self) -> BaseParts:
        """The model's embedding, layers and head, for the state-keeping forward (built once, when first needed)."""
        return BaseParts(self.model)

    def record(self, *tokens: int | mx.array) -> None:
        """Note tokens whose K/V a strategy wrote into ``layers`` itself (early exit's layer-by-layer walk, the
        compiled steps' preallocated arrays)."""
        self._tokens.extend(tokens)

    def trim(self, n: int) -> None:
        if n <= 0:
            return
        if not can_trim_prompt_cache(self.layers):
            raise M2R2Error(
                "this model's KV cache cannot be trimmed (rotating or recurrent cache); /reset the conversation"
            )
        trim_prompt_cache(self.layers, n)
        del self._tokens[-n:]
        # states[-1] stays the last position's: what a drafter reads after verification trimmed the rejected
        self.states = self.states[:-n] if self.states is not None and n < self.states.shape[0] else None

    def _new_layers(self) -> list:
        layers = make_prompt_cache(self.model)
        if self.max_kv_size:  # models with their own make_cache (llama) ignore make_prompt_cache's max_kv_size
            layers = [RotatingKVCache(max_size=self.max_kv_size, keep=4) if type(c) is KVCache else c for c in layers]
        return [c.to_quantized(KV_GROUP_SIZE, self.kv_bits) for c in layers] if self.kv_bits else layers

    def reset(self) -> None:
        self.layers = self._new_layers()
        self._tokens = []
        self.states = None

    def tokens_to_prefill(self, prompt: Sequence[int]) -> list[int]:
        """Trim the cache to its common prefix with ``prompt``; return the tokens still to compute.

        At least one token is always left to compute, since its logits start the answer.
        """
        common = 0
        for a, b in zip(self.tokens, prompt):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt) - 1)
        if len(self.tokens) > common:
            if can_trim_prompt_cache(self.layers):
                self.trim(len(self.tokens) - common)
            else:
                self.reset()
                common = 0
        return list(prompt[common:])

    def forward(self, tokens: Sequence[int] | mx.array) -> mx.array:
        """Run the model on new tokens at the end of the cache; returns logits (T, vocab)."""
        return self.tracer.call("forward", self._forward, tokens)

    def _forward(self, tokens: Sequence[int] | mx.array) -> mx.array:
        if isinstance(tokens, mx.array):
            ids = tokens
            self._tokens.extend(tokens[i] for i in range(tokens.size))
        else:
            ids = mx.array(tokens)
            self._tokens.extend(int(t) for t in tokens)
        if not self.keep_states:
            return self.model(ids[None], cache=self.layers)[0]
        # the model's own forward, split where its final residual shows: the same operations, the same logits
        parts = self.parts
        h = parts.embed(ids[None])
        h = parts.run_layers(h, 0, parts.num_layers, parts.mask(h, self.layers[0]), self.layers)
        self.states = h[0]
        return parts.head(h)[0]


def prefill(cache: PromptCache, tokens: Sequence[int]) -> mx.array:
    """Compute ``tokens`` into the cache in chunks; return the last position's logits."""
    tokens = list(tokens)
    while len(tokens) > PREFILL_CHUNK:
        cache.forward(tokens[:PREFILL_CHUNK])
        mx.eval([c.state for c in cache.layers])
        tokens = tokens[PREFILL_CHUNK:]
    return cache.forward(tokens)[-1]
