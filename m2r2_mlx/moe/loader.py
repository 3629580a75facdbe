"""Bringing experts in: one queue of reads for on-demand loads and prefetches alike.

``DiskLoader`` (the wall clock) reads from the store on a few threads (``workers``), each read into one of a fixed
set of aligned buffers (reader.py: direct reads, the page cache out of the way). A load the forward pass waits on
goes ahead of every prefetch; a prefetch still queued when the pass reaches its layer without needing it, or when
a newer prediction for its layer no longer names it, is cancelled and never read. Finished reads wait in their
buffers until the forward pass lands them in slots (``fetch``, at its next MoE layer); MLX is touched only there,
on the pass's own thread. ``DeviceLoader`` (device_loader.py) is the same queue on a device clock's link channel.

A read that fails (a damaged expert) is raised in the forward pass at its next ``fetch``.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import numpy as np

from .reader import Buffer, ExpertReader
from .store import ExpertStore

DEMAND, PREFETCH = 0, 1  # read priorities: what the pass waits on first


@dataclass(eq=False)
class Read:
    """One expert's read: queued, then reading, then done (its tensors in a buffer until landed) or cancelled."""

    layer: int
    expert: int
    step: int
    priority: int
    state: str = "queued"  # queued | reading | done | cancelled
    arrays: dict[str, np.ndarray] | None = None
    buffer: Buffer | None = None
    error: BaseException | None = None
    done_at: float = field(default=0.0, repr=False)  # a device-clock read's arrival

    @property
    def key(self) -> tuple[int, int]:
        return self.layer, self.expert

    @property
    def demand(self) -> bool:
        return self.priority == DEMAND


class Loader(Protocol):
    """What an ExpertCache asks of its loader (DiskLoader on the wall clock, DeviceLoader on a device's)."""

    bytes: int  # bytes read so far
    reads: int  # reads finished so far

    def prefetch(self, step: int, layer: int, experts: Iterable[int], named: set[int]) -> None:
        """Queue reads of ``experts``, of those predicted (``named``) for ``layer`` at ``step``; queued reads for
        the layer's older or equal steps that the prediction no longer names are cancelled."""
        ...

    def settle(self, step: int, layer: int, needed: Iterable[int]) -> int:
        """The pass reached ``layer`` at ``step`` needing ``needed``: queued reads for it it does not need are
        cancelled; returns how many."""
        ...

    def fetch(self, layer: int, missing: Iterable[int]) -> tuple[list[Read], int]:
        """Wait for ``missing`` (reading those no read is held for, ahead of every prefetch); returns every
        finished read (theirs and any others, to be landed, then ``release``d) and how many of ``missing`` were
        held as prefetches not finished yet (late)."""
        ...

    def release(self, read: Read) -> None:
        """The read's tensors are in their slot: its buffer is free."""
        ...

    def holds(self, layer: int, expert: int) -> bool: ...

    def count(self, layer: int) -> int: ...

    @property
    def busy_s(self) -> float:
        """Seconds (on the cache's clock) with at least one read under way."""
        ...

    def read_seconds(self, nbytes: int) -> float:
        """What one read of ``nbytes`` is expected to take."""
        ...

    def landed(self, nbytes: int) -> None:
        """An expert of ``nbytes`` was written into its slot (a device clock charges the copy)."""
        ...

    def close(self) -> None: ...


class ReadQueue:
    """The reads one loader holds, by (layer, expert), and the order queued ones start in."""

    def __init__(self):
        self.reads: dict[tuple[int, int], Read] = {}
        self._heap: list[tuple[int, int, Read]] = []
        self._seq = itertools.count()
        self.cancelled = 0

    def push(self, read: Read) -> None:
        self.reads[read.key] = read
        heapq.heappush(self._heap, (read.priority, next(self._seq), read))

    def promote(self, read: Read) -> None:
        """A queued prefetch the pass now waits on: it goes ahead of every prefetch."""
        read.priority = DEMAND
        heapq.heappush(self._heap, (DEMAND, next(self._seq), read))

    def pop(self) -> Read | None:
        """The next queued read to start (entries left behind by a promotion or a cancel are skipped)."""
        while self._heap:
            priority, _, read = heapq.heappop(self._heap)
            if read.state == "queued" and read.priority == priority:
                return read
        return None

    def peek(self) -> Read | None:
        while self._heap:
            priority, _, read = self._heap[0]
            if read.state == "queued" and read.priority == priority:
                return read
            heapq.heappop(self._heap)
        return None

    def cancel(self, read: Read) -> None:
        read.state = "cancelled"
        del self.reads[read.key]
        self.cancelled += 1

    def prefetch(self, step: int, layer: int, experts: list[int], named: set[int], make: Callable[[int], Read]):
        for read in [r for r in self.reads.values() if r.layer == layer and r.state == "queued"]:
            if read.expert not in named and read.step <= step and not read.demand:
                self.cancel(read)  # no longer predicted
        for e in experts:
            held = self.reads.get((layer, e))
            if held is None:
                self.push(make(e))
            elif held.state == "queued" and held.step < step:
                held.step = step  # still wanted, now for a later step

    def settle(self, step: int, layer: int, needed: set[int]) -> int:
        before = self.cancelled
        for read in [r for r in self.reads.values() if r.layer == layer and r.state == "queued"]:
            if read.step <= step and read.expert not in needed and not read.demand:
                self.cancel(read)
        return self.cancelled - before

    def finished(self) -> list[Read]:
        done = [r for r in self.reads.values() if r.state == "done"]
        for r in done:
            del self.reads[r.key]
        return done

    def count(self, layer: int) -> int:
        return sum(l == layer for l, _ in self.reads)


