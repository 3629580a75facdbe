"""Top-1 agreement of each gate's exit with the full model: naive early exit vs the M2R2 fast stream.

    python -m bench.gate_agreement --adapters m2r2_mlx/trained/smollm2 --per-category 3

Two evaluation sets, neither trained on:
- held-out text: the rows the trainer held out (figures stored in m2r2_config.json);
- Spec-Bench answers: the base model's own greedy answers to Spec-Bench questions
  (--per-category from each of the 13 categories), scored at the answer positions.
Writes docs/gate_agreement.md and docs/gate_agreement.png.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import m2r2_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core on Linux)

import numpy as np

from m2r2_mlx.atomic import atomic_save_figure
from m2r2_mlx.decoders import load_m2r2, packaged_adapters
from m2r2_mlx.errors import run_cli
from m2r2_mlx.evaluate import answer_agreement
from m2r2_mlx.registry import load_model

from .specbench import SPECBENCH, select_questions

def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, (name, r) in zip(axes, results.items()):
        x = np.arange(len(r["gates"]))
        ax.bar(x - 0.2, np.array(r["naive"]) * 100, 0.4, label="naive early exit")
        ax.bar(x + 0.2, np.array(r["m2r2"]) * 100, 0.4, label="M2R2 fast stream")
        ax.set_xticks(x, [f"L{g}" for g in r["gates"]])
        ax.set_title(f"{name}\n{r['tokens']} tokens", fontsize=10)
        ax.set_xlabel("exit gate")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("top-1 agreement with full model (%)")
    axes[0].legend()
    fig.tight_layout()
    atomic_save_figure(fig, out)


def table(results: dict) -> str:
    lines = []
    for name, r in results.items():
        lines += [f"### {name} ({r['tokens']} tokens)", "", "| gate | naive early exit | M2R2 fast stream |", "|---|---|---|"]
        lines += [f"| L{g} | {100 * a:.1f}% | {100 * b:.1f}% |" for g, a, b in zip(r["gates"], r["naive"], r["m2r2"])]
        lines.append("")
    return "\n".join(lines)


def _main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gate_agreement", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--adapters", default=None, help="adapters folder (default: the packaged ones for the model)")
    ap.add_argument("--questions", type=Path, default=SPECBENCH)
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--answer-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=Path("docs"))
    args = ap.parse_args()

    from m2r2_mlx.data import self_distill

    lm = load_model(args.model)
    m2r2 = load_m2r2(lm, args.adapters, "the gate agreement benchmark")
    folder = args.adapters or packaged_adapters(lm.name)
    qs = select_questions(args.questions, "all", args.per_category)
    prompts = [q["turns"][0] for q in qs]
    transcripts = self_distill(lm, [[p] for p in prompts], args.answer_tokens)
    results = {}
    held = m2r2.config.extra.get("heldout_agreement")
    if held:
        results["held-out text and chat (training split)"] = held
    results[f"Spec-Bench answers ({len(qs)} questions, 13 categories)"] = answer_agreement(m2r2, [(t.tokens, t.prompt_len) for t in transcripts])
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, args.out / "gate_agreement.png")
    md = table(results)
    (args.out / "gate_agreement.md").write_text(
        "# Gate exits vs the full model\n\nTop-1 agreement of the exit token with the full model's token "
        f"(`python -m bench.gate_agreement --adapters {os.path.relpath(folder)} --per-category {args.per_category}`).\n\n"
        + md + "\n![agreement per gate](gate_agreement.png)\n"
    )
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("bench.gate_agreement", _main))
