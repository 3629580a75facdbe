"""Choose the speculative defaults by measurement: gate x max draft x confidence threshold x draft vocabulary
x what happens to the draft below the threshold (dropped, or verified as the last one).

    python -m experiments.spec_sweep --gates 6,12 --drafts 2,4 --thresholds 0,0.3 --draft-vocabs 0,8192 --limit 1

Greedy, batch 1, one warm-up; prompts are Spec-Bench first turns (MT-Bench by default; evaluation only). Every
setting and plain decoding run on each prompt before the next prompt. Per setting: decode tokens/s
(summed tokens over summed time), speedup over plain in the same run, mean tokens per full-model
step, and whether every output equals plain greedy's. Writes --out (a Markdown file).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import m2r2_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core on Linux)
from m2r2_mlx.atomic import atomic_write_text
from m2r2_mlx.decoding.config import DecodeConfig, GenerationConfig
from m2r2_mlx.decoding.methods import make_decoder
from m2r2_mlx.errors import run_cli
from m2r2_mlx.models.blas import blas_info
from m2r2_mlx.models.registry import load_model

from tqdm.auto import tqdm

from m2r2_bench.methods import run_turns
from m2r2_bench.questions import SPECBENCH, select_questions


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.spec_sweep", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--adapters", default=None)
    ap.add_argument("--gates", default="6,12")
    ap.add_argument("--drafts", default="2,4")
    ap.add_argument("--thresholds", default="0")
    ap.add_argument("--draft-vocabs", default="0", help="0 = the full LM head")
    ap.add_argument("--questions", type=Path, default=SPECBENCH, help="Spec-Bench question.jsonl")
    ap.add_argument("--categories", default="mt_bench", help="Spec-Bench categories, 'mt_bench' or 'all'")
    ap.add_argument("--limit", type=int, default=1, help="questions per category")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=Path("build/speculative_sweep.md"))
    return ap


def _main() -> int:
    args = build_parser().parse_args()

    lm = load_model(args.model)
    qs = select_questions(args.questions, args.categories, args.limit)
    grid = list(
        itertools.product(
            _ints(args.gates),
            _ints(args.drafts),
            [float(t) for t in args.thresholds.split(",")],
            _ints(args.draft_vocabs),
        )
    )
    decoders = {"plain": make_decoder(lm, "plain")}
    for g, d, t, v in grid:
        config = DecodeConfig("fast", g, max_draft=d, threshold=t, draft_vocab=v)
        decoders[g, d, t, v] = make_decoder(lm, config, args.adapters)
    run_turns(lm, decoders["plain"], ["Say hello."], GenerationConfig(8))  # warm-up
    results = {k: {"tokens": 0, "secs": 0.0, "acc": [], "same": 0} for k in decoders}
    with tqdm(total=len(qs) * len(decoders), desc="speculative sweep", unit="answer") as bar:
        for q in qs:
            ref = None
            for key, decode in decoders.items():
                (turn,) = run_turns(lm, decode, q["turns"][:1], GenerationConfig(args.max_tokens))
                ref = turn["tokens"] if key == "plain" else ref
                r = results[key]
                r["tokens"] += turn["new_tokens"] - 1
                r["secs"] += turn["decode_time"]
                r["acc"] += turn["accept_lengths"]
                r["same"] += turn["tokens"] == ref
                bar.update()
    rate = {k: r["tokens"] / r["secs"] for k, r in results.items()}
    rows = sorted(grid, key=lambda k: -rate[k])
    lines = [
        "# Self-speculative sweep\n",
        f"`python -m experiments.spec_sweep {' '.join(sys.argv[1:])}`; {len(qs)} Spec-Bench first turns "
        f"({args.categories}), greedy, float32, "
        f"{blas_info().name} BLAS. Decode tokens/s over all prompts; speedup over plain decoding in the same run; "
        "fastest first.\n",
        "| draft gate | max draft | threshold | draft vocab | tokens/s | speedup | tokens/step | identical to plain |",
        "|---|---|---|---|---|---|---|---|",
        f"| plain | - | - | - | {rate['plain']:.1f} | 1.00x | 1.00 | - |",
    ]
    for key in rows:
        g, d, t, v = key
        r = results[key]
        acc = sum(r["acc"]) / max(len(r["acc"]), 1)
        lines.append(
            f"| L{g} | {d} | {t:g} | {v or 'full'} | {rate[key]:.1f} | "
            f"{rate[key] / rate['plain']:.2f}x | {acc:.2f} | {r['same']}/{len(qs)} |"
        )
    text = "\n".join(lines) + "\n"
    atomic_write_text(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("experiments.spec_sweep", _main))
