"""Atomic writes: a file or folder appears complete or not at all, never half-written."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .errors import M2R2Error


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def refuse_existing(folder: str | Path, overwrite: bool = False) -> None:
    """An existing folder is only replaced when asked to (--force)."""
    if Path(folder).exists() and not overwrite:
        raise M2R2Error(f"{folder} already exists; choose another folder or pass --force")


@contextmanager
def atomic_folder(dest: str | Path, keep: Sequence[str] = ()) -> Iterator[Path]:
    """Yield a temporary sibling folder to fill; on success it replaces ``dest`` in one rename.

    Callers decide beforehand whether replacing an existing ``dest`` is allowed. Entries of
    the old ``dest`` named in ``keep`` (and not written anew) move into the new folder.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would make the finished folder private
    old, aside = dest.with_name(f".{dest.name}.old-{os.getpid()}"), False
    try:
        yield tmp
        for name in keep:
            if (dest / name).exists() and not (tmp / name).exists():
                os.replace(dest / name, tmp / name)
        # the old folder is renamed aside, not deleted in place: a process killed here leaves either the old
        # folder or the new one at ``dest``, never a half-deleted one (checksums.exclusive removes the aside)
        if dest.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(dest, old)
            aside = True
        os.replace(tmp, dest)
    except BaseException:
        if aside and not dest.exists():
            os.replace(old, dest)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _atomic_write(path: str | Path, write, mode: str) -> Path:
    """Write ``path`` through ``write(file)`` into a temporary sibling, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would make shared files private
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return _atomic_write(path, lambda f: f.write(text), "w")


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    return _atomic_write(path, lambda f: f.write(data), "wb")


def atomic_save_npy(path: str | Path, array) -> Path:
    """``np.save`` that never leaves a half-written file (training rows, loss masks)."""
    return _atomic_write(path, lambda f: np.save(f, array), "wb")


def atomic_save_figure(fig, path: str | Path, dpi: int = 120) -> Path:
    """Save a matplotlib figure as PNG atomically (a plot beside a table is never half-written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=dpi)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
