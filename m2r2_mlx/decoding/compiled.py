"""Plain decoding's one-token step compiled with mx.compile over a preallocated KV cache (``--compile``)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..models.base_model import BaseParts
from .prompt_cache import PromptCache


class SlotKV:
    """One layer's keys and values in preallocated (B, heads, capacity, dim) arrays, written at ``offset`` (an
    int32 array, so the step's graph does not depend on the position); positions past it are masked."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        start = self.offset.reshape(1)
        self.keys = mx.slice_update(self.keys, keys, start, axes=(2,))
        self.values = mx.slice_update(self.values, values, start, axes=(2,))
        return self.keys, self.values


class CompiledSteps:
    """One-token decode steps compiled with mx.compile over preallocated keys and values: the graph is traced
    once per capacity (a multiple of 256 positions) instead of rebuilt every token, and its elementwise work is
    fused (docs/benchmarks.md). Between answers the arrays are handed back to mlx-lm's KVCache as its storage,
    so a chat's next turn reuses them as the eager loop's would."""

    CAPACITY_STEP = 256

    def __init__(self, parts: BaseParts):
        self.parts, self.traced = parts, {}

    @staticmethod
    def of(model) -> "CompiledSteps":
        """The model's own (its traces live as long as it does)."""
        if getattr(model, "_m2r2_compiled_steps", None) is None:
            model._m2r2_compiled_steps = CompiledSteps(BaseParts(model))
        return model._m2r2_compiled_steps

    @staticmethod
    def supports(cache: PromptCache) -> bool:
        """Plain KV caches only: a rotating or quantized cache (--max-kv-size, --kv-bits) keeps the eager loop."""
        return all(type(c) is KVCache for c in cache.layers) and not cache.keep_states

    def _step(self, capacity: int):
        if capacity not in self.traced:
            parts = self.parts

            def step(token, offset, keys, values):
                caches = [SlotKV(k, v, offset) for k, v in zip(keys, values)]
                mask = mx.arange(capacity)[None, :] <= offset
                h = parts.run_layers(parts.embed(token[None]), 0, parts.num_layers, mask, caches)
                return parts.head(h)[0, -1], [c.keys for c in caches], [c.values for c in caches]

            self.traced[capacity] = mx.compile(step)
        return self.traced[capacity]

    def begin(self, cache: PromptCache, new_tokens: int) -> tuple[list, list]:
        """The cache's keys and values in arrays that hold ``new_tokens`` more positions."""
        need = len(cache) + new_tokens
        capacity = self.CAPACITY_STEP * -(-need // self.CAPACITY_STEP)
        keys, values = [], []
        for layer in cache.layers:
            if layer.keys.shape[2] >= capacity:
                keys.append(layer.keys)
                values.append(layer.values)
                continue
            k = mx.zeros((*layer.keys.shape[:2], capacity, layer.keys.shape[3]), layer.keys.dtype)
            v = mx.zeros((*layer.values.shape[:2], capacity, layer.values.shape[3]), layer.values.dtype)
            k[..., : layer.offset, :] = layer.keys[..., : layer.offset, :]
            v[..., : layer.offset, :] = layer.values[..., : layer.offset, :]
            keys.append(k)
            values.append(v)
        return keys, values

    def __call__(self, token: mx.array, offset: mx.array, keys: list, values: list):
        return self._step(keys[0].shape[2])(token, offset, keys, values)

    @staticmethod
    def end(cache: PromptCache, keys: list, values: list, fed: list) -> None:
        """Hand the arrays back to the cache, holding the ``fed`` tokens' positions after the prompt's."""
        for layer, k, v in zip(cache.layers, keys, values):
            layer.keys, layer.values = k, v
            layer.offset += len(fed)
        cache.record(*fed)
