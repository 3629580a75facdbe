"""Self-speculative decoding vs plain decoding, swept over draft gate and draft length, in one run.

    python -m bench.spec_sweep [--adapters DIR] [--gates 6,12] [--drafts 3,6] [--questions N]

Greedy, batch 1, after a warm-up; prompts are Spec-Bench MT-Bench first turns (evaluation only).
Per setting: median decode tokens/s, speedup over plain measured in the same run, mean accepted tokens
per verification step, and whether every output equals plain greedy's. Writes docs/speculative_sweep.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import m2r2_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core on Linux)

from m2r2_mlx.blas import blas_info
from m2r2_mlx.decoders import load_m2r2
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.generate import generate
from m2r2_mlx.registry import load_model
from m2r2_mlx.speculative import speculative_generate

from .gate_agreement import SPECBENCH, specbench_questions

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def timed(events) -> tuple[list[int], float]:
    times, toks = [], []
    for e in events:
        times.append(time.perf_counter())
        toks.append(e.token)
    return toks, (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0


def _main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spec_sweep", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--adapters", default=None)
    ap.add_argument("--gates", default="6,12")
    ap.add_argument("--drafts", default="3,6")
    ap.add_argument("--questions", type=int, default=1, help="MT-Bench questions per category")
    ap.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=Path("docs/speculative_sweep.md"))
    args = ap.parse_args()

    lm = load_model(args.model)
    m2r2 = load_m2r2(lm, args.adapters, "the speculative sweep")
    qs = [q for q in specbench_questions(SPECBENCH, args.questions) if q["category"] in MT_BENCH][: args.limit]
    prompts = [lm.tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True) for q in qs]
    settings = [(int(g), int(d)) for g in args.gates.split(",") for d in args.drafts.split(",")]
    for g, _ in settings:
        if g not in m2r2.config.gates:
            raise M2R2Error(f"gate {g} is not one of the adapters' gates {m2r2.config.gates}")

    list(generate(lm.model, lm.tokenizer, prompts[0], max_tokens=8))  # warm-up
    plain_rates, rows = [], {s: {"rates": [], "acc": [], "same": 0} for s in settings}
    for p in prompts:
        ref, rate = timed(generate(lm.model, lm.tokenizer, p, max_tokens=args.max_tokens))
        plain_rates.append(rate)
        for g, d in settings:
            st = {}
            toks, r = timed(speculative_generate(m2r2, lm.tokenizer, p, max_tokens=args.max_tokens,
                                                 gate_index=m2r2.config.gates.index(g), max_draft=d, stats=st))
            rows[(g, d)]["rates"].append(r)
            rows[(g, d)]["acc"] += st["accepted"]
            rows[(g, d)]["same"] += toks == ref
        print(f"question done ({len(plain_rates)}/{len(prompts)})", file=sys.stderr)
    plain = statistics.median(plain_rates)
    lines = ["# Self-speculative sweep\n", f"`python -m bench.spec_sweep --gates {args.gates} --drafts {args.drafts} "
             f"--questions {args.questions} --limit {args.limit} --max-tokens {args.max_tokens}`; {len(prompts)} MT-Bench first turns, greedy, "
             f"float32, {blas_info().name} BLAS. Medians over prompts; speedup against plain decoding in the same run.\n",
             "| method | draft gate | max draft | tokens/s | speedup | mean accepted tokens/step | identical to plain |",
             "|---|---|---|---|---|---|---|", f"| plain | - | - | {plain:.1f} | 1.00x | 1.00 | - |"]
    for (g, d), r in rows.items():
        med = statistics.median(r["rates"])
        lines.append(f"| M2R2 self-speculative | L{g} | {d} | {med:.1f} | {med / plain:.2f}x | "
                     f"{statistics.mean(r['acc']):.2f} | {r['same']}/{len(prompts)} |")
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("bench.spec_sweep", _main))
