"""Dynamic early exit: quality against compute and speed, over a sweep of tau, beside the baselines.

    python -m experiments.early_exit_sweep --taus 0.5,0.8,0.9,0.95 --limit 2 --max-tokens 96

Methods (all with deferred KV fill): M2R2 fast-stream exits decided by ARLA (when the adapters have it) or by
max-softmax confidence, with one flat tau over the first 1, 2 or all gates, or over all gates with tau scaled per
gate (the decoders' default); naive early exit (the slow state's own exit) with a confidence threshold;
SkipDecode-style fixed schedules (the exit gate falls with the position in the answer). Threshold checks score the
exit over the adapters' exit vocabulary (config ``exit_vocab``, as ARLA was trained) when they have one. Per
setting, on Spec-Bench first turns (greedy):
- layer passes saved: 1 - layer passes / (decoded tokens x layers), fast-stream checks and
  deferred fills counted (a fused fast-stream check shares the slow stream's pass). A pass reads a layer's
  weights once whatever its chunk size, the cost of a memory-bound decoder; the arithmetic (token-layers) is
  never below plain decoding's, since the deferred fill computes every skipped layer exactly. Beside it the
  exit-depth view (1 - mean exit layer / layers);
- token agreement: share of decoded tokens equal to the full model's prediction on the same
  prefix (one teacher-forced pass over each answer);
- ROUGE-L F1 of the whole answer against the full model's greedy answer;
- decode tokens/s relative to plain decoding, measured in the same run.
Beside them, the bound on any exit rule: a perfect rule on the plain answers (evaluate.oracle_exit_saving).
Writes early_exit.md and early_exit.png into --out (docs/early_exit.md cites the table).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import m2r2_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core on Linux)
from m2r2_mlx.atomic import atomic_save_figure, atomic_write_text
from m2r2_mlx.core.arla import ARLARule
from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.decoding.early_exit import EarlyExitDecoder, ExitPolicy, confidence
from m2r2_mlx.decoding.generate import PlainDecoder
from m2r2_mlx.decoding.methods import load_m2r2
from m2r2_mlx.errors import run_cli
from m2r2_mlx.models.blas import blas_info
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.training.evaluate import oracle_exit_saving

import mlx.core as mx
import numpy as np
from tqdm.auto import tqdm

from experiments.exit_variants import exit_walker
from m2r2_bench.methods import run_turns
from m2r2_bench.questions import SPECBENCH, select_questions


def methods(m2r2, taus: list[float], L: int, max_tokens: int) -> dict:
    out = {}
    g = m2r2.config.gates
    rules = [("M2R2 + ARLA", "fast", ARLARule(m2r2.arla))] if getattr(m2r2, "arla", None) is not None else []
    rules += [("M2R2 + confidence", "fast", confidence)]
    # fused checks ride along the slow stream: any set of gates costs no extra pass. One tau at every
    # gate ("flat"), and at every gate tau scaled by what exiting there saves (the decoders' default)
    variants = [(g[:1], False), (g[:2], False), (g, False), (g, True)]
    for name, source, rule in rules:
        for checked, scaled in variants:
            for tau in taus:
                label = f"{name}, gates {'/'.join(map(str, checked))}" + (", scaled tau" if scaled else "")
                out[label, f"tau {tau:g}"] = (
                    ExitPolicy(tau, scaled, rule, exit_head=m2r2.exit_head),
                    exit_walker(source=source, gates=checked),
                )
    for tau in taus:
        out["naive + confidence", f"tau {tau:g}"] = (
            ExitPolicy(tau, False, confidence, exit_head=m2r2.exit_head),
            exit_walker(source="layerskip"),
        )
    for floor in m2r2.config.gates[::-1]:
        gates = [g for g in m2r2.config.gates if g >= floor]

        def schedule(i, gates=gates):  # falls linearly from the full model to ``floor`` over the answer
            want = L - (L - gates[0]) * i / max_tokens
            fit = [g for g in gates if g >= want]
            return fit[0] if fit else None

        out["SkipDecode schedule", f"floor L{floor}"] = (
            ExitPolicy(0.9),
            exit_walker(source="layerskip", schedule=schedule),
        )
    return out


def agreement(model, prompt: list[int], answer: list[int]) -> float:
    """Share of answer tokens (after the first) equal to the full model's argmax on the same prefix."""
    if len(answer) < 2:
        return 1.0
    logits = model(mx.array(prompt + answer[:-1])[None])[0, len(prompt) :]
    return float((np.array(logits.argmax(-1)) == np.array(answer[1:])).mean())


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["saved"], r["agreement"], r["speedup"]) for r in rows if r["method"] == name)
        x = [100 * p[0] for p in pts]
        bound = np.isnan(pts[0][2])  # the perfect rule: no decode, so no speed
        axes[0].plot(x, [100 * p[1] for p in pts], marker="*" if bound else "o", ls=":" if bound else "-", label=name)
        if not bound:
            axes[1].plot(x, [p[2] for p in pts], marker="o", label=name)
    axes[0].axhline(95, color="grey", ls="--", lw=0.8)
    axes[0].axvline(35, color="grey", ls="--", lw=0.8)
    axes[0].set_ylabel("token agreement with the full model (%)")
    axes[1].axhline(1.0, color="black", lw=0.8)
    axes[1].set_ylabel("decode speedup over plain (same run)")
    for ax in axes:
        ax.set_xlabel("layer passes saved (%), fast-stream checks and fills counted")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_save_figure(fig, out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.early_exit_sweep", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--adapters", default=None)
    ap.add_argument("--taus", default="0.5,0.7,0.8,0.9,0.95")
    ap.add_argument("--questions", type=Path, default=SPECBENCH, help="Spec-Bench question.jsonl")
    ap.add_argument("--categories", default="mt_bench")
    ap.add_argument("--limit", type=int, default=1, help="questions per category")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=Path("build/early_exit_sweep"))
    return ap


