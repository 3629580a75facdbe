"""Lossless self-speculative decoding: the M2R2 fast stream drafts, the full model verifies.

One round, with y the last token (sampled, not yet in the cache):
1. draft up to K tokens with the fast stream exiting at a gate g; each draft step
   runs only layers < g and writes provisional K/V there; stop early when the
   draft's probability falls below ``threshold`` (Kangaroo-style);
2. trim the provisional entries, run the full model once on [y, d_1..d_K];
3. greedy: accept the longest prefix of drafts the full model agrees with, then
   emit the full model's own next token; trim the rejected positions.
The output is the full model's greedy output, token for token.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import mlx.core as mx

from .generate import PromptCache, TokenEvent, start_decoding


def speculative_generate(
    m2r2,
    tokenizer,
    prompt: Sequence[int],
    *,
    cache: PromptCache | None = None,
    max_tokens: int = 256,
    gate_index: int = 0,
    max_draft: int = 6,
    threshold: float = 0.0,
    context_length: int | None = None,
    stats: dict | None = None,
) -> Iterator[TokenEvent]:
    """Greedy self-speculative decoding; ``stats`` (if given) collects accepted lengths per round."""
    model = m2r2.base
    cache, logits, events = start_decoding(model, tokenizer, prompt, cache, max_tokens, context_length)
    _, gate = m2r2.config.intervals()[gate_index]
    y = int(mx.argmax(logits).item())
    ev = events.event(y)
    yield ev
    accepted_lengths = [] if stats is None else stats.setdefault("accepted", [])
    while not ev.finish_reason:
        budget = events.max_tokens - events.n  # tokens still allowed, the verifier's own included
        drafts: list[int] = []
        cur = y
        while len(drafts) < min(max_draft, budget - 1):
            probs = mx.softmax(m2r2.draft_logits(mx.array(cur), gate_index, cache.layers).astype(mx.float32))
            d = mx.argmax(probs)
            d, conf = d.item(), probs[d].item()
            drafts.append(d)
            cur = d
            if conf < threshold or d in events.eos_ids:
                break
        for layer in cache.layers[:gate]:  # drop the provisional K/V of the drafted positions
            layer.trim(len(drafts))
        targets = mx.argmax(cache.forward([y] + drafts), axis=-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == targets[a]:
            a += 1
        cache.trim(len(drafts) - a)
        accepted_lengths.append(a + 1)  # tokens this verification step produced
        for t in drafts[:a]:
            ev = events.event(t, exit_layer=gate, drafted=True)
            yield ev
            if ev.finish_reason:
                return
        y = targets[a]
        ev = events.event(y)
        yield ev
