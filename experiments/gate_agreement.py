"""Top-1 agreement of each gate's exit with the full model: naive early exit vs the M2R2 fast stream.

    python -m experiments.gate_agreement --adapters m2r2_mlx/trained/smollm2 --per-category 3

Two evaluation sets, neither trained on:
- held-out text: the rows the trainer held out (figures stored in m2r2_config.json);
- Spec-Bench answers: the base model's own greedy answers to Spec-Bench questions
  (--per-category from each of the 13 categories), scored at the answer positions.
Writes gate_agreement.md and gate_agreement.png into --out (default m2r2-bench-results/gate_agreement).

Comparing two versions of the adapters on the same tokens: ``--baseline DIR`` adds that
folder's fast stream as another column, and ``--rows build/smollm2/data.npy --eval-rows 24``
scores the held-out rows of a training run (the first rows of its data.npy) with both,
instead of quoting the figures stored in m2r2_config.json; where the rows' loss mask
(data.mask.npy) is beside them, the answer and text positions alone are scored too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import m2r2_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core on Linux)
from m2r2_mlx.atomic import atomic_save_figure, atomic_write_text
from m2r2_mlx.core.adapters import load_adapters
from m2r2_mlx.decoding.methods import load_m2r2
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.training.data import mask_path, self_distill
from m2r2_mlx.training.evaluate import (
    answer_agreement,
    answer_batches,
    context_feature_ablation,
    gate_agreement,
    naive_agreement_by_layer,
    row_batches,
)

import numpy as np

from m2r2_bench.questions import SPECBENCH, select_questions


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, (name, r) in zip(axes, results.items()):
        x = np.arange(len(r["gates"]))
        bars = [
            ("layerskip", "layerskip (the slow state's own exit)"),
            ("baseline", "M2R2, baseline adapters"),
            ("fast", "M2R2 fast stream"),
        ]
        bars = [(k, label) for k, label in bars if k in r]
        width = 0.8 / len(bars)
        for i, (k, label) in enumerate(bars):
            ax.bar(x + (i - (len(bars) - 1) / 2) * width, np.array(r[k]) * 100, width, label=label)
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
        cols = [("layerskip", "layerskip (the slow state's own exit)")] + [("baseline", "M2R2, baseline adapters")] * (
            "baseline" in r
        )
        cols.append(("fast", "M2R2 fast stream"))
        lines += [
            f"### {name} ({r['tokens']} tokens)",
            "",
            "| gate | " + " | ".join(c for _, c in cols) + " |",
            "|---" * (len(cols) + 1) + "|",
        ]
        for j, g in enumerate(r["gates"]):
            lines.append(f"| L{g} | " + " | ".join(f"{100 * r[k][j]:.1f}%" for k, _ in cols) + " |")
        lines.append("")
    return "\n".join(lines)


def side_by_side(evaluate, m2r2, baseline=None) -> dict:
    """``evaluate(adapters)`` for the adapters, with the baseline adapters' M2R2 figures beside them."""
    r = evaluate(m2r2)
    if baseline is not None:
        b = evaluate(baseline)
        r["baseline"] = b["fast"]
        if "scored" in b:
            r["scored"]["baseline"] = b["scored"]["fast"]
    return r


def held_out_results(m2r2, baseline, paths: list[Path], eval_rows: int) -> dict:
    """The first ``eval_rows`` of each rows file, every position; where the rows' loss mask is beside them,
    the positions predicting answers and text (not prompts and template) as a table of their own."""
    results = {}
    for path in paths:
        rows = np.load(path)[:eval_rows]
        mask = np.load(mask_path(path))[:eval_rows] if mask_path(path).is_file() else None
        r = side_by_side(lambda m: gate_agreement(m, rows, mask=mask), m2r2, baseline)
        answers = r.pop("scored", None)
        results[f"held-out rows of {path} ({len(rows)} rows)"] = r
        if answers:
            results[f"held-out rows of {path}, answer and text positions only"] = {"gates": r["gates"], **answers}
    return results