class DiskLoader:
    """Reads from the store's files on ``workers`` threads into ``buffers`` aligned buffers (module docstring), of
    which ``reserve`` only loads on demand may take: a finished read holds its buffer until the pass lands it, after
    its wait, so prefetches must leave room for every load one wait can ask for (a layer's slots)."""

    IDLE_S = 2.0  # a reader thread with nothing to read for this long ends (the next read starts it again)

    def __init__(self, store: ExpertStore, *, io: str = "direct", workers: int = 4, buffers: int = 8, reserve: int = 0):
        if not 0 <= reserve < buffers:
            raise ValueError(f"{reserve} buffers kept for loads on demand leave none of {buffers} for prefetches")
        self.reader = ExpertReader(store, io)
        self._buffers, self._reserve = buffers, reserve
        self._free = [Buffer(self.reader.span_bytes) for _ in range(self._buffers)]
        self._queue = ReadQueue()
        self._cond = threading.Condition()
        self._closed = False
        self._workers, self._threads = max(workers, 1), []
        self._active, self._busy_since, self._busy = 0, 0.0, 0.0
        self.bytes = self.reads = 0
        self._read_s = 0.0  # seconds the finished reads took, each alone

    @property
    def direct(self) -> bool:
        return self.reader.direct

    @property
    def buffer_bytes(self) -> int:
        """The read buffers' memory (outside the budget: the staging area reads land in)."""
        return self._buffers * self.reader.span_bytes

    def prefetch(self, step: int, layer: int, experts: Iterable[int], named: set[int]) -> None:
        with self._cond:
            self._queue.prefetch(step, layer, list(experts), named, lambda e: Read(layer, e, step, PREFETCH))
            self._start_readers()
            self._cond.notify_all()

    def settle(self, step: int, layer: int, needed: Iterable[int]) -> int:
        with self._cond:
            return self._queue.settle(step, layer, set(needed))

    def fetch(self, layer: int, missing: Iterable[int]) -> tuple[list[Read], int]:
        with self._cond:
            late, wanted = 0, []
            for e in missing:
                read = self._queue.reads.get((layer, e))
                if read is None:
                    read = Read(layer, e, -1, DEMAND)
                    self._queue.push(read)
                else:
                    late += read.state != "done"
                    if read.state == "queued":
                        self._queue.promote(read)
                wanted.append(read)
            self._start_readers()
            self._cond.notify_all()
            self._cond.wait_for(lambda: all(r.state == "done" for r in wanted) or self._failed() is not None)
            if (failed := self._failed()) is not None:
                del self._queue.reads[failed.key]
                if failed.buffer is not None:
                    self._free.append(failed.buffer)
                raise failed.error
            return self._queue.finished(), late

    def _failed(self) -> Read | None:
        return next((r for r in self._queue.reads.values() if r.error is not None), None)

    def release(self, read: Read) -> None:
        with self._cond:
            if read.buffer is not None:
                self._free.append(read.buffer)
                read.buffer, read.arrays = None, None
                self._start_readers()
                self._cond.notify_all()

    def holds(self, layer: int, expert: int) -> bool:
        with self._cond:
            return (layer, expert) in self._queue.reads

    def count(self, layer: int) -> int:
        with self._cond:
            return self._queue.count(layer)

    @property
    def cancelled(self) -> int:
        return self._queue.cancelled

    @property
    def busy_s(self) -> float:
        with self._cond:
            return self._busy + (time.perf_counter() - self._busy_since if self._active else 0.0)

    def read_seconds(self, nbytes: int) -> float:
        """The mean time a read has taken a byte, times ``nbytes`` (1 GB/s before any read)."""
        return nbytes * (self._read_s / self.bytes if self.bytes else 1e-9)

    def landed(self, nbytes: int) -> None:
        pass

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            threads = list(self._threads)
        for t in threads:
            t.join()
        for b in self._free:
            b.close()
        self._free.clear()
        self.reader.close()

    def _startable(self) -> bool:
        """Whether the next queued read may take a buffer now (called with the lock held)."""
        read = self._queue.peek()
        return read is not None and len(self._free) > (0 if read.demand else self._reserve)

    def _start_readers(self) -> None:
        """Reader threads up to ``workers`` while reads are queued (called with the lock held)."""
        self._threads = [t for t in self._threads if t.is_alive()]
        while len(self._threads) < self._workers and self._queue.peek() is not None:
            t = threading.Thread(target=self._run, name="m2r2-expert-reader", daemon=True)
            self._threads.append(t)
            t.start()

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                ready = lambda: self._closed or self._startable()  # noqa: E731
                if not self._cond.wait_for(ready, timeout=self.IDLE_S) or self._closed:
                    if me in self._threads:
                        self._threads.remove(me)
                    return
                read = self._queue.pop()
                read.state, read.buffer = "reading", self._free.pop()
                if self._active == 0:
                    self._busy_since = time.perf_counter()
                self._active += 1
            start = time.perf_counter()
            try:
                arrays, error = self.reader.read(read.layer, read.expert, read.buffer), None
            except BaseException as e:  # surfaces in the forward pass, which may be waiting on it
                arrays, error = None, e
            took = time.perf_counter() - start
            with self._cond:
                self._active -= 1
                if self._active == 0:
                    self._busy += time.perf_counter() - self._busy_since
                read.arrays, read.error, read.state = arrays, error, "done"
                if error is None:
                    self.bytes += self.reader.store.expert_bytes(read.layer)
                    self.reads += 1
                    self._read_s += took
                self._cond.notify_all()