def _main() -> int:
    from rouge_score import rouge_scorer

    args = build_parser().parse_args()

    lm = load_model(args.model)
    m2r2 = load_m2r2(lm, args.adapters, "the early-exit sweep")
    L = lm.num_layers
    qs = select_questions(args.questions, args.categories, args.limit)
    settings = methods(m2r2, [float(t) for t in args.taus.split(",")], L, args.max_tokens)
    rouge = rouge_scorer.RougeScorer(["rougeL"])
    plain_decode = PlainDecoder(lm)
    run_turns(lm, plain_decode, ["Say hello."], GenerationConfig(8))  # warm-up
    acc = {
        k: {"passes": 0, "steps": 0, "exits": [], "agree": [], "rouge": [], "tokens": 0, "secs": 0.0} for k in settings
    }
    plain_tokens = plain_secs = 0
    references = []  # (prompt + the full model's answer, first position an exit decides)
    with tqdm(total=len(qs) * (len(settings) + 1), desc="early-exit sweep", unit="answer") as bar:
        for q in qs:
            prompt = lm.tokenizer.apply_chat_template(
                [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True
            )
            (ref,) = run_turns(lm, plain_decode, q["turns"][:1], GenerationConfig(args.max_tokens))
            plain_tokens += ref["new_tokens"] - 1
            references.append((list(prompt) + ref["tokens"], len(prompt) + 1))  # the first token is the prefill's
            plain_secs += ref["decode_time"]
            bar.update()
            for key, (policy, walker) in settings.items():
                decode = EarlyExitDecoder(m2r2, lm.tokenizer, policy, lm.context_length, walker=walker)
                (turn,) = run_turns(lm, decode, q["turns"][:1], GenerationConfig(args.max_tokens))
                a = acc[key]
                a["passes"] += turn["layer_passes"]
                a["steps"] += turn["new_tokens"] - 1
                a["exits"] += turn["exit_layers"][1:]
                a["agree"].append(agreement(lm.model, list(prompt), turn["tokens"]))
                a["rouge"].append(rouge.score(ref["text"], turn["text"])["rougeL"].fmeasure)
                a["tokens"] += turn["new_tokens"] - 1
                a["secs"] += turn["decode_time"]
                bar.update()
    plain_rate = plain_tokens / plain_secs
    rows = []
    for (method, setting), a in acc.items():
        rows.append(
            {
                "method": method,
                "setting": setting,
                "saved": 1 - a["passes"] / max(a["steps"] * L, 1),
                "depth_saved": 1 - float(np.mean(a["exits"])) / L if a["exits"] else 0.0,
                "agreement": float(np.mean(a["agree"])),
                "rouge": float(np.mean(a["rouge"])),
                "speedup": (a["tokens"] / a["secs"]) / plain_rate,
            }
        )
    for slack in (0.0, 0.05):  # the bound on any exit rule, from the full model's own answers
        bound = oracle_exit_saving(m2r2, references, slack, head=m2r2.exit_head)
        rows.append(
            {
                "method": "perfect exit rule (bound)",
                "setting": f"{100 * (1 - slack):.0f}% agreement",
                "saved": bound,
                "depth_saved": bound,
                "agreement": 1 - slack,
                "rouge": np.nan,
                "speedup": np.nan,
            }
        )
    lines = [
        "# Dynamic early exit: quality vs compute\n",
        f"`python -m experiments.early_exit_sweep {' '.join(sys.argv[1:])}`; {len(qs)} Spec-Bench first turns, greedy, "
        f"float32, {blas_info().name} BLAS; plain decoding {plain_rate:.1f} tokens/s in the same run; threshold "
        f"checks score exits over {'all' if m2r2.exit_head is None else len(m2r2.exit_head)} tokens of the "
        "vocabulary.\n",
        "| method | setting | layer passes saved | exit-depth saved | token agreement | ROUGE-L vs full | speedup |",
        "|---|---|---|---|---|---|---|",
    ]

    def cell(value: float, spec: str) -> str:  # the bound's rows have no answer, so no ROUGE or speed
        return "-" if np.isnan(value) else format(value, spec)

    lines += [
        f"| {r['method']} | {r['setting']} | {100 * r['saved']:.1f}% | {100 * r['depth_saved']:.1f}% | "
        f"{100 * r['agreement']:.1f}% | {cell(r['rouge'], '.3f')} | {cell(r['speedup'], '.2f')}"
        f"{'' if np.isnan(r['speedup']) else 'x'} |"
        for r in rows
    ]
    lines += [
        "",
        "The perfect exit rule sends each token of the full model's own answers out at the first gate whose "
        "fast-stream exit (over the same exit vocabulary) is the full model's token: no rule can save more at "
        "100% agreement; at 95%, the 5% of tokens that gain most also leave at the first gate, wrongly. It "
        "bounds what a better exit rule can add over the gates' accuracy (docs/training.md).",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    plot(rows, args.out / "early_exit.png")
    text = "\n".join(lines) + "\n\n![quality vs compute](early_exit.png)\n"
    atomic_write_text(args.out / "early_exit.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("experiments.early_exit_sweep", _main))
