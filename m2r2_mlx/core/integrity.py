"""An adapters folder's integrity: the sha256 of the files decoding reads, in the folder's record (checksums.py:
``complete.json``, the scheme every folder m2r2 writes uses), checked before any of them loads.

Early exit is lossy, so adapters with a flipped byte would decode without a word; with the record a damaged or
altered copy fails in one line naming the file and where a good copy comes from. Every writer (m2r2-train,
m2r2-train-torch, m2r2-convert, the draft vocabulary) calls ``record_hashes`` once its files are written; the
upload sends the record with the files, so a Hub download is checked too. m2r2_config.json is not recorded: it is
validated field by field when read, and stays editable by hand (base_model, exit_vocab).

    python -m m2r2_mlx.core.integrity FOLDER       # record the hashes of a folder written before they were kept
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from huggingface_hub import constants

from ..checksums import RECORD, check_folder, read_record, record_of, seal, sha256_file
from ..errors import M2R2Error, run_cli
from .config import ADAPTERS_FILE, CONFIG_FILE, PACKAGED

log = logging.getLogger("m2r2")
# the files decoding (or m2r2-convert, for a PyTorch checkpoint) reads; data caches and checkpoints are not hashed
HASHED = (ADAPTERS_FILE, "draft_vocab.json", "adapters.pt")
RECORD_COMMAND = "python -m m2r2_mlx.core.integrity"

_verified: set[tuple] = set()  # folders (with their files' sizes and mtimes) found intact in this process
_noted: set[Path] = set()  # folders without a record, already noted once


def _adapters_folder(folder: Path) -> Path:
    if not (folder / CONFIG_FILE).is_file():
        raise M2R2Error(f"{folder} has no {CONFIG_FILE}; it is not an M2R2 adapters folder")
    return folder


def current_hashes(folder: str | Path) -> dict[str, str]:
    """The sha256 of each of ``folder``'s hashed files that exists."""
    folder = Path(folder)
    return {name: sha256_file(folder / name) for name in HASHED if (folder / name).is_file()}


def new_record(folder: str | Path) -> dict:
    """The record ``record_hashes`` would write for ``folder`` now (what an upload sends for an unrecorded one)."""
    return record_of(folder, list(HASHED))


def record_hashes(folder: str | Path) -> dict[str, str]:
    """Record the sha256 of ``folder``'s hashed files in its record (written atomically)."""
    folder = _adapters_folder(Path(folder))
    return {name: f["sha256"] for name, f in seal(folder, list(HASHED))["files"].items()}


def recorded_hashes(folder: str | Path) -> dict[str, str] | None:
    """The hashes ``folder``'s record holds; None for a folder written before they were kept."""
    folder = _adapters_folder(Path(folder))
    record = read_record(folder)
    if record is None:
        if (folder / RECORD).exists():
            raise M2R2Error(f"{folder / RECORD} is unreadable; {remedy(folder)}")
        return None
    return {name: f.get("sha256") for name, f in record["files"].items()}


def remedy(folder: Path) -> str:
    """Where a good copy of ``folder`` comes from, as the end of an error line."""
    resolved = folder.resolve()
    if resolved.is_relative_to(PACKAGED):
        return "reinstall m2r2-mlx (pip install --force-reinstall --no-deps m2r2-mlx; in a clone: git checkout .)"
    if resolved.is_relative_to(Path(constants.HF_HUB_CACHE).resolve()):
        repo = next((p for p in resolved.parts if p.startswith("models--")), None)
        repo_id = repo.removeprefix("models--").replace("--", "/") if repo else "OWNER/NAME"
        return f"re-download it (hf download {repo_id} --force-download)"
    return "re-convert it with m2r2-convert or retrain it with m2r2-train (or copy it again from where it came)"


def _signature(folder: Path) -> tuple:
    stats = []
    for name in (RECORD, *HASHED):
        try:
            st = (folder / name).stat()
            stats.append((name, st.st_size, st.st_mtime_ns))
        except OSError:
            stats.append((name, None, None))
    return (folder.resolve(), tuple(stats))


def verify_adapters(folder: str | Path, fix: str | None = None, note: bool = True) -> None:
    """Check ``folder``'s files against its record; one M2R2Error line naming the file and ``fix`` (default: where
    a good copy comes from) on a mismatch. A folder without a record loads, with one note line per folder
    (``note``)."""
    folder = Path(folder)
    key = _signature(folder)
    if key in _verified:
        return
    recorded = recorded_hashes(folder)
    fix = fix or remedy(folder)
    if recorded is None:
        if note and folder.resolve() not in _noted:
            _noted.add(folder.resolve())
            log.warning(
                "note: %s records no checksums of its files (written before m2r2 kept them), so damage to them "
                "cannot be detected; record them with: %s %s",
                folder,
                RECORD_COMMAND,
                folder,
            )
        return
    added = [name for name in HASHED if name not in recorded and (folder / name).is_file()]
    if added:
        raise M2R2Error(
            f"{folder / added[0]} is not among the files {RECORD} records (added after the folder was written); "
            f"{fix}, or, if you trust it, record it with: {RECORD_COMMAND} {folder}"
        )
    check = check_folder(folder)
    if not check.ok:
        raise M2R2Error(f"the adapters in {folder} are damaged: {check.detail}; {fix}")
    _verified.add(key)


def verify_if_recorded(folder: str | Path) -> None:
    """``verify_adapters`` for a folder that may not be an adapters folder (m2r2-convert's input): checks only
    what a record covers, and says nothing about folders without one."""
    folder = Path(folder)
    if (folder / CONFIG_FILE).is_file():
        verify_adapters(folder, note=False)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=RECORD_COMMAND,
        description=f"Record the sha256 of an adapters folder's files in its {RECORD}, as m2r2's writers do: for a "
        "folder written before they were kept, or one you changed on purpose.",
    )
    p.add_argument("folders", nargs="+", metavar="FOLDER", help="adapters folders (holding m2r2_config.json)")
    return p


def _main() -> int:
    args = build_parser().parse_args()
    for folder in args.folders:
        hashes = record_hashes(Path(folder).expanduser())
        print(f"{folder}: recorded the sha256 of {', '.join(hashes) or 'no files'}")
    return 0


def main() -> None:
    sys.exit(run_cli(RECORD_COMMAND, _main))


if __name__ == "__main__":
    main()
