"""Plain autoregressive decoding: the reference every M2R2 method is measured against.

``generate`` yields one ``TokenEvent`` per token. The loop is mlx-lm's: the
next step's graph is built and handed to ``mx.async_eval`` before the current
token is read back, so Python overhead overlaps with compute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ..errors import M2R2Error
from ..models.base_model import BaseParts
from .sampling import NextToken, Sampling
from .tree import DraftTree, keep_positions, tree_positions

PREFILL_CHUNK = 512


@dataclass
class TokenEvent:
    token: int
    text: str  # the new piece of text (may be "" while a multi-byte character is pending)
    index: int  # position in the answer, 0-based
    exit_layer: int  # layers this token's prediction used (num_layers for plain decoding)
    num_layers: int
    drafted: bool  # came from an accepted draft (speculative decoding)
    prompt_tokens: int  # tokens in the whole prompt
    prefill_tokens: int  # of those, how many were computed (the rest came from the cache)
    prompt_time_s: float
    token_time_s: float  # wall time since the previous event
    elapsed_s: float  # wall time since the first token
    peak_memory_gb: float
    finish_reason: str | None = None  # "stop" (end of sequence) or "length" on the last event
    eos: bool = False  # the end-of-sequence token itself (text is "")
    source: str | None = None  # for an accepted draft: the drafter it came from ("lookup", "fast", "layerskip")
    plan: str = ""  # speculative decoding: what the engine chose for this token's step (e.g. "lookup 4 + fast 1")


KV_GROUP_SIZE = 64  # mlx-lm's default group for a quantized KV cache


class PromptCache:
    """The model's KV cache together with the exact token ids it holds.

    Knowing the tokens lets a new prompt reuse the longest common prefix: only the
    rest is prefilled, and a divergent tail (an edited or regenerated turn) is trimmed.
    """

    def __init__(self, model, max_kv_size: int | None = None, kv_bits: int | None = None):
        self.model = model
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
        """A copy: a caller's history must not grow with the cache's next forward."""
        self._tokens = [t if isinstance(t, int) else int(t.item()) for t in self._tokens]
        return list(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    @cached_property
    def parts(self) -> BaseParts:
        """The model's embedding, layers and head, for the state-keeping forward (built once, when first needed)."""
        return BaseParts(self.model)

    def record(self, token: int) -> None:
        """Note a token whose K/V a strategy writes into ``layers`` itself (early exit's layer-by-layer walk)."""
        self._tokens.append(token)

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

    def forward_tree(self, tree: DraftTree) -> mx.array:
        """Run the model on a draft tree's nodes at the end of the cache (tree.py); returns logits (N, vocab).
        The cache holds all N positions until ``commit`` keeps the accepted path."""
        if tree.is_chain:
            return self.forward(tree.tokens)
        offset = len(self)
        self._tokens.extend(tree.tokens)
        parts = self.parts
        with tree_positions(parts.layers, tree.depths):
            h = parts.run_layers(
                parts.embed(mx.array(tree.tokens)[None]), 0, parts.num_layers, tree.mask(offset), self.layers
            )
        self.states = h[0] if self.keep_states else None
        return parts.head(h)[0]

    def commit(self, path: Sequence[int], total: int) -> None:
        """After ``forward_tree`` over ``total`` nodes: keep the nodes of ``path`` (increasing), as if decoded alone."""
        start = len(self) - total
        for layer in self.layers:
            keep_positions(layer, start, path, total)
        self._tokens[start:] = [self._tokens[start + i] for i in path]
        if self.states is not None:
            self.states = self.states[mx.array(list(path))]

    def forward(self, tokens: Sequence[int] | mx.array) -> mx.array:
        """Run the model on new tokens at the end of the cache; returns logits (T, vocab)."""
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


def check_context(prompt_len: int, context_length: int) -> None:
    if prompt_len >= context_length:
        raise M2R2Error(
            f"the prompt is {prompt_len} tokens but the model's context holds {context_length}; "
            "shorten it or start a new conversation (/reset)"
        )


