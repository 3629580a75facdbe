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


class DevicePrefetcher:
    """The background loader of a device-clock run (clock.py): no thread; each request queues on the clock's link
    channel when issued, in order, and the forward pass collects what has arrived by its own time. A request whose
    layer the pass has gone past when the channel would start it is dropped unread, as the loader thread does."""

    def __init__(self, cache: ExpertCache):
        if cache.prefetcher is not None:
            cache.prefetcher.close()
        self.cache, self.clock = cache, cache.clock
        self._queue: deque[tuple[int, int, int, float]] = deque()  # (step, layer, expert, issued at), not started
        self._flight: dict[tuple[int, int], float] = {}  # (layer, expert) started -> arrives at
        self._dropped = 0
        cache.prefetcher = self

    def request(self, layer: int, experts: Iterable[int], step: int | None = None) -> None:
        self.cache.prefetch(layer, experts, step)

    def submit(self, step: int, layer: int, experts: Iterable[int]) -> None:
        now = self.clock.now()
        for e in experts:
            queued = next((i for i, r in enumerate(self._queue) if r[1:3] == (layer, e)), None)
            if queued is not None:
                if self._queue[queued][0] < step:
                    self._queue[queued] = (step, layer, e, self._queue[queued][3])
            elif (layer, e) not in self._flight:
                self._queue.append((step, layer, e, now))
        self._advance(now)

    def holds(self, layer: int, expert: int) -> bool:
        self._advance(self.clock.now())
        return (layer, expert) in self._flight or any(r[1:3] == (layer, expert) for r in self._queue)

    def count(self, layer: int) -> int:
        self._advance(self.clock.now())
        return sum(l == layer for l, _ in self._flight) + sum(r[1] == layer for r in self._queue)

    def collect(self, layer: int, needed: Iterable[int]) -> tuple[list, int, int]:
        """Wait (on the clock) for any of ``needed`` still on the link or queued for it, then hand over everything
        that has arrived: (arrived [(layer, expert, arrays)], how many of ``needed`` were waited for, dropped)."""
        now = self.clock.now()
        self._advance(now)
        wanted = {(layer, e) for e in needed}
        while any(r[1:3] in wanted for r in self._queue):  # the channel gets to them in queue order
            self._start(self._queue.popleft())
        waits = [self._flight[k] for k in wanted if k in self._flight]
        late = sum(t > now for t in waits)
        if waits:
            self.clock.wait(max(waits))
        now = self.clock.now()
        done = [k for k, t in self._flight.items() if t <= now]
        arrived = []
        for key in done:
            del self._flight[key]
            arrived.append((*key, self.cache.store.read(*key)))
        dropped, self._dropped = self._dropped, 0
        return arrived, late, dropped

    def close(self) -> None:
        self._queue.clear()
        self._flight.clear()
        if self.cache.prefetcher is self:
            self.cache.prefetcher = None

    def _advance(self, now: float) -> None:
        """Start every queued request the channel would have started by ``now``."""
        while self._queue and max(self._queue[0][3], self.clock.link_free) <= now:
            self._start(self._queue.popleft())

    def _start(self, request: tuple[int, int, int, float]) -> None:
        step, layer, e, issued = request
        if self.cache.is_stale(step, layer):
            self._dropped += 1
            return
        nbytes = self.cache.store.expert_bytes(layer)
        self.cache.link.count(nbytes)
        self._flight[(layer, e)] = self.clock.transfer(self.cache.link.scaled(nbytes), issued)
