"""The speculative engine's floor: what it costs where no draft pays, and what verification costs by context.

1. Greedy answers to Spec-Bench first turns, side by side (rounds alternate the order): plain decoding, and
   ``--mode speculative`` with drafting priced out (acceptance priors 0, held with certainty), in plain
   stretches (each step queued before the last token is read) and one synchronous step at a time. Every answer
   must equal plain's.
2. Forwards of 1, 2, 4 and 8 positions (a chain, and a width-2 tree) at several context lengths: why the cost
   model keeps times per context-length bucket.

    python -m experiments.speculative_floor --out docs/speculative_floor.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import m2r2_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx.core on Linux)
from m2r2_mlx.atomic import atomic_write_text
from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.decoding.decoders import make_decoder
from m2r2_mlx.decoding.prompt_cache import PromptCache, prefill
from m2r2_mlx.decoding.speculative import Speculator
from m2r2_mlx.decoding.tree import DraftTree
from m2r2_mlx.models.blas import blas_info
from m2r2_mlx.models.registry import load_model

import mlx.core as mx
from tqdm.auto import tqdm

from m2r2_bench.methods import run_turns
from m2r2_bench.questions import SPECBENCH, select_questions

CATEGORIES = "writing,coding,math,stem,qa,rag"


def priced_out(lm, stretches: bool) -> Speculator:
    engine = make_decoder(lm, "speculative")
    engine.plain_stretches = stretches
    engine.acceptance.priors = {"lookup": 0.0, "fast": 0.0}
    engine.acceptance.strength = 1e9  # certain: no draft is ever expected to pay
    return engine


def forward_costs(model, contexts: list[int], repeats: int = 7) -> dict[int, dict[str, float]]:
    """Median seconds of one forward per context length and shape, the cache left as it was."""
    out = {}
    for ctx in contexts:
        cache = PromptCache(model)
        mx.eval(prefill(cache, [100 + i % 1000 for i in range(ctx)]))
        row = {}
        for name, n in [("chain 1", 1), ("chain 2", 2), ("chain 4", 4), ("tree 4", 4), ("chain 8", 8), ("tree 8", 8)]:
            tree = DraftTree.root(5)
            if name.startswith("tree"):
                tree.add(0, 6, "x")
            tree.add_chain(0, list(range(7, 7 + n - len(tree))), "x")
            times = []
            for _ in range(repeats):
                tic = time.perf_counter()
                mx.eval(cache.forward_tree(tree))
                times.append(time.perf_counter() - tic)
                cache.trim(n)
            row[name] = statistics.median(times[2:])
        out[ctx] = row
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--categories", default=CATEGORIES)
    p.add_argument("--tokens", type=int, default=96, help="tokens per answer")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--contexts", default="64,512,1024,2048")
    p.add_argument("--out", type=Path, default=Path("docs/speculative_floor.md"))
    args = p.parse_args()

    lm = load_model()
    questions = select_questions(SPECBENCH, args.categories, 1)
    decoders = {
        "plain": make_decoder(lm, "plain"),
        "speculative, plain stretches": priced_out(lm, True),
        "speculative, synchronous steps": priced_out(lm, False),
    }
    for decode in decoders.values():  # warm-up, and the engines' one-time cost calibration
        run_turns(lm, decode, questions[0]["turns"][:1], GenerationConfig(8))
    ratios = {name: [] for name in decoders}
    for r in tqdm(range(args.rounds), desc="rounds"):
        for q in questions:
            rate, ref = {}, None
            for name, decode in list(decoders.items())[:: 1 if r % 2 == 0 else -1]:
                answer = run_turns(lm, decode, q["turns"][:1], GenerationConfig(args.tokens))[0]
                rate[name] = answer["new_tokens"] / answer["decode_time"]
                ref = answer["tokens"] if ref is None else ref
                if answer["tokens"] != ref:
                    print(f"{name}: q{q['question_id']}'s answer differs from plain's", file=sys.stderr)
                    return 1
            for name in decoders:
                ratios[name].append(rate[name] / rate["plain"])
    costs = forward_costs(lm.model, [int(c) for c in args.contexts.split(",")])
    shapes = list(next(iter(costs.values())))
    lines = [
        "# The speculative engine's floor, and verification cost by context length",
        "",
        f"`python -m experiments.speculative_floor --categories {args.categories} --tokens {args.tokens} "
        f"--rounds {args.rounds}`; {lm.name}, greedy, {len(questions)} Spec-Bench first turns x {args.rounds} "
        f"rounds; {blas_info().describe()}. Speculative decoding with drafting priced out (acceptance priors 0, "
        "held with certainty): what the engine costs where no draft pays. Every answer equals plain's.",
        "",
        "| decoder | speed vs plain, median | min | max |",
        "|---|---|---|---|",
        *(f"| {name} | {statistics.median(v):.3f}x | {min(v):.2f}x | {max(v):.2f}x |" for name, v in ratios.items()),
        "",
        "One forward over n new positions after a context of C positions, as a multiple of one position's (medians):",
        "",
        "| context | one position, ms | " + " | ".join(shapes[1:]) + " |",
        "|---|---|" + "---|" * (len(shapes) - 1),
        *(
            f"| {ctx} | {1e3 * row['chain 1']:.1f} | "
            + " | ".join(f"{row[s] / row['chain 1']:.2f}x" for s in shapes[1:])
            + " |"
            for ctx, row in costs.items()
        ),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    atomic_write_text(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