def context_table(m2r2, sets: dict) -> str:
    """With a context feature: the first gate's agreement by what the feature reads
    (evaluate.context_feature_ablation)."""
    if not m2r2.config.context_feature:
        return ""
    g = m2r2.config.gates[0]
    lines = [
        "",
        f"### L{g}: what the context feature reads",
        "",
        "At decode time the first draft after a verification reads the previous position's final state, as "
        f"training does; a second or third draft reads the draft before's L{g} exit state instead (a stand-in: "
        "no final state exists there yet), as does a token after an early exit at that gate. "
        f'"After a right exit": only positions whose previous L{g} exit was right, as before a second draft. '
        "The position before keeps the slow stream's keys and values (a second draft also attends to the first "
        "draft's provisional ones), to isolate what the feature reads. Every position of the held-out rows but "
        "each row's first (which has no previous one), answer positions of Spec-Bench.",
        "",
        "| tokens | final state | stand-in | nothing | after a right exit: final state | stand-in | nothing |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, batches in sets.items():
        r = context_feature_ablation(m2r2, batches)
        cells = [f"{100 * r[k][i]:.1f}%" for i in (0, 1) for k in ("final", "stand-in", "none")]
        lines.append(f"| {name} ({r['tokens']}; {r['after a right exit']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def every_layer(m2r2, sets: dict, results: dict, out: Path) -> str:
    """The naive exit after every layer of the base beside the fast stream at the gates: a table and a plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {name: naive_agreement_by_layer(m2r2.parts, batches) for name, batches in sets.items()}
    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, curve), color in zip(curves.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        ax.plot(range(1, len(curve) + 1), np.array(curve) * 100, color=color, label=f"naive exit, {name}")
        r = results.get(name)
        if r:
            ax.plot(r["gates"], np.array(r["fast"]) * 100, "o", color=color, label=f"M2R2 fast stream, {name}")
    ax.set(xlabel="layer", ylabel="top-1 agreement with the full model (%)", ylim=(0, 100))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_save_figure(fig, out)
    plt.close(fig)
    names = list(curves)
    lines = [
        "",
        "### Naive exit after every layer",
        "",
        "How late the base settles on its token: the slow state after each layer through the final norm and LM head.",
        "",
        "| layer | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    lines += [
        f"| L{i + 1} | " + " | ".join(f"{100 * curves[n][i]:.1f}%" for n in names) + " |"
        for i in range(m2r2.parts.num_layers)
    ]
    return "\n".join(lines) + f"\n\n![naive exit after every layer]({out.name})\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.gate_agreement", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--adapters", default=None, help="adapters folder (default: the packaged ones for the model)")
    ap.add_argument("--questions", type=Path, default=SPECBENCH)
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--answer-tokens", type=int, default=96)
    ap.add_argument(
        "--baseline", metavar="ADAPTERS", help="another adapters folder for the same model, scored on the same tokens"
    )
    ap.add_argument(
        "--rows",
        type=Path,
        nargs="+",
        default=[],
        metavar="DATA.npy",
        help="training runs' token rows; the first --eval-rows of each are held out",
    )
    ap.add_argument(
        "--eval-rows", type=int, default=16, help="held-out rows at the start of --rows (the trainer's --eval-rows)"
    )
    ap.add_argument(
        "--every-layer", action="store_true", help="also the naive exit after every layer (a table and a plot)"
    )
    ap.add_argument("--out", type=Path, default=Path("m2r2-bench-results/gate_agreement"))
    return ap


def _main() -> int:
    args = build_parser().parse_args()

    for path in args.rows:
        if not path.is_file():
            raise M2R2Error(f"{path} not found; pass the data.npy a training run wrote into its output folder")
    lm = load_model(args.model)
    m2r2 = load_m2r2(lm, args.adapters, "the gate agreement benchmark")
    qs = select_questions(args.questions, "all", args.per_category)
    prompts = [q["turns"][0] for q in qs]
    baseline = load_adapters(lm, args.baseline) if args.baseline else None
    transcripts = self_distill(lm, [[p] for p in prompts], args.answer_tokens)
    sequences = [(t.tokens, t.prompt_len) for t in transcripts]

    results = held_out_results(m2r2, baseline, args.rows, args.eval_rows)
    if not args.rows and m2r2.config.extra.get("heldout_agreement") and baseline is None:
        results["held-out text and chat (training split)"] = m2r2.config.extra["heldout_agreement"]
    spec = f"Spec-Bench answers ({len(qs)} questions, 13 categories)"
    results[spec] = side_by_side(lambda m: answer_agreement(m, sequences), m2r2, baseline)
    held = {path: np.load(path)[: args.eval_rows] for path in args.rows}
    # the token sets again, named as in ``results`` (held_out_results' names), for the extra tables
    sets = lambda: {
        **{f"held-out rows of {p} ({len(r)} rows)": row_batches(r) for p, r in held.items()},
        spec: answer_batches(sequences),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, args.out / "gate_agreement.png")
    md = table(results) + context_table(m2r2, sets())
    if args.every_layer:
        md += every_layer(m2r2, sets(), results, args.out / "naive_by_layer.png")
    atomic_write_text(
        args.out / "gate_agreement.md",
        "# Gate exits vs the full model\n\nTop-1 agreement of the exit token with the full model's token "
        f"(`python -m experiments.gate_agreement {' '.join(sys.argv[1:])}`).\n\n"
        + md
        + "\n![agreement per gate](gate_agreement.png)\n",
    )
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("experiments.gate_agreement", _main))
