"""m2r2-convert: import weights into MLX model/adapter folders.

m2r2-convert gguf model.Q4_1.gguf -o models/smollm2-f32          # llama GGUF -> float32 MLX folder
m2r2-convert gguf model.Q4_1.gguf -o models/smollm2-q4 --keep-quantized   # Q4/Q8 kept as MLX 4/8-bit
m2r2-convert checkpoint adapters.pt --base smollm2 -o out/       # PyTorch adapters -> MLX adapters folder
m2r2-convert adapters.pt --base smollm2 -o out/                  # the same: checkpoint is the default
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import m2r2_mlx  # (first: preloads OpenBLAS on Linux before mlx.core)
from m2r2_mlx.core.adapters import refuse_existing
from m2r2_mlx.core.config import parse_layers
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.models.gguf_import import import_gguf
from m2r2_mlx.models.registry import load_model

from .checkpoint import format_table, plan_conversion, write_conversion
from .sources import read_checkpoint

COMMANDS = ("gguf", "checkpoint")
DTYPES = ("float32", "float16", "bfloat16")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="m2r2-convert",
        description="Convert weights into MLX folders for m2r2. "
        "Without a command, the arguments are those of 'checkpoint'.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {m2r2_mlx.__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_gguf_parser(sub)
    add_checkpoint_parser(sub)
    return p


def add_gguf_parser(sub) -> None:
    g = sub.add_parser(
        "gguf",
        help="import a llama-architecture GGUF as a float32 MLX model folder",
        description="Dequantize a llama GGUF to float32, undo llama.cpp's rotary q/k permutation, "
        "and rebuild its tokenizer and chat template; the folder loads with mlx_lm.load.",
    )
    g.add_argument("gguf", help="path to the .gguf file")
    g.add_argument("-o", "--output", required=True, help="output folder (written atomically)")
    g.add_argument("--force", action="store_true", help="replace an existing output folder")
    g.add_argument(
        "--keep-quantized",
        action="store_true",
        help="keep Q4_0, Q4_1 and Q8_0 tensors quantized, as MLX's affine 4/8-bit weights (exact, 4-7x "
        "smaller than float32; faster on Apple silicon, slower than float32 on a CPU)",
    )


def add_checkpoint_parser(sub) -> None:
    c = sub.add_parser(
        "checkpoint",
        help="turn PyTorch-trained adapters (own layout or PEFT LoRA) into an M2R2 adapters folder",
        description="Read a PyTorch state dict (.pt/.pth/.bin), .safetensors, a sharded checkpoint "
        "(*.index.json) or a folder; map its names to M2R2's, check every key and shape "
        "against the base model, and write an adapters folder for m2r2-chat --adapters.",
    )
    c.add_argument("checkpoint", help="checkpoint file, shard index, or folder (a PEFT output folder works as it is)")
    c.add_argument(
        "--base", required=True, help="the base model the adapters were trained for: alias (smollm2), repo id or folder"
    )
    c.add_argument("-o", "--output", help="adapters folder to write (written atomically)")
    gates = c.add_mutually_exclusive_group()
    gates.add_argument(
        "--gates",
        help="exit gates, e.g. 6,12,18,24 (default: from m2r2_config.json beside the checkpoint, else every 6 layers)",
    )
    gates.add_argument("--every", type=int, help="a gate every N layers")
    c.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="dtype of the written adapters (default: float32)"
    )
    c.add_argument(
        "--dry-run", action="store_true", help="print the name mapping (source, target, shape, dtype); write nothing"
    )
    c.add_argument("--force", action="store_true", help="replace an existing output folder")


def parser_for(argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser and the arguments it reads: the short form `m2r2-convert CKPT --base B -o OUT` means
    `m2r2-convert checkpoint CKPT ...`."""
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help", "--version"):
        argv = ["checkpoint", *argv]
    return build_parser(), argv


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser, argv = parser_for(argv)
    return parser.parse_args(argv)


@dataclass(frozen=True)
class CheckpointJob:
    """What ``m2r2-convert checkpoint`` is asked to do."""

    checkpoint: str  # a checkpoint file, shard index or folder
    base: str  # the base model the adapters were trained for
    output: str | None = None  # the adapters folder to write (None: only with dry_run)
    gates: list[int] | None = None  # None: from m2r2_config.json beside the checkpoint, or every `every` layers
    every: int | None = None
    dtype: str = "float32"  # one of DTYPES
    dry_run: bool = False  # print the name mapping, write nothing
    force: bool = False  # replace an existing output folder


def convert_checkpoint(job: CheckpointJob) -> None:
    if not job.output and not job.dry_run:
        raise M2R2Error("say where to write the adapters with -o OUT_DIR (or look first with --dry-run)")
    if job.every is not None and job.every < 1:
        raise M2R2Error(f"--every must be at least 1 (got {job.every})")
    if not job.dry_run:
        refuse_existing(job.output, job.force)  # before any work
    ckpt = read_checkpoint(job.checkpoint)
    lm = load_model(job.base, tokenizer=False)
    conversion = plan_conversion(ckpt, lm, gates=job.gates, every=job.every)
    if job.dry_run:
        print(format_table(conversion, job.dtype))
        print("dry run: nothing written")
        return
    out = write_conversion(conversion, job.output, dtype=job.dtype, force=job.force)
    cfg = conversion.config
    print(
        f"wrote {out}: {conversion.layout} -> {cfg.adapter_form}, gates {cfg.gates}, {job.dtype} "
        f"(try: m2r2-chat --model {job.base} --adapters {out} --mode speculative)"
    )


def _main() -> int:
    args = parse_args(sys.argv[1:])
    if args.command == "gguf":
        out = import_gguf(args.gguf, args.output, force=args.force, keep_quantized=args.keep_quantized)
        print(f"wrote {out} (try: m2r2-chat --model {out})")
    elif args.command == "checkpoint":
        job = CheckpointJob(
            args.checkpoint,
            args.base,
            args.output,
            list(parse_layers(args.gates)) if args.gates else None,
            args.every,
            args.dtype,
            args.dry_run,
            args.force,
        )
        convert_checkpoint(job)
    return 0


def main() -> None:
    sys.exit(run_cli("m2r2-convert", _main))


if __name__ == "__main__":
    main()
