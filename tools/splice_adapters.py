"""One adapters folder from two of the same shape: the first interval (its adapters and the context feature) from
one, every deeper interval and the rest of the folder (ARLA, draft vocabulary) from the other. A run that trains the
drafting interval alone (``--train-gates 6``) is spliced onto the packaged deeper intervals this way, so early exit
loses nothing; retrain ARLA on the result (``m2r2-train --stage arla --init OUT``), since its first gate's states
changed.

    python -m m2r2_tools.splice_adapters --first build/gpu3 --rest m2r2_mlx/trained/smollm2 -o build/gpu3-spliced
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from m2r2_mlx.atomic import atomic_folder, refuse_existing
from m2r2_mlx.checksums import RECORD
from m2r2_mlx.core.config import ADAPTERS_FILE, CONFIG_FILE, M2R2Config
from m2r2_mlx.core.integrity import record_hashes
from m2r2_mlx.errors import M2R2Error, run_cli

from safetensors.numpy import load_file, save_file

PROG = "python -m m2r2_tools.splice_adapters"


def first_interval_keys(cfg: M2R2Config, names: list[str]) -> list[str]:
    """The tensors of the first interval: its layers' adapters and the context feature."""
    start, stop = cfg.intervals()[0]
    layers = {f"adapters.{i}." for i in range(start, stop)}
    return [k for k in names if k.startswith("context.") or any(k.startswith(p) for p in layers)]


def splice(first: Path, rest: Path, out: Path, force: bool = False) -> list[str]:
    """Write ``out``; returns the names of the tensors taken from ``first``."""
    cfgs = [M2R2Config.load(folder) for folder in (first, rest)]
    shape = [(c.gates, c.adapter_rank, c.adapter_form, c.context_feature, c.base_config_hash) for c in cfgs]
    if shape[0] != shape[1]:
        raise M2R2Error(f"{first} and {rest} differ in gates, ranks, form, context feature or base; splice alike ones")
    a, b = load_file(str(first / ADAPTERS_FILE)), load_file(str(rest / ADAPTERS_FILE))
    taken = first_interval_keys(cfgs[0], sorted(a))
    if any(k not in b or a[k].shape != b[k].shape for k in taken):
        raise M2R2Error(f"{first}'s first interval does not fit {rest}'s; splice folders of the same shape")
    refuse_existing(out, force)
    with atomic_folder(out) as tmp:
        for f in rest.iterdir():
            if f.is_file() and f.name not in (ADAPTERS_FILE, RECORD):
                shutil.copy2(f, tmp / f.name)
        save_file({**b, **{k: a[k] for k in taken}}, str(tmp / ADAPTERS_FILE))
        config = json.loads((tmp / CONFIG_FILE).read_text())
        config.setdefault("extra", {})["spliced"] = {"first_interval": str(first), "rest": str(rest)}
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    record_hashes(out)  # checksums, as every adapters folder m2r2 writes has them
    return taken


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--first", type=Path, required=True, help="adapters whose first interval is taken")
    p.add_argument("--rest", type=Path, required=True, help="adapters giving everything else")
    p.add_argument("-o", "--out", type=Path, required=True, help="the adapters folder to write")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    return p


def _main() -> int:
    args = build_parser().parse_args()
    taken = splice(args.first, args.rest, args.out, args.force)
    print(f"wrote {args.out}: {len(taken)} tensors of the first interval from {args.first}, the rest from {args.rest}")
    return 0


def main() -> None:
    sys.exit(run_cli(PROG, _main))


if __name__ == "__main__":
    main()
