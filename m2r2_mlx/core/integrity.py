"""The sha256 of an adapters folder's files, recorded in its m2r2_config.json and checked before they load.

Early exit is lossy, so adapters with a flipped byte would decode without a word; with the hashes a damaged or
altered copy fails in one line naming the file and where a good copy comes from. Every writer (m2r2-train,
m2r2-train-torch, m2r2-convert, the draft vocabulary) calls ``record_hashes`` once its files are written; the
upload sends the record with the files, so a Hub download is checked too. m2r2_config.json itself is not hashed:
it holds the record, is validated field by field when read, and stays editable by hand (base_model, exit_vocab).

    python -m m2r2_mlx.core.integrity FOLDER       # record the hashes of a folder written before they were kept
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from huggingface_hub import constants

from ..atomic import atomic_write_text
from ..checksums import sha256_file
from ..errors import M2R2Error, run_cli
from .config import ADAPTERS_FILE, CONFIG_FILE

log = logging.getLogger("m2r2")
KEY = "integrity"  # m2r2_config.json: {"integrity": {"sha256": {file name: hex digest}}}
# the files decoding (or m2r2-convert, for a PyTorch checkpoint) reads; data caches and checkpoints are not hashed
HASHED = (ADAPTERS_FILE, "draft_vocab.json", "adapters.pt")
PACKAGED = Path(__file__).resolve().parents[1] / "trained"
RECORD_COMMAND = "python -m m2r2_mlx.core.integrity"

_verified: set[tuple] = set()  # folders (with their files' sizes and mtimes) found intact in this process
_noted: set[Path] = set()  # folders without a record, already noted once


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise M2R2Error(f"{folder} has no {CONFIG_FILE}; it is not an M2R2 adapters folder") from None
    except (OSError, ValueError) as e:
        raise M2R2Error(f"{path} is not a valid M2R2 config ({e})") from None
    if not isinstance(data, dict):
        raise M2R2Error(f"{path} is not a valid M2R2 config (not a JSON object)")
    return data


def current_hashes(folder: str | Path) -> dict[str, str]:
    """The sha256 of each of ``folder``'s hashed files that exists."""
    folder = Path(folder)
    return {name: sha256_file(folder / name) for name in HASHED if (folder / name).is_file()}


def config_with_hashes(folder: str | Path, hashes: dict[str, str]) -> dict:
    """``folder``'s m2r2_config.json as a dict, its record replaced by ``hashes`` (everything else kept)."""
    data = _read_config(Path(folder))
    data[KEY] = {"sha256": dict(hashes)}
    return data


def record_hashes(folder: str | Path) -> dict[str, str]:
    """Record the sha256 of ``folder``'s files in its m2r2_config.json (rewritten atomically, all else kept)."""
    folder = Path(folder)
    hashes = current_hashes(folder)
    atomic_write_text(folder / CONFIG_FILE, json.dumps(config_with_hashes(folder, hashes), indent=2))
    return hashes


def recorded_hashes(folder: str | Path) -> dict[str, str] | None:
    """The hashes ``folder``'s m2r2_config.json records; None for a folder written before they were kept."""
    record = _read_config(Path(folder)).get(KEY)
    if record is None:
        return None
    hashes = record.get("sha256") if isinstance(record, dict) else None
    if not isinstance(hashes, dict) or not all(isinstance(v, str) for v in hashes.values()):
        raise M2R2Error(f"{Path(folder) / CONFIG_FILE} has a malformed {KEY!r} entry; {remedy(Path(folder))}")
    return hashes


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
    for name in (CONFIG_FILE, *HASHED):
        try:
            st = (folder / name).stat()
            stats.append((name, st.st_size, st.st_mtime_ns))
        except OSError:
            stats.append((name, None, None))
    return (folder.resolve(), tuple(stats))


def verify_adapters(folder: str | Path, fix: str | None = None, note: bool = True) -> None:
    """Check ``folder``'s files against the hashes its m2r2_config.json records; one M2R2Error line naming the
    file and ``fix`` (default: where a good copy comes from) on a mismatch. A folder without a record loads,
    with one note line per folder (``note``)."""
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
    for name in HASHED:
        path = folder / name
        if name not in recorded:
            if path.is_file():
                raise M2R2Error(
                    f"{path} is not among the files {CONFIG_FILE} records (added after the folder was written); "
                    f"{fix}, or, if you trust it, record it with: {RECORD_COMMAND} {folder}"
                )
            continue
        if not path.is_file():
            raise M2R2Error(f"{path} is missing, though {CONFIG_FILE} records it; {fix}")
        if sha256_file(path) != recorded[name]:
            raise M2R2Error(
                f"{path} does not match the sha256 its {CONFIG_FILE} records (truncated, damaged or altered); {fix}"
            )
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
        description="Record the sha256 of an adapters folder's files in its m2r2_config.json, as m2r2's writers "
        "do: for a folder written before they were kept, or one you changed on purpose.",
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
