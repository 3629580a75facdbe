"""Experts read from the disk (m2r2_mlx/moe/reader.py, loader.py) on a tiny OLMoE exported into an empty folder:
a direct read returns the bytes written; a load the pass waits on goes ahead of queued prefetches; a cancelled
prefetch is never read; a damaged expert file fails in one line naming it; where a file system refuses direct reads
(tmpfs before Linux 6.6) the reader says so once and reads through the page cache, with the same tokens."""

import errno
import json
import logging
import os
import shutil
import threading
from pathlib import Path

from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.moe import ExpertStore, IOConfig, PreGating, moe_blocks, offload_experts
from m2r2_mlx.moe.blocks import expert_params
from m2r2_mlx.moe.loader import DiskLoader
from m2r2_mlx.moe.reader import Buffer, ExpertReader, aligned_span
from m2r2_mlx.moe.store import to_numpy

import numpy as np
import pytest

from m2r2_bench.moe_rows import greedy
from tests.tiny import tiny_model

PROMPT = np.array([3, 17, 42, 8, 99, 23, 5, 61, 12, 7])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(the tiny OLMoE, its store in an empty folder, its greedy tokens)."""
    model = tiny_model("olmoe").model
    store = ExpertStore.export(model, tmp_path_factory.mktemp("empty") / "experts")
    return model, store, greedy(model, PROMPT, 8)[0]


def accepts_direct(path: Path) -> bool:
    """Whether the file system under ``path`` opens files for direct reads (macOS: F_NOCACHE always works)."""
    if not hasattr(os, "O_DIRECT"):
        return True
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


def written(model, layer: int, expert: int) -> dict[str, np.ndarray]:
    block = dict(moe_blocks(model))[layer]
    return {name: to_numpy(a)[expert] for name, a in expert_params(block.switch_mlp).items()}


def test_a_direct_read_returns_the_written_bytes(exported):
    model, store, _ = exported
    reader = ExpertReader(store, "direct")
    buffer = Buffer(reader.span_bytes)
    try:
        for layer, expert in [(0, 0), (0, 7), (3, 5), (5, 2)]:
            start, length = aligned_span(*store.span(layer, expert))
            assert start % 4096 == 0 and length % 4096 == 0  # what O_DIRECT needs
            got = reader.read(layer, expert, buffer)
            want = written(model, layer, expert)
            assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
        assert reader.direct or not accepts_direct(store.path(0))  # Linux: O_DIRECT; macOS: F_NOCACHE
    finally:
        reader.close()
        buffer.close()


def test_a_load_the_pass_waits_on_goes_ahead_and_a_cancelled_prefetch_is_never_read(exported):
    """One reader thread and one buffer: while the buffer is held (a finished read not yet landed), nothing starts,
    so what starts next is decided by the queue alone."""
    _, store, _ = exported
    loader = DiskLoader(store, workers=1, buffers=1)
    try:
        (first,), late = loader.fetch(0, [1])  # a load on demand: read at once; its buffer held until released
        assert late == 0 and first.expert == 1 and first.arrays is not None
        loader.prefetch(3, 2, [4, 5], named={4, 5})  # queued behind the held buffer
        done = []
        waiter = threading.Thread(target=lambda: done.append(loader.fetch(2, [6])))  # the pass waits on expert 6
        waiter.start()
        while loader.count(2) < 3:  # the demand read is queued beside the prefetches
            pass
        loader.release(first)
        waiter.join(timeout=10)
        (arrived, late) = done[0]
        assert [r.expert for r in arrived] == [6] and late == 0  # ahead of both prefetches queued before it
        assert loader.settle(3, 2, needed=[5]) == 1  # the pass reaches layer 2 without needing expert 4
        assert not loader.holds(2, 4) and loader.holds(2, 5)
        loader.release(arrived[0])
        arrived, late = loader.fetch(2, [5])
        assert [r.expert for r in arrived] == [5] and late == 1
        loader.release(arrived[0])
        assert loader.reads == 3 and loader.cancelled == 1  # expert 4 was never read
    finally:
        loader.close()


def test_finished_prefetches_never_hold_the_buffers_loads_on_demand_need(exported):
    """Finished reads keep their buffers until the pass lands them, after its wait: were prefetches to take every
    buffer, a load on demand would wait for a buffer only the waiting pass can free."""
    _, store, _ = exported
    loader = DiskLoader(store, workers=2, buffers=3, reserve=2)  # one buffer for prefetches, two kept for demand
    try:
        loader.prefetch(0, 3, [0, 1, 2, 3, 4], named={0, 1, 2, 3, 4})
        while loader.reads < 1:  # one prefetch read; the others wait for the one buffer it holds
            pass
        done = []
        waiter = threading.Thread(target=lambda: done.append(loader.fetch(4, [6, 7])), daemon=True)
        waiter.start()
        waiter.join(timeout=10)
        assert done, "a load on demand waited on buffers held by finished prefetches"
        arrived, _ = done[0]
        assert {r.key for r in arrived} >= {(4, 6), (4, 7)} and loader.count(3) == 4  # four prefetches still queued
        for read in arrived:
            loader.release(read)
    finally:
        loader.close()


def _write_keeping_mtime(path: Path, data: bytes) -> None:
    """Alter a file as bit rot does: same size and mtime, so only the store's own checks can tell."""
    st = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_damaged_expert_fails_in_one_line_naming_its_file(exported, tmp_path):
    _, store, _ = exported
    folder = shutil.copytree(store.folder, tmp_path / "experts")
    entry = json.loads((folder / "experts.json").read_text())["layers"][1]
    data = bytearray((folder / entry["file"]).read_bytes())
    data[entry["experts"][5]["offset"] + 100] ^= 0x01
    _write_keeping_mtime(folder / entry["file"], bytes(data))
    damaged = ExpertStore.open(folder)  # sizes, mtimes and headers are intact: only the read can tell
    cache = offload_experts(tiny_model("olmoe").model, damaged, 0.25)  # experts 0 and 1 resident
    try:
        for attempt in ("on demand", "prefetched"):
            if attempt == "prefetched":  # a read on a loader thread fails in the forward pass, which waits on it
                cache.prefetch(1, [5], step=cache.step + 1)
            with pytest.raises(M2R2Error) as e:
                cache.ensure(1, [5])
            message = str(e.value)
            assert "\n" not in message and "expert 5 of layer 1" in message and entry["file"] in message
            assert "fails its checksum" in message and not cache.is_resident(1, 5)
        cache.ensure(1, [6])  # the other experts still load
    finally:
        cache.close()


