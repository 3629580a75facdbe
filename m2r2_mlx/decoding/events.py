"""What every decoding strategy yields: one ``TokenEvent`` per token, made by an ``EventStream`` so that every
strategy's text pieces, timings and finish reasons agree."""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from ..errors import M2R2Error


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
    # early exit's compute since the previous event: layer calls (each reads its weights once, whatever the chunk)
    # and token-layers (the arithmetic, deferred fills included)
    layer_passes: int = 0
    token_layers: int = 0
    # with GenerationConfig.logprobs: the token's log-probability under the distribution it was picked from (the
    # full model's in lossless modes, the exit layer's in early exit; after the grammar's mask and a repetition
    # penalty, before temperature and top-p), and the most likely tokens' (token, log-probability), best first
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def check_context(prompt_len: int, context_length: int) -> None:
    if prompt_len >= context_length:
        raise M2R2Error(
            f"the prompt is {prompt_len} tokens but the model's context holds {context_length}; "
            "shorten it or start a new conversation (/reset)"
        )


def read_logprobs(logprobs: mx.array, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """``token``'s log-probability in ``logprobs`` and the ``top`` most likely tokens' (those the grammar
    forbids, at -inf, left out)."""
    row = logprobs.reshape(-1).astype(mx.float32)
    if top <= 0:
        return row[token].item(), ()
    best = mx.argpartition(-row, top - 1)[:top]
    values = row[best]
    pairs = sorted(zip(best.tolist(), values.tolist()), key=lambda p: -p[1])
    return row[token].item(), tuple((t, v) for t, v in pairs if v > -float("inf"))


class EventStream:
    """Turns decoded token ids into TokenEvents: text pieces, timings, finish reasons.

    Shared by every decoding strategy so that their events and statistics agree.
    """

    def __init__(
        self,
        tokenizer,
        num_layers: int,
        prompt_len: int,
        prefill_len: int,
        max_tokens: int,
        tic: float,
        logprobs: int | None = None,
    ):
        self.logprobs = logprobs  # None: no log-probabilities; else how many top tokens each event lists
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
        logprobs: mx.array | None = None,
    ) -> TokenEvent:
        """``logprobs``: the log-probabilities the token was picked from (read when the stream reports them)."""
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
        if self.logprobs is not None and logprobs is not None:
            ev.logprob, ev.top_logprobs = read_logprobs(logprobs, token, self.logprobs)
        self.n += 1
        self.last = now
        return ev
