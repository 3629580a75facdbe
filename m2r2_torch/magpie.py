"""Chat requests the base model writes itself (Magpie), sampled with transformers on a GPU: the same filters,
decontamination and file as ``python -m m2r2_mlx.training.magpie``, tens of thousands of requests in minutes.

    python -m m2r2_torch.magpie -n 20000 --decontaminate bench/data/question.jsonl -o prompts.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from m2r2_mlx.atomic import refuse_existing
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.training.magpie import MagpieConfig, add_magpie_arguments, banned_ngrams, sample_requests, write_requests

import torch
from tqdm.auto import tqdm

from .base import load_base
from .generate import generate_batch

PROG = "python -m m2r2_torch.magpie"


def torch_sampling(lm, config: MagpieConfig):
    """``sample_requests``' generate function: each call samples a batch under its own seed (seed, seed + 1, ...),
    so the requests differ from call to call and a rerun draws the same ones."""
    calls = itertools.count(config.seed * 1_000_003)
    return lambda prompts, max_tokens: generate_batch(
        lm,
        prompts,
        max_tokens,
        batch_size=config.batch_size,
        temperature=config.temperature,
        top_p=config.top_p,
        seed=next(calls),
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_magpie_arguments(p)
    p.add_argument("--batch-size", type=int, default=512, help="requests sampled per pass (default 512)")
    return p


def _main() -> int:
    args = build_parser().parse_args()
    if args.requests < 1:
        raise M2R2Error(f"--requests must be at least 1, got {args.requests}")
    out = Path(args.output)
    refuse_existing(out, args.force)
    config = MagpieConfig(args.temperature, args.top_p, args.max_tokens, args.seed, args.overlap, args.batch_size)
    banned = banned_ngrams(args.decontaminate, config.overlap)
    lm = load_base(args.model, "cuda" if torch.cuda.is_available() else "cpu")
    with tqdm(total=args.requests, desc="sampling requests", unit="request") as bar:
        requests, dropped = sample_requests(
            lm, args.requests, config, banned=banned, progress=bar.update, generate=torch_sampling(lm, config)
        )
    write_requests(out, requests, dropped)
    return 0


def main() -> None:
    sys.exit(run_cli(PROG, _main))


if __name__ == "__main__":
    main()
