"""Plain decoding vs mlx-lm's stream_generate, side by side in one process.

    python -m m2r2_bench.plain_decode                 # ours vs mlx-lm, greedy, same prompts
    python -m m2r2_bench.plain_decode --blas-compare  # also: OpenBLAS vs the wheel's reference BLAS

Both decoders run on the same model and prompts, interleaved (ours, mlx-lm, ours,
...) after a warm-up, and each run's decode rate is measured the same way: tokens
after the first, over the wall time from the first token to the last. We report
medians and the ratio; absolute numbers on a shared machine are noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import m2r2_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)
from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.decoding.generate import generate
from m2r2_mlx.errors import run_cli
from m2r2_mlx.models.blas import blas_info
from m2r2_mlx.models.registry import load_model

from mlx_lm import stream_generate

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten year old.",
    "List five tips for learning a new language, with one sentence each.",
    "Describe the water cycle in detail.",
]


def _decode_rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0


def run_ours(lm, prompt_ids, max_tokens) -> tuple[float, list[int]]:
    times, tokens = [], []
    for ev in generate(lm.model, lm.tokenizer, prompt_ids, GenerationConfig(max_tokens)):
        times.append(time.perf_counter())
        tokens.append(ev.token)
    return _decode_rate(times), tokens


def run_mlx_lm(lm, prompt_ids, max_tokens) -> tuple[float, list[int]]:
    times, tokens = [], []
    for r in stream_generate(lm.model, lm.tokenizer, prompt_ids, max_tokens=max_tokens):
        times.append(time.perf_counter())
        tokens.append(r.token)
    return _decode_rate(times), tokens


def measure(model: str | None, max_tokens: int, repeats: int) -> dict:
    lm = load_model(model)
    prompts = [
        lm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS
    ]
    run_ours(lm, prompts[0], 16)  # warm-up both paths
    run_mlx_lm(lm, prompts[0], 16)
    ours, theirs, same = [], [], 0
    for r in range(repeats):
        for p in prompts:
            # alternate who goes first so drift in machine load hits both equally
            order = [(run_ours, ours), (run_mlx_lm, theirs)][:: 1 if r % 2 == 0 else -1]
            outs = []
            for fn, acc in order:
                rate, toks = fn(lm, p, max_tokens)
                acc.append(rate)
                outs.append(toks)
            same += outs[0][: len(outs[1])] == outs[1][: len(outs[0])]
    return {
        "blas": blas_info().describe(),
        "ours_tps": statistics.median(ours),
        "mlx_lm_tps": statistics.median(theirs),
        "ratio": statistics.median(ours) / statistics.median(theirs),
        "runs": len(ours),
        "identical_outputs": f"{same}/{len(ours)}",
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m m2r2_bench.plain_decode", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="alias, repo id or folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--blas-compare", action="store_true", help="also decode with the reference BLAS (Linux)")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # child-process output
    return ap


def main() -> int:
    args = build_parser().parse_args()

    res = measure(args.model, args.max_tokens, args.repeats)
    if args.json:
        print(json.dumps(res))
        return 0
    print(res["blas"])
    print(f"| decoder | tokens/s (median of {res['runs']}) | ratio |")
    print("|---|---|---|")
    print(f"| m2r2 plain | {res['ours_tps']:.1f} | {res['ratio']:.3f} |")
    print(f"| mlx_lm.stream_generate | {res['mlx_lm_tps']:.1f} | 1.000 |")
    print(f"greedy outputs identical: {res['identical_outputs']}")
    if args.blas_compare and sys.platform.startswith("linux"):
        cmd = [
            sys.executable,
            "-m",
            "m2r2_bench.plain_decode",
            "--json",
            "--max-tokens",
            str(args.max_tokens),
            "--repeats",
            str(args.repeats),
        ]
        if args.model:
            cmd += ["--model", args.model]
        env = dict(os.environ, M2R2_BLAS="reference")
        ref = json.loads(
            subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        )
        print("\n| BLAS | m2r2 plain tokens/s | speedup |\n|---|---|---|")
        print(f"| reference (wheel) | {ref['ours_tps']:.1f} | 1.00x |")
        print(f"| {blas_info().name} | {res['ours_tps']:.1f} | {res['ours_tps'] / ref['ours_tps']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("m2r2_bench.plain_decode", main))
