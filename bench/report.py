"""m2r2-bench's results: per category (and MT-Bench's 8 together, and overall) and per answer, as tables, a PNG
and Spec-Bench's answer files."""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections import Counter
from pathlib import Path

from m2r2_mlx.atomic import atomic_save_figure, atomic_write_text

import numpy as np

from .methods import LABELS
from .questions import MT_BENCH


def groups(categories: list[str]) -> list[str]:
    """The table's rows: each category, then MT-Bench's 8 together (where the run has them and more), then all."""
    mt = [c for c in categories if c in MT_BENCH]
    return categories + (["mt_bench"] if mt and len(mt) < len(categories) else []) + ["overall"]


def in_group(group: str, category: str) -> bool:
    return group in ("overall", category) or (group == "mt_bench" and category in MT_BENCH)


def decode_tokens(turns: list[dict]) -> int:
    """Tokens decoded over ``turns``, each turn's first (prefill's) left out."""
    return sum(max(t["new_tokens"] - 1, 0) for t in turns)


def decode_rate(turns: list[dict]) -> float:
    """Decode tokens per second over ``turns`` (summed tokens over summed time)."""
    secs = sum(t["decode_time"] for t in turns)
    return decode_tokens(turns) / secs if secs else 0.0


def summarise(records: dict, methods: list[str], categories: list[str]) -> dict:
    """Per (category or group, method): decode tokens/s (summed tokens over summed time), speedup, acceptance,
    memory."""
    summary = {}
    for cat in groups(categories):
        for m in methods:
            answers = [r for r in records[m] if in_group(cat, r["category"])]
            turns = [t for r in answers for t in r["turns"]]
            if not turns:
                continue
            acc = [a for t in turns for a in t["accept_lengths"]]
            compared = [r["same_as_plain"] for r in answers if r["same_as_plain"] is not None]
            agreed = [t["agreement"] for t in turns if t.get("agreement")]
            n = len(answers)
            same = f"{sum(compared)}/{n}" if compared else "- (sampled)"
            if agreed:  # a lossy method: its tokens against the full model's on the same prefix
                same = f"{100 * sum(a for a, _ in agreed) / max(sum(b for _, b in agreed), 1):.1f}% agree"
            summary[cat, m] = {
                "tok_s": decode_rate(turns),
                "accepted": statistics.mean(acc) if acc else 1.0,
                "hist": Counter(acc),
                "peak_gb": max(t["peak_memory_gb"] for t in turns),
                "same": same,
                "skipped": sum(t.get("layers_skipped", 0.0) * t["new_tokens"] for t in turns)
                / max(sum(t["new_tokens"] for t in turns), 1),
                "tokens": decode_tokens(turns),
                "drafted_by": sum((Counter(t.get("drafted_by", {})) for t in turns), Counter()),
            }
        plain = summary.get((cat, "plain"), {}).get("tok_s", 0.0)
        for m in methods:
            if (cat, m) in summary:
                summary[cat, m]["speedup"] = summary[cat, m]["tok_s"] / plain if plain else 0.0
    return summary


def histogram_text(hist: Counter) -> str:
    total = sum(hist.values()) or 1
    return " ".join(f"{k}:{100 * v / total:.0f}%" for k, v in sorted(hist.items()))


def drafts_text(by: Counter) -> str:
    return ", ".join(f"{source} {n}" for source, n in by.most_common()) or "-"


def table(summary: dict, methods: list[str], categories: list[str]) -> str:
    lines = [
        "| category | method | tokens/s | speedup | tokens/step | acceptance lengths | drafts accepted "
        "| layers skipped | peak GB | same as plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cat in groups(categories):
        for m in methods:
            s = summary.get((cat, m))
            if s:
                lines.append(
                    f"| {cat} | {LABELS[m]} | {s['tok_s']:.1f} | {s['speedup']:.2f}x | {s['accepted']:.2f} | "
                    f"{histogram_text(s['hist'])} | {drafts_text(s['drafted_by'])} | {100 * s['skipped']:.1f}% | "
                    f"{s['peak_gb']:.2f} | {s['same']} |"
                )
    return "\n".join(lines)


def plot(summary: dict, methods: list[str], categories: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = groups(categories)
    colors = {m: f"C{i}" for i, m in enumerate(methods)}  # one colour per method in both panels
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 4.5), gridspec_kw={"width_ratios": [2.2, 1]})
    w = 0.8 / len(methods)
    x = np.arange(len(cats))
    for i, m in enumerate(methods):
        ax.bar(
            x + (i - (len(methods) - 1) / 2) * w,
            [summary.get((c, m), {}).get("speedup", 0) for c in cats],
            w,
            label=LABELS[m],
            color=colors[m],
        )
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(x, cats, rotation=30, ha="right")
    ax.set_ylabel("decode speedup over plain (same run)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    for m in methods:
        hist = summary[("overall", m)]["hist"]
        if m == "plain" or not hist:
            continue
        ks = sorted(hist)
        total = sum(hist.values())
        ax2.plot(ks, [100 * hist[k] / total for k in ks], marker="o", label=LABELS[m], color=colors[m])
    ax2.set_xlabel("tokens per full-model step")
    ax2.set_ylabel("% of steps")
    ax2.set_title("acceptance lengths (all categories)", fontsize=10)
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    atomic_save_figure(fig, out)


def answers_table(records: dict, methods: list[str]) -> str:
    """One row per question and method: its speedup over plain's answer to the same question (decode time over
    both turns), tokens per full-model step and accepted drafts by drafter; the questions in the order asked."""
    lines = [
        "| # | question | category | method | speedup | tokens/step | drafts accepted |",
        "|---|---|---|---|---|---|---|",
    ]
    plain = {r["question_id"]: r for r in records.get("plain", [])}
    for m in methods:
        if m == "plain":
            continue
        for i, r in enumerate(records[m]):
            base = plain.get(r["question_id"])
            rate = decode_rate(r["turns"])
            speedup = rate / decode_rate(base["turns"]) if base and decode_rate(base["turns"]) else 0.0
            acc = [a for t in r["turns"] for a in t["accept_lengths"]]
            by = sum((Counter(t.get("drafted_by", {})) for t in r["turns"]), Counter())
            lines.append(
                f"| {i + 1} | {r['question_id']} | {r['category']} | {LABELS[m]} | {speedup:.2f}x | "
                f"{statistics.mean(acc) if acc else 1.0:.2f} | {drafts_text(by)} |"
            )
    return "\n".join(lines)


def write_answers(records: dict, methods: list[str], model_name: str, out: Path) -> None:
    """Spec-Bench's answer format, one JSONL file per method."""
    for name in methods:
        lines = [
            json.dumps(
                {
                    "question_id": r["question_id"],
                    "category": r["category"],
                    "answer_id": uuid.uuid4().hex,
                    "model_id": f"{model_name}-{name}",
                    "tstamp": time.time(),
                    "choices": [
                        {
                            "index": 0,
                            "turns": [t["text"] for t in r["turns"]],
                            "new_tokens": [t["new_tokens"] for t in r["turns"]],
                            "wall_time": [round(t["wall_time"], 4) for t in r["turns"]],
                            "decode_time": [round(t["decode_time"], 4) for t in r["turns"]],
                            "accept_lengths": [t["accept_lengths"] for t in r["turns"]],
                        }
                    ],
                }
            )
            for r in records[name]
        ]
        atomic_write_text(out / f"{name}.jsonl", "\n".join(lines) + "\n")
