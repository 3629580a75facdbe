"""Token distributions and the verification rule of speculative decoding.

The target distribution is exactly what plain sampling draws from, built from mlx-lm's own pieces: the logit
bias and the logits processors (repetition, presence and frequency penalties, over the last tokens of the
sequence) on the raw logits, log-probabilities, then the sampler's filters in its order (top-p, min-p, top-k) and
the temperature. Speculative sampling therefore reproduces plain sampling's distribution, not a variant, and greedy
speculative decoding takes the argmax of the same processed logits as greedy plain decoding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler

from .. import host
from ..errors import M2R2Error, check, is_int, is_number

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
    presence_penalty: float = 0.0  # 0: off; subtracted once from each token seen in its context
    presence_context_size: int = 20
    frequency_penalty: float = 0.0  # 0: off; subtracted for every time a token was seen in its context
    frequency_context_size: int = 20
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); a mapping is accepted

    def __post_init__(self):
        if isinstance(self.logit_bias, Mapping):  # kept as pairs: the config stays immutable and hashable
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        bias = self.logit_bias
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
                "presence_penalty": (is_number(self.presence_penalty), "must be a finite number (0 = off)"),
                "presence_context_size": (
                    is_int(self.presence_context_size) and self.presence_context_size >= 1,
                    "must be at least 1",
                ),
                "frequency_penalty": (is_number(self.frequency_penalty), "must be a finite number (0 = off)"),
                "frequency_context_size": (
                    is_int(self.frequency_context_size) and self.frequency_context_size >= 1,
                    "must be at least 1",
                ),
                "logit_bias": (
                    isinstance(bias, tuple)
                    and all(
                        isinstance(b, tuple)
                        and len(b) == 2
                        and is_int(b[0])
                        and b[0] >= 0
                        and is_number(b[1])
                        and -100 <= b[1] <= 100
                        for b in bias
                    )
                    and len({b[0] for b in bias}) == len(bias),
                    "must map token ids (0 or more, each once) to numbers from -100 to 100",
                ),
            },
        )
        object.__setattr__(self, "logit_bias", tuple(sorted(bias)))  # one order for equal settings

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def reads_history(self) -> bool:
        """The target distribution depends on the tokens before it (a penalty)."""
        return self.history_size > 0

    @property
    def history_size(self) -> int:
        """How many of the latest tokens the penalties read (0: none is on)."""
        sizes = [
            (self.repetition_penalty != 1.0, self.repetition_context_size),
            (self.presence_penalty != 0.0, self.presence_context_size),
            (self.frequency_penalty != 0.0, self.frequency_context_size),
        ]
        return max((size for on, size in sizes if on), default=0)

    def processors(self) -> list:
        """mlx-lm's logits processors for the penalties: what plain decoding applies to the biased logits."""
        if not self.reads_history:
            return []
        return make_logits_processors(  # a penalty at its neutral value adds no processor
            repetition_penalty=self.repetition_penalty if self.repetition_penalty != 1.0 else None,
            repetition_context_size=self.repetition_context_size,
            presence_penalty=self.presence_penalty,
            presence_context_size=self.presence_context_size,
            frequency_penalty=self.frequency_penalty,
            frequency_context_size=self.frequency_context_size,
        )

    @cached_property
    def _bias_arrays(self) -> tuple[int, mx.array, mx.array]:
        """(the largest id, the ids, the values) of the logit bias, built once per config: it is added every step."""
        ids, values = zip(*self.logit_bias)  # sorted by id
        return ids[-1], mx.array(ids), mx.array(values)

    def biased(self, logits: mx.array) -> mx.array:
        """``logits`` (last axis: the vocabulary) with the logit bias added, as mlx-lm's first logits processor
        does; where a token id is beyond the vocabulary, one line says so."""
        if not self.logit_bias:
            return logits
        largest, ids, values = self._bias_arrays
        if largest >= logits.shape[-1]:
            raise M2R2Error(
                f"logit_bias names token {largest}, beyond the vocabulary ({logits.shape[-1]} tokens); "
                "use ids the model's tokenizer gives"
            )
        return logits.at[..., ids].add(values)

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
        self.sampler, self.processors, self.size, self.biased = s.sampler(), s.processors(), s.history_size, s.biased
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
        logits = self.biased(logits)
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
    """Log-probabilities (float32, last axis) after the penalties, for one position whose sequence so far is
    ``history`` (only read with a penalty); ``logits`` (V,) or (1, V), the logit bias already added."""
    x = logits.astype(mx.float32).reshape(1, -1)
    if s.reads_history and len(history):
        tokens = history if isinstance(history, mx.array) else mx.array(list(history)[-s.history_size :])
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
    """Probabilities (float32) that plain sampling with ``s`` draws the next token from, given logits with the
    logit bias already added (``Sampling.biased``); ``logits`` may hold several rows (then without history: a
    penalty needs one row at a time)."""
    if s.reads_history and len(history):
        return filtered_probs(processed_logprobs(logits, s, history), s)
    x = logits.astype(mx.float32)
    return filtered_probs(x - mx.logsumexp(x, axis=-1, keepdims=True), s)


def sample_from(probs: mx.array) -> int:
    return int(host.read(mx.random.categorical(mx.log(probs))))
