"""Chat requests the base model writes itself (Magpie), sampled with transformers on a GPU: the same filters,
decontamination and file as ``python -m m2r2_mlx.training.magpie``, tens of thousands of requests in minutes.

    python -m m2r2_torch.magpie -n 20000 --decontaminate bench/data/question.jsonl -o prompts.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from m2r2_mlx.atomic import atomic_write_text, refuse_existing
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.training.magpie import evaluation_ngrams, sample_requests

import torch
from tqdm.auto import tqdm

from .base import load_base
from .generate import generate_batch


def torch_sampling(lm, temperature: float, top_p: float, seed: int, batch_size: int):
    """``sample_requests``' generate function: each call samples a batch under its own seed (seed, seed + 1, ...),
    so the requests differ from call to call and a rerun draws the same ones."""
    calls = itertools.count(seed * 1_000_003)
    return lambda prompts, max_tokens: generate_batch(
        lm, prompts, max_tokens, batch_size=batch_size, temperature=temperature, top_p=top_p, seed=next(calls)
    )


def _main() -> int:
    ap = argparse.ArgumentParser(prog="python -m m2r2_torch.magpie", description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", required=True, help="prompts jsonl to write (one {'category', 'turns'} per line)")
    ap.add_argument("-n", "--requests", type=int, default=400, help="distinct requests to keep (default 400)")
    ap.add_argument("--model", default=None, help="base model: alias, folder, .gguf or repo id (default: smollm2)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--max-tokens", type=int, default=96, help="a request still open after this many tokens is dropped")
    ap.add_argument("--batch-size", type=int, default=512, help="requests sampled per pass (default 512)")
    ap.add_argument(
        "--decontaminate",
        metavar="QUESTIONS.jsonl",
        help="drop requests sharing --overlap consecutive words with these evaluation questions",
    )
    ap.add_argument("--overlap", type=int, default=8, help="words in a run that counts as overlap (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="replace an existing output file")
    args = ap.parse_args()
    if args.requests < 1:
        raise M2R2Error(f"--requests must be at least 1, got {args.requests}")
    out = Path(args.output)
    refuse_existing(out, args.force)
    banned = evaluation_ngrams(Path(args.decontaminate), args.overlap) if args.decontaminate else set()
    lm = load_base(args.model, "cuda" if torch.cuda.is_available() else "cpu")
    generate = torch_sampling(lm, args.temperature, args.top_p, args.seed, args.batch_size)
    with tqdm(total=args.requests, desc="sampling requests", unit="request") as bar:
        requests, dropped = sample_requests(
            lm,
            args.requests,
            max_tokens=args.max_tokens,
            banned=banned,
            overlap=args.overlap,
            batch_size=args.batch_size,
            progress=bar.update,
            generate=generate,
        )
    atomic_write_text(out, "".join(json.dumps({"category": "magpie", "turns": [r]}) + "\n" for r in requests))
    print(f"wrote {len(requests)} requests to {out}; dropped: " + ", ".join(f"{k} {v}" for k, v in dropped.items()))
    return 0


def main() -> None:
    sys.exit(run_cli("python -m m2r2_torch.magpie", _main))


if __name__ == "__main__":
    main()
