"""Plain autoregressive decoding: the reference every M2R2 method is measured against.

``generate`` yields one ``TokenEvent`` per token. The loop is mlx-lm's: the
next step's graph is built and handed to ``mx.async_eval`` before the current
token is read back, so Python overhead overlaps with compute.
"""

from __future__ import annotations

import time
from typing import Iterator, Sequence

import mlx.core as mx

from .. import host
from ..tracing import NO_TRACE, Tracer
from .compiled import CompiledSteps
from .config import GenerationConfig
from .events import EventStream, TokenEvent, check_context
from .grammar import Constraint
from .prompt_cache import PromptCache, prefill
from .sampling import NextToken


def start_decoding(
    model, tokenizer, prompt, cache, generation: GenerationConfig, context_length: int | None, keep_states: bool = False
):
    """Shared set-up: the seed, context check, cache reuse and prefill. Returns (cache, logits, events, sample):
    the prompt's last logits, and the answer's NextToken (its sampling law, history and grammar).
    ``keep_states``: the cache keeps each forward's final residual states (PromptCache.states)."""
    if generation.seed is not None:
        mx.random.seed(generation.seed)
    cache = cache if cache is not None else PromptCache(model)
    cache.keep_states, cache.states = keep_states, None
    max_tokens = generation.max_tokens
    if context_length:
        check_context(len(prompt), context_length)
        max_tokens = min(max_tokens, context_length - len(prompt))
    mx.reset_peak_memory()
    tic = time.perf_counter()
    feed = cache.tokens_to_prefill(prompt)
    logits = prefill(cache, feed)
    constraint = None
    if generation.grammar is not None:
        constraint = Constraint(generation.grammar, tokenizer, logits.shape[-1], start=len(prompt))
    layers = len(model.layers)
    events = EventStream(tokenizer, layers, len(prompt), len(feed), max_tokens, tic, generation.logprobs)
    return cache, logits, events, NextToken(generation.sampling, cache.tokens, constraint)


def generate(
    model,
    tokenizer,
    prompt: Sequence[int],
    generation: GenerationConfig | None = None,
    *,
    cache: PromptCache | None = None,
    context_length: int | None = None,
    compiled: bool = False,
    tracer: Tracer = NO_TRACE,
) -> Iterator[TokenEvent]:
    """Decode greedily or by sampling, as mlx-lm does (its sampler and logits processors); one event per token.
    ``compiled``: through CompiledSteps where the cache allows; ``tracer``: the hooks a tool watches through."""
    generation = generation or GenerationConfig()
    cache, logits, events, sample = start_decoding(model, tokenizer, prompt, cache, generation, context_length)
    rows = events.wants_logprobs
    y = tracer.call("sample", sample, logits)
    logprobs = sample.logprobs if rows else None
    mx.async_eval(y, logprobs)
    steps = CompiledSteps.of(model) if compiled and CompiledSteps.supports(cache) else None
    if steps is not None:
        keys, values = steps.begin(cache, events.max_tokens)
        offset, fed = mx.array(len(cache), dtype=mx.int32), []
    try:
        while True:
            next_y = next_logprobs = None
            if events.n + 1 < events.max_tokens:
                if steps is None:
                    logits = cache.forward(y[None])[-1]  # builds the next step before reading y
                else:
                    logits, keys, values = steps(y[None], offset, keys, values)
                    offset = offset + 1
                    fed.append(y)
                if sample.constraint is not None:  # the forward runs while the grammar reads y
                    mx.async_eval(logits)
                sample.feed(y[None])
                next_y = tracer.call("sample", sample, logits)
                next_logprobs = sample.logprobs if rows else None
                mx.async_eval(next_y, next_logprobs)
            ev = events.event(int(host.read(y)), row=logprobs)
            tracer.on_emit(ev)
            yield ev
            if ev.finish_reason:
                return
            if events.n % 256 == 0:
                mx.clear_cache()
            y, logprobs = next_y, next_logprobs
    finally:  # also when the caller stops early: the cache holds every token fed
        if steps is not None:
            steps.end(cache, keys, values, fed)


class PlainDecoder:
    """The ``plain`` mode: ``generate`` over a loaded model (a Decoder)."""

    name = "plain"
    needs_adapters = False
    note = ""

    def __init__(self, lm, compiled: bool = False, tracer: Tracer = NO_TRACE):
        self.model, self.tokenizer, self.context_length = lm.model, lm.tokenizer, lm.context_length
        self.compiled, self.tracer = compiled, tracer
        self.exit_layers = [lm.num_layers]

    def __call__(
        self, prompt: Sequence[int], cache: PromptCache | None = None, generation: GenerationConfig | None = None
    ) -> Iterator[TokenEvent]:
        return generate(
            self.model,
            self.tokenizer,
            prompt,
            generation,
            cache=cache,
            context_length=self.context_length,
            compiled=self.compiled,
            tracer=self.tracer,
        )
