"""Atomic folders: all or nothing, the old folder intact on failure, permissions as for any new folder."""

import os
import stat

from m2r2_mlx.atomic import atomic_folder

import pytest


def test_folder_appears_whole_with_umask_permissions(tmp_path):
    dest = tmp_path / "out"
    old = os.umask(0o022)
    try:
        with atomic_folder(dest) as tmp:
            (tmp / "a.txt").write_text("a")
            assert not dest.exists()  # nothing visible until the block ends
    finally:
        os.umask(old)
    assert (dest / "a.txt").read_text() == "a"
    assert stat.S_IMODE(dest.stat().st_mode) == 0o755  # not mkdtemp's private 0700


def test_failure_keeps_the_old_folder_and_keep_carries_files(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "data.npy").write_text("cache")
    (dest / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_folder(dest) as tmp:
            (tmp / "new.txt").write_text("half")
            raise RuntimeError("disk full")
    assert sorted(p.name for p in dest.iterdir()) == ["data.npy", "old.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left behind
    with atomic_folder(dest, keep=("data.npy",)) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in dest.iterdir()) == ["data.npy", "new.txt"]
