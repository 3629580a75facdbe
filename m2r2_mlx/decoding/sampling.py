"""Token distributions and the verification rule of speculative decoding.

The target distribution is exactly what plain sampling draws from, built from mlx-lm's own pieces: the logits
processors (repetition penalty, over the last tokens of the sequence) on the raw logits, log-probabilities,
then the sampler's filters in its order (top-p, min-p, top-k) and the temperature. Speculative sampling
therefore reproduces plain sampling's distribution, not a variant, and greedy speculative decoding takes the
argmax of the same processed logits as greedy plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler

from .. import host
from ..errors import check, is_int, is_number

if TYPE_CHECKING:
    from .grammar import Constraint


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    repetition_context_size: int = 20  # mlx-lm's default

    def __post_init__(self):
        check(
            self,
            {
                "temperature": (
                    is_number(self.temperature) and self.temperature >= 0,
                    "must be 0 (greedy) or positive",
                ),
                "top_p": (is_number(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
                "top_k": (is_int(self.top_k) and self.top_k >= 0, "must be 0 (off) or a positive count"),
                "min_p": (is_number(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1]"),
                "repetition_penalty": (
                    is_number(self.repetition_penalty) and self.repetition_penalty > 0,
                    "must be positive (1 = off)",
                ),
                "repetition_context_size": (
                    is_int(self.repetition_context_size) and self.repetition_context_size >= 1,
                    "must be at least 1",
                ),
            },
        )

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def reads_history(self) -> bool:
        """The target distribution depends on the tokens before it (a repetition penalty)."""
        return self.repetition_penalty != 1.0

    def processors(self) -> list:
        """mlx-lm's logits processors for these options: what plain decoding applies to the raw logits."""
        if not self.reads_history:
            return []
        return make_logits_processors(
            repetition_penalty=self.repetition_penalty, repetition_context_size=self.repetition_context_size
        )

    def sampler(self):
        """mlx-lm's sampler for these options (argmax when greedy)."""
        return make_sampler(
            temp=self.temperature, top_p=self.top_p if self.top_p < 1 else 0.0, min_p=self.min_p, top_k=self.top_k
        )


class NextToken:
    """Plain decoding's next token, lazily (nothing is evaluated): the grammar's mask (``constraint``), mlx-lm's
    logits processors over the sequence so far (only its last ``repetition_context_size`` tokens, all they read),
    then mlx-lm's sampler. ``logprobs``: the last call's log-probabilities (what was sampled from, before the
    sampler's temperature and filters), built only when asked for."""

    def __init__(self, s: Sampling, history: Sequence[int], constraint: Constraint | None = None):
        self.sampler, self.processors, self.size = s.sampler(), s.processors(), s.repetition_context_size
        recent = np.asarray(history[-self.size :] if len(history) else [], np.int32)
        self.history = mx.array(recent) if self.processors else None
        self.constraint = constraint
        self.sequence = [int(t) for t in history] if constraint is not None else None  # what the grammar reads
        self.processed: mx.array | None = None  # the last call's logits after the mask and the processors

    def feed(self, token: mx.array) -> None:
        """``token`` (shape (1,)) joins the sequence; with a grammar it is read (the next mask depends on it)."""
        if self.processors:
            self.history = mx.concatenate([self.history, token.astype(mx.int32)])[-self.size :]
        if self.sequence is not None:
            self.sequence.append(int(host.read(token.reshape(()))))

    def __call__(self, logits: mx.array) -> mx.array:
        """The token after the sequence, from its logits (V,)."""
        if self.constraint is not None:
            logits = self.constraint.at(self.sequence).mask(logits)
        logits = logits[None]
        for process in self.processors:
            logits = process(self.history, logits)
        self.processed = logits
        return self.sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0]

    @property
    def logprobs(self) -> mx.array:
        """The last call's log-probabilities, as reported: in float32, as verification computes them."""
        return processed_logprobs(self.processed, Sampling())


def processed_logprobs(logits: mx.array, s: Sampling, history: Sequence[int] | mx.array = ()) -> mx.array:
    """Log-probabilities (float32, last axis) after the logits processors, for one position whose sequence so far
    is ``history`` (only read with a repetition penalty); ``logits`` (V,) or (1, V)."""
    x = logits.astype(mx.float32).reshape(1, -1)
    if s.reads_history and len(history):
        tokens = history if isinstance(history, mx.array) else mx.array(list(history)[-s.repetition_context_size :])
        for process in s.processors():
            x = process(tokens, x)
    return (x - mx.logsumexp(x, axis=-1, keepdims=True))[0]


def filtered_probs(logprobs: mx.array, s: Sampling) -> mx.array:
    """The distribution the sampler draws from, given processed log-probabilities (last axis)."""
    if 0 < s.top_p < 1:
        logprobs = apply_top_p(logprobs, s.top_p)
    if s.min_p > 0:
        logprobs = apply_min_p(logprobs, s.min_p)
    if 0 < s.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, s.top_k)
    return mx.softmax(logprobs / s.temperature, axis=-1)


def sampling_probs(logits: mx.array, s: Sampling, history: Sequence[int] | mx.array = ()) -> mx.array:
    """Probabilities (float32) that plain sampling with ``s`` draws the next token from; ``logits`` may hold
    several rows (then without history: a repetition penalty needs one row at a time)."""
    if s.reads_history and len(history):
        return filtered_probs(processed_logprobs(logits, s, history), s)
    x = logits.astype(mx.float32)
    return filtered_probs(x - mx.logsumexp(x, axis=-1, keepdims=True), s)


def sample_from(probs: mx.array) -> int:
    return int(host.read(mx.random.categorical(mx.log(probs))))
