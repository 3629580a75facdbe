"""Every token of a conversation so far, kept where a drafter can search it without copying."""

from __future__ import annotations

from typing import Iterable

import numpy as np


class TokenHistory:
    """A growing int32 buffer: appends are amortized O(1) and ``view`` copies nothing. Prompt lookup searches the
    whole context every step (and after every plain token); rebuilding an array from a token list each time cost
    0.15 ms at 4,000 tokens, a few percent of an accelerator's decode step."""

    def __init__(self, tokens: Iterable[int] = ()):
        self._buffer = np.zeros(256, np.int32)
        self._n = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return self._n

    def append(self, token: int) -> None:
        self._reserve(1)
        self._buffer[self._n] = token
        self._n += 1

    def extend(self, tokens: Iterable[int]) -> None:
        tokens = np.fromiter(tokens, np.int32) if not isinstance(tokens, np.ndarray) else tokens
        self._reserve(len(tokens))
        self._buffer[self._n : self._n + len(tokens)] = tokens
        self._n += len(tokens)

    def _reserve(self, more: int) -> None:
        size = len(self._buffer)
        while size < self._n + more:
            size *= 2
        if size > len(self._buffer):  # a new buffer: views already handed out keep the old one, unchanged
            self._buffer = np.concatenate([self._buffer, np.zeros(size - len(self._buffer), np.int32)])

    def view(self) -> np.ndarray:
        """The tokens so far, without a copy (tokens are only ever added, so later appends leave it as it is)."""
        return self._buffer[: self._n]

    @property
    def last(self) -> int:
        return int(self._buffer[self._n - 1])
