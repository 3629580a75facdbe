"""A guard that keeps structured answers out of runaway repetition, so that they finish.

A small model held to a JSON schema can fall into a loop the grammar allows forever: the same array item again and
again (``"Lawn", "Lawn", "Lawn", ...``) or one piece of a string repeated (``"Bakery_Bakery_Bakery_..."``), until
``max_tokens`` cuts the answer as invalid JSON. The guard follows the answer's JSON as it is written and, only
where such a loop has begun, refuses the tokens that would continue it:

- in an array, once the last items repeat (a string, object or array ``REPEATS`` times in a row, a block of 2 to
  ``MAX_PERIOD`` of them ``BLOCK_REPEATS`` times, a number, true, false or null ``LITERAL_REPEATS`` times), the
  separator that would start the next copy is refused, so the array closes (the grammar decides what may come
  instead);
- in a string, once its end repeats a piece of 1 to ``MAX_UNIT`` bytes over at least ``MIN_RUN`` bytes (and 4
  copies), only the closing quote is allowed;
- in a number, once its end repeats 1 to ``MAX_PERIOD`` characters over ``MIN_NUMBER_RUN`` of them
  (``0.10000000000000000``), the number must end.

Where the grammar allows nothing the guard would leave (a ``minItems`` not reached, a ``pattern``), the guard
steps aside. Anywhere else no token is refused, so an answer that does not loop is decoded unchanged, and the
mask depends only on the answer's tokens, so every method (plain, speculative, lookup, early exit) applies the same.
Text outside JSON (before a tool call) is skipped until a ``{`` or ``[`` opens a value.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import numpy as np

REPEATS = 2  # equal strings, objects or arrays in a row that an array may hold
BLOCK_REPEATS = 3  # copies in a row of a block of 2 to MAX_PERIOD items
LITERAL_REPEATS = 8  # equal numbers, true, false or null in a row
MAX_PERIOD = 4  # items in the longest repeated block looked for
MAX_UNIT = 64  # bytes in the longest repeated piece of a string looked for
MIN_RUN = 32  # bytes a string's repetition must cover before it counts as a loop
MIN_NUMBER_RUN = 12  # characters a number's repetition must cover (10**12 is written whole)
NUMBER = b"-+.0123456789eE"
SPACE = b" \t\r\n"


@dataclass(frozen=True)
class _Array:
    """An open array: the spans (start, end) of its last completed items, and where the current item began
    (-1: between items)."""

    items: tuple[tuple[int, int], ...] = ()
    current: int = -1


@dataclass(frozen=True)
class _State:
    """Where the scan stands after some bytes: the open containers (an _Array, or None for an object), the open
    string's first content byte and the number's first character (-1: none)."""

    open: tuple = ()
    string: int = -1
    escaped: bool = False
    number: int = -1


KEEP_ITEMS = MAX_PERIOD * LITERAL_REPEATS  # completed items an array remembers


def _step(state: _State, text: bytes, start: int) -> _State:
    """The state after ``text[start:]``, from ``state`` at ``start``."""
    open_, string, escaped, number = list(state.open), state.string, state.escaped, state.number
    for i in range(start, len(text)):
        c = text[i]
        if string < 0 and open_ and c in NUMBER:
            number = i if number < 0 else number
        else:
            number = -1
        if string >= 0:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:  # the closing quote
                string = -1
            continue
        if not open_:  # outside JSON: wait for a value to open
            if c in b"{[":
                open_.append(_Array() if c == 0x5B else None)
            elif c == 0x22:
                string = i + 1
            continue
        top = open_[-1]
        if isinstance(top, _Array) and top.current < 0 and c not in SPACE and c not in b",]":
            open_[-1] = top = _Array(top.items, i)  # an item begins
        if c == 0x22:
            string = i + 1
        elif c in b"{[":
            open_.append(_Array() if c == 0x5B else None)
        elif c in b"}]":
            open_.pop()
        elif c == 0x2C and isinstance(top, _Array) and top.current >= 0:  # the item ends at its separator
            open_[-1] = _Array((*top.items, (top.current, _trimmed(text, top.current, i)))[-KEEP_ITEMS:])
    return _State(tuple(open_), string, escaped, number)


def _trimmed(text: bytes, start: int, end: int) -> int:
    while end > start and text[end - 1] in SPACE:
        end -= 1
    return end


@functools.lru_cache(maxsize=4)
def _vocabulary(tok, vocab_size: int) -> tuple[list[bytes], np.ndarray, np.ndarray]:
    """Every token's bytes, sorted (for prefix queries), the token id at each sorted position, and which tokens
    begin with a character of a number."""
    pieces = [tok.decode_bytes([t]) for t in range(min(vocab_size, tok.vocab_size))]
    order = sorted(range(len(pieces)), key=pieces.__getitem__)
    numeric = np.zeros(vocab_size, dtype=bool)
    numeric[[t for t, p in enumerate(pieces) if p[:1] and p[0] in NUMBER]] = True
    return [pieces[i] for i in order], np.array(order, dtype=np.int64), numeric


class LoopGuard:
    """The guard over one answer: ``push`` each token's bytes, ``pop`` rejected ones, and ``refused`` says which
    tokens would continue a loop at the current position."""

    def __init__(self, tok, vocab_size: int):
        self.sorted, self.ids, self.numeric = _vocabulary(tok, vocab_size)
        self.vocab_size = vocab_size
        self.text = bytearray()
        self.states = [_State()]  # after each token
        self.ends = [0]  # the text's length after each token

    def push(self, piece: bytes) -> None:
        start = len(self.text)
        self.text += piece
        self.states.append(_step(self.states[-1], self.text, start))
        self.ends.append(len(self.text))

    def pop(self, n: int) -> None:
        if n:
            del self.states[-n:], self.ends[-n:]
            del self.text[self.ends[-1] :]

    def _starting_with(self, prefix: bytes) -> np.ndarray:
        prefix = bytes(prefix)
        lo = bisect.bisect_left(self.sorted, prefix)
        hi = bisect.bisect_left(self.sorted, prefix + b"\xff" * 8, lo)  # no token holds 8 bytes of 0xff
        return self.ids[lo:hi]

    def refused(self) -> np.ndarray | None:
        """Booleans over the vocabulary: the tokens that would continue a loop here (None: no loop has begun)."""
        state, text = self.states[-1], self.text
        found = [self._string_loop(text[state.string :])] if state.string >= 0 else []
        if state.number >= 0 and _repeats(text[state.number :], MAX_PERIOD, MIN_NUMBER_RUN):
            found.append(self.numeric)
        found += [self._array_loop(a, text) for a in state.open if isinstance(a, _Array) and a.current >= 0]
        found = [f for f in found if f is not None]
        return functools.reduce(np.logical_or, found) if found else None

    def _string_loop(self, content: bytes) -> np.ndarray | None:
        if not _repeats(content, MAX_UNIT, MIN_RUN):
            return None
        refused = np.ones(self.vocab_size, dtype=bool)
        refused[self._starting_with(b'"')] = False
        return refused

    def _array_loop(self, array: _Array, text: bytes) -> np.ndarray | None:
        items = [text[a:b] for a, b in array.items]
        current = text[array.current :] if array.current >= 0 else b""
        refused = None
        for period in range(1, MAX_PERIOD + 1):
            if len(items) < period:
                break
            expected = items[-period]  # what the current item would be if the block repeats once more
            text_like = expected[:1] in (b'"', b"{", b"[")
            repeats = (REPEATS if period == 1 else BLOCK_REPEATS) if text_like else LITERAL_REPEATS
            span = repeats * period - 1  # completed items the repetition must already cover
            if len(items) < span or not expected.startswith(current):
                continue
            if all(items[-m] == items[-m - period] for m in range(1, span - period + 1)):
                if refused is None:
                    refused = np.zeros(self.vocab_size, dtype=bool)
                refused[self._starting_with(expected[len(current) :] + b",")] = True
        return refused


def _repeats(text: bytes, longest: int, run: int) -> bool:
    """``text`` ends with a piece of 1 to ``longest`` bytes repeated over at least ``run`` bytes (and 4 times)."""
    n = len(text)
    for unit in range(1, longest + 1):
        need = max(run, 4 * unit)
        if n < need:
            return False
        repeated = 0  # bytes at the end equal to the byte ``unit`` before them
        while repeated + unit < n and text[n - 1 - repeated] == text[n - 1 - repeated - unit]:
            repeated += 1
        if repeated + unit >= need:
            return True
    return False
