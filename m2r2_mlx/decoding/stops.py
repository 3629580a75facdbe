"""Stop strings: an answer ends before the first of them, and a streamed answer never shows part of one."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator, Sequence

from .events import TokenEvent


def held_back(text: str, markers: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins one of ``markers`` (and might grow into it)."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


class StopMatcher:
    """Cuts the answer at the first stop string. Text that could be the start of one is held back until the
    next pieces decide."""

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self.pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """The text that is safe to emit now; sets ``stopped`` when a stop string has appeared."""
        if not self.stops:
            return piece
        text = self.pending + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return text[: min(hits)]
        hold = held_back(text, self.stops)
        self.pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """At the end of the answer, what was held back is plain text."""
        text, self.pending = self.pending, ""
        return text


def apply_stops(stream: Iterator[TokenEvent], stops: Sequence[str]) -> Iterator[TokenEvent]:
    """``stream`` with each event's text cut to what is safe to show; the event where a stop string appears is
    the last (finish reason "stop"), and the decoding under it is closed there, as a cancel closes it."""
    if not stops:
        yield from stream
        return
    matcher = StopMatcher(stops)
    try:
        for ev in stream:
            text = matcher.feed(ev.text)
            if matcher.stopped:
                yield replace(ev, text=text, finish_reason="stop")
                return
            if ev.finish_reason:
                text += matcher.flush()
            yield replace(ev, text=text)
            if ev.finish_reason:
                return
    finally:
        stream.close()
