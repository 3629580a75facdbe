"""Checksums of what m2r2 reads back: a file's sha256, and a folder's record of its files, the one integrity
scheme for every folder m2r2 writes (adapters, imported models, expert stores).

A folder is sealed: ``complete.json``, each file's size, mtime and sha256, is written last. A folder m2r2 builds
in its cache (an imported model, an expert store) is filled in a temporary sibling, sealed, then renamed into
place, so a folder without the record is unfinished (an import killed half-way) and is built again, never used.
An adapters folder records the files decoding reads (core/integrity.py), and travels with its record to the Hub.
Every load compares sizes and mtimes with the record (one stat per file) and hashes again only a file whose mtime
moved (a copy, a download, a checkout: any of them); ``m2r2-cache verify`` hashes everything.

Builders take ``exclusive(dest)`` first: one process builds a folder at a time, and what a killed build left
behind (its temporary sibling) is removed by the next.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .atomic import atomic_write_text

RECORD = "complete.json"
FORMAT = "m2r2-complete"
VERSION = 1
CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != RECORD)


def record_of(folder: str | Path, names: list[str] | None = None) -> dict:
    """The record of ``folder``'s files (size, mtime, sha256): every file, or those of ``names`` that exist."""
    folder = Path(folder)
    paths = _files(folder) if names is None else [folder / n for n in names if (folder / n).is_file()]
    files = {}
    for path in paths:
        st = path.stat()
        files[path.relative_to(folder).as_posix()] = {
            "bytes": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "sha256": sha256_file(path),
        }
    return {"format": FORMAT, "version": VERSION, "files": files}


def seal(folder: str | Path, names: list[str] | None = None) -> dict:
    """Write ``folder``'s record (every file, or ``names``), last."""
    record = record_of(folder, names)
    atomic_write_text(Path(folder) / RECORD, json.dumps(record, indent=1))
    return record


@dataclass(frozen=True)
class FolderCheck:
    """``state``: "ok", "unfinished" (no completion record) or "damaged"; ``detail`` says what, naming the file."""

    state: str
    detail: str = ""
    files: int = 0

    @property
    def ok(self) -> bool:
        return self.state == "ok"


def read_record(folder: Path) -> dict | None:
    """The folder's completion record, or None when it has none or an unreadable one."""
    try:
        record = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(record.get("files"), dict):
        return None
    return record


def check_folder(folder: str | Path, full: bool = False) -> FolderCheck:
    """Compare ``folder`` with its completion record: sizes and mtimes (a file whose mtime moved is hashed
    again), or every file's sha256 with ``full``."""
    folder = Path(folder)
    if not folder.is_dir():
        return FolderCheck("unfinished", f"{folder} does not exist")
    record = read_record(folder)
    if record is None:
        why = "unreadable" if (folder / RECORD).exists() else "missing"
        return FolderCheck("unfinished", f"its completion record {RECORD} is {why}")
    files = record["files"]
    for name, want in files.items():
        path = folder / name
        try:
            st = path.stat()
        except OSError:
            return FolderCheck("damaged", f"{name} is missing")
        if st.st_size != want.get("bytes"):
            written = want.get("bytes")
            return FolderCheck(
                "damaged", f"{name} is {st.st_size} bytes, {written} when written (truncated or altered)"
            )
        if (full or st.st_mtime_ns != want.get("mtime_ns")) and sha256_file(path) != want.get("sha256"):
            return FolderCheck("damaged", f"{name} fails its checksum (the sha256 recorded when it was written)")
    return FolderCheck("ok", files=len(files))


def _stale(dest: Path) -> re.Pattern:
    # atomic_folder's temporary siblings (mkdtemp's 8 random characters) and the old folder set aside
    return re.compile(rf"^\.{re.escape(dest.name)}\.([a-z0-9_]{{8}}|old-\d+)$")


def _lock(path: Path, what: str) -> int | None:
    """An exclusive flock on ``path`` (created if needed); None where the folder is read-only."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
                return None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another m2r2 process building {what}…", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:  # the holder before us removes the file as it lets go: ours must still be the one at ``path``
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


@contextmanager
def exclusive(dest: str | Path, what: str = "") -> Iterator[None]:
    """Hold ``dest``'s build lock (released by the kernel if this process dies, kill -9 included), and remove
    the temporary siblings a killed build left. Only one process builds a folder at a time; another waits."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    path = dest.parent / f".{dest.name}.lock"
    fd = _lock(path, what or str(dest))
    try:
        if fd is not None:
            stale = _stale(dest)
            for entry in dest.parent.iterdir():
                if stale.match(entry.name):
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)
        yield
    finally:
        if fd is not None:
            path.unlink(missing_ok=True)  # before letting go, so that a waiter sees its file is gone and retries
            os.close(fd)
