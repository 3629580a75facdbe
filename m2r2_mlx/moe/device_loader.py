"""The expert read queue (loader.py) on a ``DeviceClock``'s link channel (clock.py): no thread, each read taking the
device's transfer time; what it reads is real (tokens stay the model's own)."""

from __future__ import annotations

from collections import deque
from typing import Iterable

from .clock import DeviceClock
from .loader import DEMAND, PREFETCH, Read, ReadQueue
from .store import ExpertStore


class DeviceLoader:
    """The read queue on a device clock's link channel (clock.py): reads take the device's transfer time, one at a
    time, demand first; queued prefetches start as the channel frees. ``scale``: the device's bytes per byte held
    here (an expert held in float32 here and in 4 bits on the device moves 0.5625 / 4 of its bytes)."""

    def __init__(self, store: ExpertStore, clock: DeviceClock, scale: float = 1.0, io: str = "cached"):
        self.store, self.clock, self.scale, self.io = store, clock, scale, io
        self._queue = ReadQueue()
        self._flight: deque[Read] = deque()  # started, in arrival order
        self.bytes = self.reads = 0

    def _scaled(self, nbytes: int) -> float:
        return nbytes * self.scale

    def prefetch(self, step: int, layer: int, experts: Iterable[int], named: set[int]) -> None:
        now = self.clock.now()
        self._advance(now)
        self._queue.prefetch(step, layer, list(experts), named, lambda e: Read(layer, e, step, PREFETCH, done_at=now))
        self._advance(now)

    def settle(self, step: int, layer: int, needed: Iterable[int]) -> int:
        self._advance(self.clock.now())
        return self._queue.settle(step, layer, set(needed))

    def fetch(self, layer: int, missing: Iterable[int]) -> tuple[list[Read], int]:
        now = self.clock.now()
        self._advance(now)
        late, wanted = 0, []
        for e in missing:
            read = self._queue.reads.get((layer, e))
            if read is None:
                read = Read(layer, e, -1, DEMAND, done_at=now)
                self._queue.push(read)
            else:
                late += not (read.state == "done" and read.done_at <= now)
                if read.state == "queued":
                    self._queue.promote(read)
            wanted.append(read)
        while any(r.state == "queued" for r in wanted):  # the channel takes them ahead of queued prefetches
            self._start(self._queue.pop())
        if wanted:
            self.clock.wait(max(r.done_at for r in wanted))
        self._advance(self.clock.now())
        return self._queue.finished(), late

    def release(self, read: Read) -> None:
        read.arrays = None

    def holds(self, layer: int, expert: int) -> bool:
        self._advance(self.clock.now())
        return (layer, expert) in self._queue.reads

    def count(self, layer: int) -> int:
        self._advance(self.clock.now())
        return self._queue.count(layer)

    @property
    def cancelled(self) -> int:
        return self._queue.cancelled

    @property
    def busy_s(self) -> float:
        return self.clock.link_busy

    def read_seconds(self, nbytes: int) -> float:
        return self.clock.transfer_seconds(self._scaled(nbytes))

    def landed(self, nbytes: int) -> None:
        """An arrived expert written into its slot: a copy on the compute stream (read and write), with the host's
        work for one load (kind "load": reading the store, converting, the slot write's dispatch)."""
        self.clock.op(2 * self._scaled(nbytes), kind="load")

    def close(self) -> None:
        self._queue = ReadQueue()
        self._flight.clear()

    def _advance(self, now: float) -> None:
        """Finish what has arrived by ``now``; start every queued read the channel would have started by then."""
        while True:
            nxt = self._queue.peek()
            if nxt is None or max(nxt.done_at, self.clock.link_free) > now:  # queued reads hold their issue time
                break
            self._start(self._queue.pop())
        for read in [r for r in self._flight if r.done_at <= now]:
            self._flight.remove(read)
            read.state = "done"

    def _start(self, read: Read) -> None:
        nbytes = self.store.expert_bytes(read.layer)
        read.state = "reading"
        read.done_at = self.clock.transfer(self._scaled(nbytes), read.done_at)
        read.arrays = self.store.read(read.layer, read.expert, self.io)
        self.bytes += nbytes
        self.reads += 1
        self._flight.append(read)
