"""m2r2-cache: what m2r2 keeps on disk, checking it, and removing it.

    m2r2-cache list                         # imported models and MoE expert stores, with their sizes
    m2r2-cache verify [NAME ...]            # every file against the sha256 recorded when it was written
    m2r2-cache remove experts/olmoe-1a2b    # asks first; --yes for scripts
    m2r2-cache remove --all --yes

m2r2's cache ($M2R2_HOME, else ~/.cache/m2r2-mlx) holds GGUF imports (models/), the expert stores that
--memory-budget exports (experts/). Models downloaded from the Hub live in the Hugging Face cache instead:
`hf cache scan` / `hf cache delete` manage those.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..checksums import check_folder
from ..errors import M2R2Error, run_cli
from .paths import cache_home

KINDS = {"models": "imported model", "experts": "expert store"}
UNFINISHED = "unfinished write"  # a build's temporary folder: in progress, or left by one that was killed


@dataclass
class Entry:
    name: str  # "models/<folder>" or "experts/<folder>"
    kind: str
    path: Path
    size: int


def folder_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _members(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir())


def entries(home: Path | None = None) -> list[Entry]:
    home = home or cache_home()
    found = []
    for sub, kind in KINDS.items():
        if (home / sub).is_dir():
            for path in _members(home / sub):
                hidden = path.name.startswith(".")
                found.append(Entry(f"{sub}/{path.name}", UNFINISHED if hidden else kind, path, folder_size(path)))
    return found


def verify(entry: Entry) -> str | None:
    """None when ``entry`` matches what was recorded when it was written; else what is wrong and the fix."""
    if entry.kind == UNFINISHED:
        return "a build's temporary folder (in progress, or killed); removed by the next build, or remove it"
    check = check_folder(entry.path, full=True)
    if check.ok:
        return None
    redo = "run again to import it anew" if entry.kind == "imported model" else "it is exported again at next use"
    if check.state == "unfinished":
        return f"unfinished ({check.detail}: killed half-way, or written by an older m2r2); {redo}"
    return f"damaged: {check.detail}; m2r2-cache remove {entry.name}, then {redo}"


def human(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return ""


def pick(names: list[str], every: bool, found: list[Entry]) -> list[Entry]:
    """The entries ``names`` mean: as `list` prints them (models/X), or the folder name alone when unique."""
    if every:
        return found
    chosen = []
    for name in names:
        hits = [e for e in found if name.rstrip("/") in (e.name, e.path.name)]
        if not hits:
            raise M2R2Error(f"{name!r} is not in m2r2's cache ({cache_home()}); `m2r2-cache list` shows what is")
        if len(hits) > 1:
            raise M2R2Error(
                f"{name!r} names {len(hits)} entries; write it as `m2r2-cache list` prints it, e.g. {hits[0].name}"
            )
        chosen += [e for e in hits if e not in chosen]
    return chosen


def confirm(chosen: list[Entry]) -> bool:
    if not sys.stdin.isatty():
        raise M2R2Error("removing needs confirmation and there is no terminal to ask in; pass --yes")
    answer = input(
        f"remove {len(chosen)} entr{'y' if len(chosen) == 1 else 'ies'}, {human(sum(e.size for e in chosen))}? [y/N] "
    )
    return answer.strip().lower() in ("y", "yes")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="m2r2-cache",
        description="List, verify or remove what m2r2 keeps in its cache (imported models, MoE expert stores, "
        "step costs).",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("list", help="imported models, expert stores and step costs, with their sizes")
    v = sub.add_parser("verify", help="check every file against the sha256 recorded when it was written")
    v.add_argument("names", nargs="*", help="entries as `m2r2-cache list` prints them (default: all)")
    r = sub.add_parser("remove", help="delete entries (asks first unless --yes)")
    r.add_argument("names", nargs="*", help="entries as `m2r2-cache list` prints them (models/NAME, experts/NAME)")
    r.add_argument("--all", action="store_true", help="every entry")
    r.add_argument("-y", "--yes", action="store_true", help="do not ask")
    return p


def _main() -> int:
    args = build_parser().parse_args()
    found = entries()
    if args.command == "list":
        if not found:
            print(f"m2r2's cache ({cache_home()}) is empty")
            return 0
        width = max(len(e.name) for e in found)
        for e in found:
            print(f"{e.name:<{width}}  {human(e.size):>9}  {e.kind}")
        print(f"{'total':<{width}}  {human(sum(e.size for e in found)):>9}  in {cache_home()}")
        return 0
    if args.command == "verify":
        return verify_entries(pick(args.names, not args.names, found))
    if not args.names and not args.all:
        raise M2R2Error("say what to remove: entries as `m2r2-cache list` prints them, or --all")
    chosen = pick(args.names, args.all, found)
    if not chosen:
        print("nothing to remove")
        return 0
    if not args.yes and not confirm(chosen):
        print("nothing removed")
        return 1
    for e in chosen:
        if e.path.is_dir():
            shutil.rmtree(e.path)
        else:
            e.path.unlink()
        print(f"removed {e.name} ({human(e.size)})")
    return 0


def verify_entries(chosen: list[Entry]) -> int:
    """One line per entry: ok, or what is wrong and the fix; exit status 1 if any is not ok."""
    if not chosen:
        print(f"m2r2's cache ({cache_home()}) is empty")
        return 0
    width = max(len(e.name) for e in chosen)
    bad = 0
    for e in chosen:
        problem = verify(e)
        bad += problem is not None
        print(f"{e.name:<{width}}  {problem or 'ok'}", flush=True)
    print(f"{len(chosen) - bad} of {len(chosen)} entries intact")
    return 1 if bad else 0


def main() -> None:
    sys.exit(run_cli("m2r2-cache", _main))


if __name__ == "__main__":
    main()
