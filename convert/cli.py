"""m2r2-convert: import weights into MLX model/adapter folders.

    m2r2-convert gguf model.Q4_1.gguf -o models/smollm2-f32   # llama GGUF -> float32 MLX folder
"""

from __future__ import annotations

import argparse
import sys

import m2r2_mlx  # noqa: F401  (preloads OpenBLAS on Linux before mlx.core)
from m2r2_mlx.errors import run_cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="m2r2-convert", description="Convert weights into MLX folders for m2r2.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    g = sub.add_parser("gguf", help="import a llama-architecture GGUF as a float32 MLX model folder",
                       description="Dequantize a llama GGUF to float32, undo llama.cpp's rotary q/k permutation, "
                                   "and rebuild its tokenizer and chat template; the folder loads with mlx_lm.load.")
    g.add_argument("gguf", help="path to the .gguf file")
    g.add_argument("-o", "--output", required=True, help="output folder (written atomically)")
    g.add_argument("--force", action="store_true", help="replace an existing output folder")
    return p


def _main() -> int:
    args = build_parser().parse_args()
    if args.command == "gguf":
        from m2r2_mlx.gguf_import import import_gguf

        out = import_gguf(args.gguf, args.output, force=args.force)
        print(f"wrote {out} (try: m2r2-chat --model {out})")
    return 0


def main() -> None:
    sys.exit(run_cli("m2r2-convert", _main))


if __name__ == "__main__":
    main()
