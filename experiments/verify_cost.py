"""What a verification costs against a plain step, by width and context length, and how much of it is exp.

    python -m experiments.verify_cost --out build/verify_cost.md

For each context length: the plain one-token step; a verification of 4, 8 and 16 positions (the forward over the
draft, its positions then trimmed); and one layer's attention softmax at that width, timed against numpy's exp
over as many elements. Medians of --rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import m2r2_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core on Linux)
from m2r2_mlx.atomic import atomic_write_text
from m2r2_mlx.decoding.prompt_cache import PromptCache, prefill
from m2r2_mlx.errors import run_cli
from m2r2_mlx.models.registry import load_model

import mlx.core as mx
import numpy as np

TEXT = Path("/usr/share/common-licenses/GPL-3")  # any long English text: the tokens only fill the cache
WIDTHS = (4, 8, 16)


def median_seconds(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds + 1):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times[1:])  # the first round warms the shapes


def verify(cache: PromptCache, tokens: list[int]) -> None:
    mx.eval(cache.forward(tokens))
    cache.trim(len(tokens))


def softmax_share(lm, context: int, n: int, rounds: int) -> tuple[float, float]:
    """(seconds of one layer's attention softmax over n queries, seconds of numpy's exp over as many elements)."""
    args = lm.model.args
    scores = mx.random.normal((1, args.num_attention_heads, n, context + n))
    mx.eval(scores)
    mlx_s = median_seconds(lambda: mx.eval(mx.softmax(scores, axis=-1, precise=True)), rounds)
    flat = np.random.default_rng(0).standard_normal(scores.size).astype(np.float32)
    return mlx_s, median_seconds(lambda: np.exp(flat), rounds)


def measure(contexts: list[int], rounds: int) -> str:
    lm = load_model("smollm2")
    ids = lm.tokenizer.encode(TEXT.read_text())
    layers = lm.model.args.num_hidden_layers
    lines = [
        "# Verification cost on this machine",
        "",
        "`python -m experiments.verify_cost`: SmolLM2-135M float32, medians; a verification's cost in plain steps",
        "(the plain one-token step at the same context = 1). The softmax columns: one attention layer's softmax at",
        f"that width, times {layers} layers, in plain steps; numpy's exp over as many elements beside it.",
        "",
        "| context | plain step | positions | verification | softmax, all layers | numpy exp |",
        "|---|---|---|---|---|---|",
    ]
    for context in contexts:
        cache = PromptCache(lm.model)
        mx.eval(prefill(cache, ids[:context]))

        def plain():
            mx.eval(cache.forward([ids[context]]))
            cache.trim(1)

        draft = ids[context : context + 64]
        plain_s = median_seconds(plain, rounds)
        for n in WIDTHS:
            cost = median_seconds(lambda: verify(cache, draft[:n]), rounds) / plain_s
            sm, npx = softmax_share(lm, context, n, rounds)
            lines.append(
                f"| {context} | {plain_s * 1e3:.1f} ms | {n} | {cost:.2f} | "
                f"{sm * layers / plain_s:.2f} | {npx * layers / plain_s:.2f} |"
            )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.verify_cost", description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="100,800,1600", help="comma-separated context lengths")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, help="write the table here (markdown)")
    return p


def main() -> None:
    args = build_parser().parse_args()
    table = measure([int(c) for c in args.contexts.split(",")], args.rounds)
    print(table)
    if args.out:
        atomic_write_text(args.out, table)


if __name__ == "__main__":
    raise SystemExit(run_cli("experiments.verify_cost", main))
