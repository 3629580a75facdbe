"""Reading experts from the disk: positional reads into aligned buffers, around the operating system's page cache.

An expert is one contiguous byte range of its layer's file (store.py). ``ExpertReader.read`` reads it with one
``os.preadv`` into a buffer of the caller's (page-aligned: an anonymous memory map), checks its checksum on those
bytes, and returns numpy views of its tensors into the buffer. Files are opened so that reads bypass the page cache
(``O_DIRECT`` on Linux, ``F_NOCACHE`` on macOS): the memory budget is then the only cache of experts, and a read's
time is the disk's. Direct reads need their offset, length and buffer aligned to the device's block, so the reader
reads the aligned span around the expert and slices it. Where the file system refuses direct reads (a tmpfs before
Linux 6.6, some network and FUSE mounts), the reader says so in one line and reads through the page cache.

``io="cached"`` reads through the page cache on purpose (a second run then reads memory, not the disk).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import M2R2Error

if TYPE_CHECKING:
    from .store import ExpertStore

ALIGN = 4096  # a multiple of every common logical block size (512, 4096): what O_DIRECT needs
IO_MODES = ("direct", "cached")
log = logging.getLogger("m2r2")
_noted: set[str] = set()  # file systems refusing direct reads, noted once each


def aligned_span(offset: int, nbytes: int) -> tuple[int, int]:
    """(start, length) of the ALIGN-aligned byte range holding ``[offset, offset + nbytes)``."""
    start = offset - offset % ALIGN
    end = -(-(offset + nbytes) // ALIGN) * ALIGN
    return start, end - start


class Buffer:
    """A page-aligned buffer of ``nbytes`` (an anonymous memory map), reused read after read."""

    def __init__(self, nbytes: int):
        self.nbytes = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        self.map = mmap.mmap(-1, self.nbytes)
        self.array = np.frombuffer(self.map, np.uint8)

    def close(self) -> None:
        self.array = None
        try:
            self.map.close()
        except BufferError:  # views of it are still alive: the memory goes with the last of them
            pass


def _uncached_fd(path: Path) -> int | None:
    """``path`` opened for reads that bypass the page cache, or None where the file system refuses them."""
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            return None
    if sys.platform == "darwin":
        import fcntl

        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)
            return fd
        except OSError:
            os.close(fd)
            return None
    return None


def _note_refused(path: Path, why: str) -> None:
    key = str(path.parent)
    if key not in _noted:
        _noted.add(key)
        log.warning("note: %s; experts are read through the page cache, which the memory budget does not bound", why)


class ExpertReader:
    """Positional reads of one store's experts (see the module docstring). Safe from any thread."""

    def __init__(self, store: ExpertStore, io: str = "direct"):
        if io not in IO_MODES:
            raise M2R2Error(f"unknown expert read mode {io!r}; choose one of: {', '.join(IO_MODES)}")
        self.store = store
        self._lock = threading.Lock()
        self._fds: dict[int, tuple[int, bool]] = {}  # layer -> (fd, direct)
        self.requested = io
        self.span_bytes = max(aligned_span(0, store.expert_bytes(l))[1] + ALIGN for l in store.layers)

    @property
    def direct(self) -> bool:
        """Whether every file opened so far reads around the page cache."""
        return self.requested == "direct" and all(d for _, d in self._fds.values())

    def _fd(self, layer: int) -> tuple[int, bool]:
        with self._lock:
            if layer not in self._fds:
                path = self.store.path(layer)
                fd = _uncached_fd(path) if self.requested == "direct" else None
                if fd is not None:
                    self._fds[layer] = (fd, True)
                else:
                    if self.requested == "direct":
                        _note_refused(path, f"the file system under {path.parent} refuses direct reads")
                    self._fds[layer] = (os.open(path, os.O_RDONLY), False)
            return self._fds[layer]

    def _refused_at_read(self, layer: int) -> tuple[int, bool]:
        """A file system that opened with O_DIRECT but refuses the read itself: reopen it buffered."""
        path = self.store.path(layer)
        _note_refused(path, f"the file system under {path.parent} refuses direct reads")
        with self._lock:
            old, _ = self._fds[layer]
            self._fds[layer] = (os.open(path, os.O_RDONLY), False)
        os.close(old)
        return self._fds[layer]

    def read(self, layer: int, expert: int, buffer: Buffer) -> dict[str, np.ndarray]:
        """Expert ``expert`` of ``layer`` read into ``buffer`` and verified: its tensors as numpy views into the
        buffer (valid until the buffer is read into again)."""
        offset, nbytes = self.store.span(layer, expert)
        start, length = aligned_span(offset, nbytes)
        if length > buffer.nbytes:
            raise ValueError(f"a buffer of {buffer.nbytes} bytes cannot hold a read of {length}")
        fd, direct = self._fd(layer)
        view = memoryview(buffer.map)[:length]
        try:
            got = os.preadv(fd, [view], start)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise M2R2Error(f"reading expert {expert} of layer {layer} from {self.store.path(layer)} failed: {e}")
            fd, direct = self._refused_at_read(layer)
            got = os.preadv(fd, [view], start)
        finally:
            view.release()
        skip = offset - start
        if got < skip + nbytes:
            raise M2R2Error(
                f"expert file {self.store.path(layer)} ends before expert {expert} of layer {layer} "
                f"(truncated); {self.store.reexport}"
            )
        return self.store.parse(layer, expert, buffer.array[skip : skip + nbytes])

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()


@dataclass(frozen=True)
class DiskSpeed:
    """What direct reads of a store's files reach on this disk: ``gbps`` with large blocks (the disk's throughput,
    as ``dd iflag=direct bs=4M`` measures it), ``expert_ms`` one expert's read alone, and the fixed cost of a read
    that they imply (``latency_ms``: an expert's read less its bytes at ``gbps``)."""

    gbps: float
    expert_ms: float
    latency_ms: float
    direct: bool


def probe_disk(store: ExpertStore, block: int = 4 << 20, total: int = 256 << 20, reads: int = 64) -> DiskSpeed:
    """Time direct reads of ``store``'s files: ``total`` bytes in ``block``s (the files over and over where they
    are smaller), then ``reads`` single experts one at a time, spread over the store (the median)."""
    reader = ExpertReader(store, "direct")
    buffer = Buffer(block)
    try:
        layers, done, start = store.layers, 0, time.perf_counter()
        while done < total:
            for layer in layers:
                fd, _ = reader._fd(layer)
                size = store.path(layer).stat().st_size
                for offset in range(0, size - size % ALIGN, block):
                    done += os.preadv(fd, [memoryview(buffer.map)[: min(block, size - size % ALIGN - offset)]], offset)
                    if done >= total:
                        break
                if done >= total:
                    break
        gbps = done / (time.perf_counter() - start) / 1e9
        span = Buffer(reader.span_bytes)
        times = []
        for i in range(reads):
            layer = layers[i % len(layers)]
            expert = (i * 7) % store.num_experts(layer)
            t = time.perf_counter()
            reader.read(layer, expert, span)
            times.append(time.perf_counter() - t)
        span.close()
        expert_ms = 1e3 * sorted(times)[len(times) // 2]
        latency_ms = max(expert_ms - store.expert_bytes() / gbps / 1e6, 0.0)
        return DiskSpeed(gbps, expert_ms, latency_ms, reader.direct)
    finally:
        buffer.close()
        reader.close()