class EventStream:
    """Turns decoded token ids into TokenEvents: text pieces, timings, finish reasons.

    Shared by every decoding strategy so that their events and statistics agree.
    """

    def __init__(self, tokenizer, num_layers: int, prompt_len: int, prefill_len: int, max_tokens: int, tic: float):
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.eos_ids = set(tokenizer.eos_token_ids)
        self.num_layers, self.prompt_len, self.prefill_len = num_layers, prompt_len, prefill_len
        self.max_tokens, self.tic = max_tokens, tic
        self.n = 0
        self.prompt_time = self.first = self.last = 0.0

    @property
    def done(self) -> bool:
        return self.n >= self.max_tokens

    def event(
        self,
        token: int,
        exit_layer: int | None = None,
        drafted: bool = False,
        source: str | None = None,
        plan: str = "",
    ) -> TokenEvent:
        now = time.perf_counter()
        if self.n == 0:
            self.prompt_time, self.first, self.last = now - self.tic, now, now
        eos = token in self.eos_ids
        if not eos:
            self.detok.add_token(token)
        last = eos or self.n + 1 == self.max_tokens
        if last:
            self.detok.finalize()
        ev = TokenEvent(
            token=token,
            text=self.detok.last_segment,
            index=self.n,
            exit_layer=self.num_layers if exit_layer is None else exit_layer,
            num_layers=self.num_layers,
            drafted=drafted,
            prompt_tokens=self.prompt_len,
            prefill_tokens=self.prefill_len,
            prompt_time_s=self.prompt_time,
            token_time_s=now - self.last,
            elapsed_s=now - self.first,
            peak_memory_gb=mx.get_peak_memory() / 1e9,
            finish_reason="stop" if eos else ("length" if last else None),
            eos=eos,
            source=source,
            plan=plan,
        )
        self.n += 1
        self.last = now
        return ev


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
    fused (docs/compile_step.md). Between answers the arrays are handed back to mlx-lm's KVCache as its storage,
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
        cache._tokens.extend(fed)


def start_decoding(model, tokenizer, prompt, cache, max_tokens, context_length, keep_states: bool = False):
    """Shared set-up: context check, cache reuse and prefill. Returns (cache, logits, events).
    ``keep_states``: the cache keeps each forward's final residual states (PromptCache.states)."""
    cache = cache if cache is not None else PromptCache(model)
    cache.keep_states, cache.states = keep_states, None
    if context_length:
        check_context(len(prompt), context_length)
        max_tokens = min(max_tokens, context_length - len(prompt))
    mx.reset_peak_memory()
    tic = time.perf_counter()
    feed = cache.tokens_to_prefill(prompt)
    logits = prefill(cache, feed)
    events = EventStream(tokenizer, len(model.layers), len(prompt), len(feed), max_tokens, tic)
    return cache, logits, events


def generate(
    model,
    tokenizer,
    prompt: Sequence[int],
    *,
    cache: PromptCache | None = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    repetition_context_size: int = 20,
    seed: int | None = None,
    context_length: int | None = None,
    compiled: bool = False,
) -> Iterator[TokenEvent]:
    """Decode greedily (temperature 0) or by sampling, as mlx-lm does (its sampler and logits processors);
    one event per token. ``compiled``: through CompiledSteps where the cache allows."""
    s = Sampling(temperature, top_p, top_k, min_p, repetition_penalty, repetition_context_size)
    if seed is not None:
        mx.random.seed(seed)
    cache, logits, events = start_decoding(model, tokenizer, prompt, cache, max_tokens, context_length)
    sample = NextToken(s, cache.tokens)

    y = sample(logits)
    mx.async_eval(y)
    steps = CompiledSteps.of(model) if compiled and CompiledSteps.supports(cache) else None
    if steps is not None:
        keys, values = steps.begin(cache, events.max_tokens)
        offset, fed = mx.array(len(cache), dtype=mx.int32), []
    try:
        while True:
            next_y = None
            if events.n + 1 < events.max_tokens:
                sample.feed(y[None])
                if steps is None:
                    logits = cache.forward(y[None])[-1]  # builds the next step before reading y
                else:
                    logits, keys, values = steps(y[None], offset, keys, values)
                    offset = offset + 1
                    fed.append(y)
                next_y = sample(logits)
                mx.async_eval(next_y)
            ev = events.event(y.item())
            yield ev
            if ev.finish_reason:
                return
            if events.n % 256 == 0:
                mx.clear_cache()
            y = next_y
    finally:  # also when the caller stops early: the cache holds every token fed
        if steps is not None:
            steps.end(cache, keys, values, fed)
