"""Plain greedy decoding's answer checked rather than decoded again: one forward over the prompt and an answer
reads the full model's choice at every position, so a test that only needs to know an engine's answer is plain
greedy's pays one forward instead of a decode of its length (on this CPU, 48 tokens: about 1 s instead of 5.5 s).

Where exactness itself is the claim (tests/test_speculative.py and the lossless tests beside it) the tests decode
plain greedy's answer and compare token for token; this check is for tests about something else (what a long-lived
engine chooses, how fast it drafts) that also keep an eye on the answer."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

# one forward over many positions and a token-by-token decode sum in different orders: their float32 logits differ
# by ~1e-5, so a chosen token this close to the best is a tie either decode could have broken either way
TIE = 1e-4


def plain_greedy_divergence(lm, prompt: list[int], tokens: list[int], max_tokens: int) -> str | None:
    """Where ``tokens`` stops being plain greedy decoding's answer to ``prompt`` (None: it is that answer)."""
    logits = lm.model(mx.array([list(prompt) + list(tokens[:-1])]))[0, len(prompt) - 1 :].astype(mx.float32)
    chosen = mx.take_along_axis(logits, mx.array(tokens)[:, None], axis=-1)[:, 0]
    gaps = np.array(mx.max(logits, axis=-1) - chosen)
    if (gaps > TIE).any():
        i = int(np.argmax(gaps > TIE))
        return f"token {i} ({tokens[i]}) is {gaps[i]:.4f} below the best logit"
    ends = [i for i, t in enumerate(tokens) if t in lm.tokenizer.eos_token_ids]
    if ends and ends[0] != len(tokens) - 1:
        return f"the answer goes on after its end token at {ends[0]}"
    if not ends and len(tokens) != max_tokens:
        return f"{len(tokens)} tokens without an end token, fewer than max_tokens={max_tokens}"
    return None