def _refusing_direct(real_open):
    def open_(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args, **kwargs)

    return open_


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no tmpfs at /dev/shm")
def test_where_direct_reads_are_refused_it_says_so_once_and_reads_through_the_page_cache(exported, monkeypatch, caplog):
    model, _, reference = exported
    folder = Path(os.environ.get("M2R2_TMPFS", "/dev/shm")) / f"m2r2-test-{os.getpid()}"
    try:
        store = ExpertStore.export(model, folder / "experts")
        if accepts_direct(store.path(0)):  # tmpfs refuses O_DIRECT before Linux 6.6; a newer one is made to here
            monkeypatch.setattr(os, "open", _refusing_direct(os.open))
        lm = tiny_model("olmoe")
        with caplog.at_level(logging.WARNING, logger="m2r2"):
            cache = offload_experts(lm.model, store, 0.25, io=IOConfig(workers=2))
            PreGating().attach(cache)
            try:
                assert greedy(lm.model, PROMPT, 8)[0] == reference
                assert not cache.loader.direct and cache.loader.reads > 0
            finally:
                cache.close()
        notes = [r.getMessage() for r in caplog.records if "refuses direct reads" in r.getMessage()]
        assert len(notes) == 1 and str(folder) in notes[0] and "page cache" in notes[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
