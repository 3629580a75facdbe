"""The host-to-accelerator link, optionally throttled to emulate a discrete memory split.

On unified memory (Apple Silicon, a CPU) "loading an expert" is a page-in and a copy, far
faster than a PCIe link to a discrete GPU's HBM. A throttled ``Link`` makes every transfer
take at least ``latency + bytes / bandwidth``: it times the real copy and sleeps only the
remainder, so results are reproducible whatever the machine's own copy speed (as long as it
is faster than the emulated link). One link is one channel: transfers queue behind each
other, on-demand loads and prefetches alike.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

from ..errors import M2R2Error


class Link:
    def __init__(self, gb_per_s: float | None = None, latency_ms: float = 0.0):
        """``gb_per_s``: bandwidth in GB/s (1e9 bytes), None = unthrottled; ``latency_ms`` per transfer."""
        if gb_per_s is not None and not gb_per_s > 0:
            raise M2R2Error(f"link bandwidth must be a positive number of GB/s, got {gb_per_s}")
        if not latency_ms >= 0:
            raise M2R2Error(f"link latency must be zero or more milliseconds, got {latency_ms}")
        self.gb_per_s = gb_per_s
        self.latency_ms = latency_ms
        self._channel = threading.Lock()
        self.transfers = 0
        self.bytes = 0
        self.busy_s = 0.0  # wall time the channel was held, copies and emulated waits together

    @property
    def throttled(self) -> bool:
        return self.gb_per_s is not None or self.latency_ms > 0

    def min_seconds(self, nbytes: int) -> float:
        """The least time a transfer of ``nbytes`` may take on this link."""
        wire = nbytes / (self.gb_per_s * 1e9) if self.gb_per_s is not None else 0.0
        return self.latency_ms / 1e3 + wire

    @contextmanager
    def transfer(self, nbytes: int) -> Iterator[None]:
        """Hold the channel while the body copies ``nbytes``; pad the time up to ``min_seconds``."""
        with self._channel:
            start = time.perf_counter()
            yield
            end = start + self.min_seconds(nbytes)
            while (left := end - time.perf_counter()) > 0:  # a loop: sleep may wake a hair early
                time.sleep(left)
            self.transfers += 1
            self.bytes += nbytes
            self.busy_s += time.perf_counter() - start

    def __repr__(self) -> str:
        bw = "unthrottled" if self.gb_per_s is None else f"{self.gb_per_s:g} GB/s"
        return f"Link({bw}, {self.latency_ms:g} ms)"
