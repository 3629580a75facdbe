"""A background loader that brings predicted experts in while the forward pass computes.

Requests are (step, layer, expert) in the order they were made (predictors ask in layer
order). The loader thread reads each expert from the store and waits on the link; it never
touches MLX. The forward pass collects the finished buffers at its next ``ensure`` and
copies them into slots. A request whose layer the pass has already gone past at that step
is dropped unread. An error in the loader (a damaged expert file) is raised in the forward
pass at its next ``ensure``.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Iterable

import numpy as np

from .cache import ExpertCache


class Prefetcher:
    def __init__(self, cache: ExpertCache):
        if cache.prefetcher is not None:
            cache.prefetcher.close()
        self.cache = cache
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, int, int]] = deque()
        self._pending: set[tuple[int, int]] = set()  # (layer, expert) queued or being read
        self._ready: list[tuple[int, int, dict[str, np.ndarray]]] = []
        self._dropped = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="m2r2-expert-loader", daemon=True)
        self._thread.start()
        cache.prefetcher = self

    def request(self, layer: int, experts: Iterable[int], step: int | None = None) -> None:
        """Public entry for any predictor: ``layer`` will use ``experts`` at ``step`` (default: now).

        Same as ``cache.prefetch``: the prediction is scored, the experts load in the background.
        """
        self.cache.prefetch(layer, experts, step)

    def submit(self, step: int, layer: int, experts: Iterable[int]) -> None:
        """Queue loads (called by the cache for experts not resident)."""
        with self._cond:
            for e in experts:
                key = (layer, e)
                if key in self._pending:  # still queued for an older step: that step's pass may be gone, keep it alive
                    for i, (s, l, x) in enumerate(self._queue):
                        if (l, x) == key and s < step:
                            self._queue[i] = (step, l, x)
                elif not any(r[:2] == key for r in self._ready):
                    self._pending.add(key)
                    self._queue.append((step, layer, e))
            self._cond.notify_all()

    def holds(self, layer: int, expert: int) -> bool:
        """Whether a load of ``expert`` into ``layer`` is queued, being read or arrived and not yet collected."""
        with self._cond:
            return (layer, expert) in self._pending or any(r[:2] == (layer, expert) for r in self._ready)

    def count(self, layer: int) -> int:
        """Loads into ``layer`` queued, being read or arrived and not yet collected."""
        with self._cond:
            return sum(l == layer for l, _ in self._pending) + sum(r[0] == layer for r in self._ready)

    def collect(self, layer: int, needed: Iterable[int]) -> tuple[list, int, int]:
        """Wait for any of ``needed`` still in flight, then hand over every finished buffer.

        Returns (arrived [(layer, expert, arrays)], how many of ``needed`` were waited for,
        requests dropped as stale since the last call).
        """
        with self._cond:
            late = [e for e in needed if (layer, e) in self._pending]
            self._cond.wait_for(lambda: self._error is not None or not any((layer, e) in self._pending for e in late))
            if self._error is not None:
                raise self._error
            arrived, self._ready = self._ready, []
            dropped, self._dropped = self._dropped, 0
        return arrived, len(late), dropped

    def close(self) -> None:
        """Stop the loader (queued requests are abandoned) and detach from the cache."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        if self.cache.prefetcher is self:
            self.cache.prefetcher = None

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                step, layer, e = self._queue.popleft()
            if self.cache.is_stale(step, layer):
                with self._cond:
                    self._pending.discard((layer, e))
                    self._dropped += 1
                    self._cond.notify_all()
                continue
            try:
                arrays = self.cache.fetch(layer, e)
            except BaseException as err:  # surfaces in the forward pass, which may be waiting on it
                with self._cond:
                    self._error = err
                    self._pending.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                self._pending.discard((layer, e))
                self._ready.append((layer, e, arrays))
                self._cond.notify_all()
