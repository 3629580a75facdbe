"""What every decoding method yields: one ``TokenEvent`` per token, made by an ``EventStream`` so that every
method's text pieces, timings and finish reasons agree.

An event holds what every method has (the token, its text, the finish reason, log-probabilities, timings) and,
where the method has one, its own record: ``spec`` (a speculative step: the drafter an accepted draft came from,
the step's plan) or ``exit`` (early exit: the layer the token left at, the compute spent).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx

from ..errors import M2R2Error


@dataclass(frozen=True)
class Timing:
    prompt_tokens: int  # tokens in the whole prompt
    prefill_tokens: int  # of those, how many were computed (the rest came from the cache)
    prompt_time_s: float  # the prefill and the first token
    token_time_s: float  # wall time since the previous event
    elapsed_s: float  # wall time since the first token
    peak_memory_gb: float


@dataclass(frozen=True)
class LogProbs:
    """The log-probabilities a token was picked from (``row`` (V,): the full model's in lossless methods, the exit
    layer's in early exit; after the grammar's mask and a repetition penalty, before temperature and top-p). The
    token's own and the ``top_n`` most likely tokens' are read from the device when first asked for."""

    row: mx.array
    token: int
    top_n: int

    @cached_property
    def logprob(self) -> float:
        return self.row[self.token].item()

    @cached_property
    def top(self) -> tuple[tuple[int, float], ...]:
        """The ``top_n`` most likely tokens' (token, log-probability), best first (those a grammar forbids, at
        -inf, left out)."""
        if self.top_n <= 0:
            return ()
        best = mx.argpartition(-self.row, self.top_n - 1)[: self.top_n]
        pairs = sorted(zip(best.tolist(), self.row[best].tolist()), key=lambda p: -p[1])
        return tuple((t, v) for t, v in pairs if v > -float("inf"))


@dataclass(frozen=True)
class SpecStep:
    """A speculative step's share of a token: ``source``, the drafter of an accepted draft (None: the full model's
    own token); ``layers``, the layers that drafted it; ``plan``, what the step verified ("lookup 4 + fast 1",
    "plain")."""

    source: str | None
    layers: int
    plan: str


@dataclass(frozen=True)
class ExitStep:
    """Early exit's share of a token: the layer count its prediction used, and the compute since the previous
    event: layer calls (each reads its weights once, whatever the chunk) and token-layers (the arithmetic,
    deferred fills included)."""

    layer: int
    layer_passes: int
    token_layers: int


@dataclass
class TokenEvent:
    token: int
    text: str  # the new piece of text (may be "" while a multi-byte character is pending)
    index: int  # position in the answer, 0-based
    num_layers: int  # the model's
    timing: Timing
    finish_reason: str | None = None  # "stop" (end of sequence, a stop string) or "length" on the last event
    eos: bool = False  # the end-of-sequence token itself (text is "")
    logprobs: LogProbs | None = None  # with GenerationConfig.logprobs
    spec: SpecStep | None = None
    exit: ExitStep | None = None

    @property
    def exit_layer(self) -> int:
        """The layers this token's prediction used: the exit layer, a draft's layers, else the whole model."""
        if self.exit is not None:
            return self.exit.layer
        return self.spec.layers if self.drafted else self.num_layers

    @property
    def drafted(self) -> bool:
        """Came from an accepted draft."""
        return self.spec is not None and self.spec.source is not None

    @property
    def logprob(self) -> float | None:
        return None if self.logprobs is None else self.logprobs.logprob

    @property
    def top_logprobs(self) -> tuple[tuple[int, float], ...]:
        return () if self.logprobs is None else self.logprobs.top


def check_context(prompt_len: int, context_length: int) -> None:
    if prompt_len >= context_length:
        raise M2R2Error(
            f"the prompt is {prompt_len} tokens but the model's context holds {context_length}; "
            "shorten it or start a new conversation (/reset)"
        )


class EventStream:
    """Turns decoded token ids into TokenEvents: text pieces, timings, finish reasons. Shared by every method so
    that their events and statistics agree."""

    def __init__(
        self,
        tokenizer,
        num_layers: int,
        prompt_len: int,
        prefill_len: int,
        max_tokens: int,
        tic: float,
        top_logprobs: int | None = None,
    ):
        self.top_logprobs = top_logprobs  # None: no log-probabilities; else how many top tokens each event lists
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.eos_ids = set(tokenizer.eos_token_ids)
        self.num_layers, self.prompt_len, self.prefill_len = num_layers, prompt_len, prefill_len
        self.max_tokens, self.tic = max_tokens, tic
        self.n = 0
        self.prompt_time = self.first = self.last = 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None

    def finishes(self, token: int) -> bool:
        """Whether ``token``'s event will be the answer's last."""
        return token in self.eos_ids or self.n + 1 >= self.max_tokens

    def event(
        self,
        token: int,
        *,
        row: mx.array | None = None,
        spec: SpecStep | None = None,
        exit: ExitStep | None = None,
    ) -> TokenEvent:
        """``row``: the log-probabilities the token was picked from (read when the stream reports them)."""
        now = time.perf_counter()
        if self.n == 0:
            self.prompt_time, self.first, self.last = now - self.tic, now, now
        eos, last = token in self.eos_ids, self.finishes(token)
        if not eos:
            self.detok.add_token(token)
        if last:
            self.detok.finalize()
        timing = Timing(
            self.prompt_len,
            self.prefill_len,
            self.prompt_time,
            now - self.last,
            now - self.first,
            mx.get_peak_memory() / 1e9,
        )
        ev = TokenEvent(
            token=token,
            text=self.detok.last_segment,
            index=self.n,
            num_layers=self.num_layers,
            timing=timing,
            finish_reason="stop" if eos else ("length" if last else None),
            eos=eos,
            logprobs=None if self.top_logprobs is None or row is None else LogProbs(row, token, self.top_logprobs),
            spec=spec,
            exit=exit,
        )
        self.n += 1
        self.last = now
        return ev
