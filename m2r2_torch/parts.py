"""A large file carried in parts: split it into pieces of at most N MiB with a manifest of sha256 sums, and join them
back elsewhere, every piece and the whole checked, byte for byte (the embedded 94 MB GGUF reaches a GPU machine whose
inputs travel at most 64 MiB at a time).

    python -m m2r2_torch.parts split model.gguf job/gguf/          # job/gguf/model.gguf.000, .001, manifest.json
    python -m m2r2_torch.parts join job/gguf/ work/model.gguf       # checked; written atomically
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from m2r2_mlx.atomic import atomic_write_text, refuse_existing
from m2r2_mlx.checksums import sha256_file
from m2r2_mlx.errors import M2R2Error, run_cli

PROG = "python -m m2r2_torch.parts"
MANIFEST = "manifest.json"
DEFAULT_PART_MIB = 60


def split(source: str | Path, folder: str | Path, part_mib: int = DEFAULT_PART_MIB, force: bool = False) -> Path:
    """``source`` as parts ``NAME.000, NAME.001, ...`` of at most ``part_mib`` MiB in ``folder``, with manifest.json
    (the whole file's name, size and sha256, and each part's)."""
    source, folder = Path(source), Path(folder)
    if not source.is_file():
        raise M2R2Error(f"{source} not found; pass the file to split")
    if part_mib < 1:
        raise M2R2Error(f"--part-mib must be at least 1 (got {part_mib})")
    if (folder / MANIFEST).exists():
        refuse_existing(folder / MANIFEST, force)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(f"{source.name}.[0-9][0-9][0-9]"):  # an earlier split's, in other sizes
        stale.unlink()
    parts, size = [], part_mib << 20
    with open(source, "rb") as f:
        while block := f.read(size):
            part = folder / f"{source.name}.{len(parts):03d}"
            part.write_bytes(block)
            parts.append({"file": part.name, "size": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    manifest = {"name": source.name, "size": source.stat().st_size, "sha256": sha256_file(source), "parts": parts}
    atomic_write_text(folder / MANIFEST, json.dumps(manifest, indent=2))  # last: a manifest means complete parts
    return folder / MANIFEST


def join(folder: str | Path, dest: str | Path, force: bool = False) -> Path:
    """The file the parts in ``folder`` came from, at ``dest``; each part and the whole checked against the manifest
    before ``dest`` appears (written to a temporary sibling, then renamed)."""
    folder, dest = Path(folder), Path(dest)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        parts = manifest["parts"]
    except (OSError, ValueError, KeyError, TypeError):
        raise M2R2Error(
            f"{folder / MANIFEST} is missing or not a parts manifest; split the file with "
            "python -m m2r2_torch.parts split"
        ) from None
    if dest.exists():
        refuse_existing(dest, force)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.joining")
    whole = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for p in parts:
                path = folder / p["file"]
                if not path.is_file():
                    raise M2R2Error(f"part {path} named by {MANIFEST} is missing; copy every part")
                block = path.read_bytes()
                if len(block) != p["size"] or hashlib.sha256(block).hexdigest() != p["sha256"]:
                    raise M2R2Error(
                        f"part {path} does not match its sha256 in {MANIFEST}; it was damaged in transit, copy it again"
                    )
                whole.update(block)
                out.write(block)
        if whole.hexdigest() != manifest["sha256"]:
            raise M2R2Error(f"the joined parts do not match {manifest['name']}'s sha256; split it again")
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split", help="split FILE into parts in FOLDER, with manifest.json")
    s.add_argument("file")
    s.add_argument("folder")
    s.add_argument("--part-mib", type=int, default=DEFAULT_PART_MIB, help=f"largest part (default {DEFAULT_PART_MIB})")
    s.add_argument("--force", action="store_true", help="replace an existing manifest")
    j = sub.add_parser("join", help="join the parts in FOLDER into FILE, checking every sha256")
    j.add_argument("folder")
    j.add_argument("file")
    j.add_argument("--force", action="store_true", help="replace an existing FILE")
    return p


def _main() -> int:
    args = build_parser().parse_args()
    if args.command == "split":
        manifest = split(args.file, args.folder, args.part_mib, args.force)
        n = len(json.loads(manifest.read_text())["parts"])
        print(f"wrote {n} parts of at most {args.part_mib} MiB and {manifest}")
    else:
        print(f"wrote {join(args.folder, args.file, args.force)} (every part and the whole match their sha256)")
    return 0


def main() -> None:
    sys.exit(run_cli(PROG, _main))


if __name__ == "__main__":
    main()
