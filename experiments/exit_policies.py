"""Early-exit thresholds compared teacher-forced: one flat tau over a set of gates, or tau scaled per gate.

    python -m experiments.exit_policies --per-category 3

On the base model's own greedy answers to Spec-Bench questions (never trained on), the exit
scores (ARLA, max-softmax confidence) and labels (is the exit the full model's token?) of every
answer token at every gate are computed once, as the trainer's ARLA stage computes them; each
policy is then replayed on them: a token leaves at the first checked gate whose score reaches
that gate's threshold (with "patience", PABEE's rule, only where the gate's exit token is also the
previous gate's). For each agreement level, the table gives the most exit-depth a policy
saves while keeping at least that token agreement (best tau on a grid), beside the perfect exit
rule, the bound on any rule. Teacher-forced: every token sees the full model's prefix, so this
isolates the rule from the drift a lossy decode adds (the decode itself: experiments.early_exit_sweep).
Writes exit_policies.md into --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import m2r2_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core on Linux)
from m2r2_mlx.atomic import atomic_write_text
from m2r2_mlx.decoding.early_exit import gate_thresholds
from m2r2_mlx.decoding.methods import load_m2r2
from m2r2_mlx.errors import run_cli
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.training.data import self_distill
from m2r2_mlx.training.evaluate import perfect_rule_saving
from m2r2_mlx.training.exit_decisions import arla_logits, collect_features, predict

import numpy as np

from m2r2_bench.questions import SPECBENCH, select_questions

TARGETS = (0.99, 0.97, 0.95, 0.92, 0.90, 0.85)
TAUS = np.round(np.arange(0.05, 1.0, 0.01), 2)


def replay(scores: np.ndarray, labels: np.ndarray, thresholds, saved_at: np.ndarray) -> tuple[float, float]:
    """(exit-depth saved, token agreement) of exiting at the first gate whose score reaches its threshold."""
    leaves = scores >= np.asarray(thresholds)[None]
    exits = leaves.any(1)
    first = leaves.argmax(1)
    rows = np.arange(len(scores))
    saved = np.where(exits, saved_at[first], 0.0).mean()
    agree = np.where(exits, labels[rows, first], True).mean()
    return float(saved), float(agree)


def frontier(scores, labels, saved_at, policy) -> list[float]:
    """Per target agreement, the most saved by ``policy(tau)`` (thresholds per gate) over the tau grid."""
    points = [replay(scores, labels, policy(t), saved_at) for t in TAUS]
    return [max([s for s, a in points if a >= target], default=0.0) for target in TARGETS]


def features(m2r2, lm, questions: list[dict], answer_tokens: int):
    ids = None if m2r2.exit_head is None else np.array(m2r2.exit_head.ids).tolist()
    scores, labels, tokens = {"ARLA": [], "confidence": []}, [], []
    for t in self_distill(lm, [[q["turns"][0]] for q in questions], answer_tokens):
        f = collect_features(m2r2, np.array(t.tokens)[None], batch_size=1, exit_ids=ids)
        answer = slice(t.prompt_len - 1, len(t.tokens) - 1)  # the positions that predict answer tokens
        if getattr(m2r2, "arla", None) is not None:
            scores["ARLA"].append(predict(arla_logits, m2r2.arla, [f["h"], f["stats"]])[answer])
        scores["confidence"].append(f["confidence"][answer])
        labels.append(f["label"][answer])
        tokens.append(f["token"][answer])
    return (
        {k: np.concatenate(v) for k, v in scores.items() if v},
        np.concatenate(labels).astype(bool),
        np.concatenate(tokens),
    )


def with_patience(scores: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """PABEE-style patience: past the first gate, a token may leave only where its exit token is the previous
    gate's too (the score of any other exit drops below every threshold)."""
    agree = np.ones_like(scores, dtype=bool)
    agree[:, 1:] = tokens[:, 1:] == tokens[:, :-1]
    return np.where(agree, scores, -np.inf)


def patience_odds(labels: np.ndarray, tokens: np.ndarray) -> list[tuple[float, float]]:
    """Per gate past the first: how often its exit is right where it agrees with the previous gate's, and where not."""
    agree = tokens[:, 1:] == tokens[:, :-1]
    right = labels[:, 1:]
    return [(float(right[agree[:, j], j].mean()), float(right[~agree[:, j], j].mean())) for j in range(agree.shape[1])]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.exit_policies", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--adapters", default=None)
    ap.add_argument("--questions", type=Path, default=SPECBENCH, help="Spec-Bench question.jsonl")
    ap.add_argument("--categories", default="all")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--answer-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=Path("build/exit_policies"))
    return ap


def _main() -> int:
    args = build_parser().parse_args()

    lm = load_model(args.model)
    m2r2 = load_m2r2(lm, args.adapters, "the exit-policy benchmark")
    gates, L = list(m2r2.config.gates), lm.num_layers
    saved_at = 1 - np.array(gates) / L
    qs = select_questions(args.questions, args.categories, args.per_category)
    scores, labels, tokens = features(m2r2, lm, qs, args.answer_tokens)
    off = np.inf  # a gate that is not checked
    policies = {
        f"flat tau, gates {'/'.join(map(str, gates[:n]))}": (lambda t, n=n: [t] * n + [off] * (len(gates) - n))
        for n in range(1, len(gates) + 1)
    }
    policies["scaled tau, all gates"] = lambda t: gate_thresholds(t, gates, gates[0], L)
    head = "| rule | thresholds | " + " | ".join(f"≥ {100 * t:.0f}%" for t in TARGETS) + " |"
    lines = [
        "# Early-exit thresholds: flat or scaled per gate (teacher-forced)\n",
        f"`python -m experiments.exit_policies {' '.join(sys.argv[1:])}`; {len(qs)} Spec-Bench first turns, "
        f"{len(labels)} answer tokens, exits over {'all' if m2r2.exit_head is None else len(m2r2.exit_head)} "
        f"tokens of the vocabulary. Exit-depth saved (share of the {L} layers) at the best tau that keeps at "
        "least the column's token agreement.\n",
        head,
        "|---" * (len(TARGETS) + 2) + "|",
    ]
    scaled = policies["scaled tau, all gates"]
    for rule, s in scores.items():
        rows = [(name, frontier(s, labels, saved_at, policy)) for name, policy in policies.items()]
        rows.append(("scaled tau, patience", frontier(with_patience(s, tokens), labels, saved_at, scaled)))
        lines += [f"| {rule} | {name} | " + " | ".join(f"{100 * v:.1f}%" for v in row) + " |" for name, row in rows]
    bound = [perfect_rule_saving(labels, saved_at, 1 - t) for t in TARGETS]
    lines.append("| perfect rule (bound) | - | " + " | ".join(f"{100 * v:.1f}%" for v in bound) + " |")
    lines += [
        "",
        "Gate agreement on these tokens (exit = full model's token): "
        + ", ".join(f"L{g} {100 * r:.1f}%" for g, r in zip(gates, labels.mean(0)))
        + ".",
        "",
        "Where a gate's exit token is also the previous gate's, it is the full model's token (else): "
        + ", ".join(
            f"L{g} {100 * r:.1f}% ({100 * w:.1f}%)" for g, (r, w) in zip(gates[1:], patience_odds(labels, tokens))
        )
        + ".",
    ]
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "exit_policies.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("experiments.exit_policies", _main))
