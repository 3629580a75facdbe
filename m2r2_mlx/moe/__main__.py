"""python -m m2r2_mlx.moe export --model MODEL -o FOLDER [--force] | verify FOLDER"""

from __future__ import annotations

import argparse
import sys

import m2r2_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx.core on Linux)

from ..errors import run_cli
from ..models.registry import load_model
from .store import ExpertStore

PROG = "python -m m2r2_mlx.moe"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Expert stores for the MoE expert cache (docs/moe.md).")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="write a model's experts to a store folder (memory-mapped at run time)")
    e.add_argument("--model", required=True, help="alias (olmoe), Hugging Face repo id or local MLX folder")
    e.add_argument("-o", "--out", required=True, help="store folder to write")
    e.add_argument("--force", action="store_true", help="replace an existing folder")
    v = sub.add_parser("verify", help="check every expert's checksum in a store folder")
    v.add_argument("folder")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> None:
        if args.command == "export":
            model = load_model(args.model, tokenizer=False).model  # lazy: read one layer at a time
            store = ExpertStore.export(model, args.out, force=args.force)
        else:
            store = ExpertStore.open(args.folder)
            for layer in store.layers:
                for e in range(store.num_experts(layer)):
                    store.read(layer, e)
        n = sum(store.num_experts(l) for l in store.layers)
        print(
            f"{store.folder}: {len(store.layers)} MoE layers, {n} experts, "
            f"{store.expert_bytes()} bytes per expert, checksums {'written' if args.command == 'export' else 'ok'}"
        )

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
