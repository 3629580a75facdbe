"""Lossless speculative decoding with a pluggable drafter (see drafters.py).

One round, with y the last token (sampled, not yet in the cache):
1. the drafter proposes up to K tokens (M2R2's fast stream exiting at a gate, the
   slow state's naive exit, or prompt lookup) and leaves the cache as it found it;
2. the full model runs once on [y, d_1..d_K];
3. verification (sampling.verify) accepts a prefix of the drafts and emits the full
   model's own next token; the rejected positions are trimmed from the cache.
Greedy output is the full model's greedy output token for token; sampled output has
the full model's distribution (rejection sampling).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import mlx.core as mx

from .generate import PromptCache, TokenEvent, start_decoding
from .sampling import Sampling, sample_from, sampling_probs, verify


def speculative_generate(
    model,
    tokenizer,
    prompt: Sequence[int],
    drafter,
    *,
    cache: PromptCache | None = None,
    max_tokens: int = 256,
    max_draft: int = 6,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    context_length: int | None = None,
    stats: dict | None = None,
) -> Iterator[TokenEvent]:
    """Draft-and-verify decoding; ``stats`` (if given) collects tokens produced per verification step."""
    if seed is not None:
        mx.random.seed(seed)
    s = Sampling(temperature, top_p)
    cache, logits, events = start_decoding(model, tokenizer, prompt, cache, max_tokens, context_length,
                                           keep_states=drafter.keeps_states)
    y = int(mx.argmax(logits).item()) if s.greedy else sample_from(sampling_probs(logits, s))
    ev = events.event(y)
    yield ev
    accepted_lengths = [] if stats is None else stats.setdefault("accepted", [])
    while not ev.finish_reason:
        budget = events.max_tokens - events.n  # tokens still allowed, the verifier's own included
        drafts, q = drafter.draft(cache, y, min(max_draft, budget - 1), s, events.eos_ids)
        a, y_next = verify(cache.forward([y] + drafts), drafts, q, s)
        cache.trim(len(drafts) - a)
        accepted_lengths.append(a + 1)  # tokens this verification step produced
        for t in drafts[:a]:
            ev = events.event(t, exit_layer=drafter.exit_layer, drafted=True)
            yield ev
            if ev.finish_reason:
                return
        y = y_next
        ev = events.event(y)
        yield ev
