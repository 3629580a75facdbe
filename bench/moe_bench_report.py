"""What `m2r2-bench --moe` writes: its result as markdown tables, JSON and plots (moe_bench.py runs it).

``labels`` maps each method the bench knows, in the order tables and legends show them, to its name there.
"""

from __future__ import annotations

import json
from pathlib import Path

import m2r2_mlx  # noqa: F401  (fast BLAS before mlx)
from m2r2_mlx.atomic import atomic_save_figure, atomic_write_text
from m2r2_mlx.moe.profiles import PROFILES

import numpy as np


def table(result: dict, labels: dict[str, str], rows: list[dict] | None = None, first: str = "budget") -> str:
    """The rows as markdown; ``first="ratio"``: the regime map's rows, led by their transfer/compute ratio."""
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    lines = [
        f"| {first} | method | slots/layer | tokens/s | vs LRU | hit rate | precision | recall | loads/token | "
        "MB/token | stall ms/token | fast rows/token | overlap ceiling | tokens = resident |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"] if rows is None else rows:
        if first == "ratio":
            lead = f"{r['ratio']:g}"
        else:
            lead = "all" if r["method"] == "resident" else f"{r['budget']:g}%"
        lines.append(
            f"| {lead} | {labels[r['method']]} | {r.get('slots', '-')} | {r['tokens_per_s']:.1f} | "
            f"{f(r['vs_lru'], '.2f')}x | {f(r.get('hit_rate'), '.1%')} | {f(r.get('precision'), '.1%')} | "
            f"{f(r.get('recall'), '.1%')} | {f(r.get('loads_per_token'), '.1f')} | {f(r.get('mb_per_token'), '.2f')} | "
            f"{f(r.get('stall_ms_per_token'), '.2f')} | {f(r.get('fast_layer_passes_per_token'), '.0f')} | "
            f"{f(r.get('overlap_ceiling'), '.2f')}{'x' if r.get('overlap_ceiling') else ''} | "
            f"{'yes' if r['same_as_resident'] else 'NO'} |"
        )
    return "\n".join(lines).replace("| -x |", "| - |")


def plot_regime(result: dict, labels: dict[str, str], path: Path) -> None:
    """Speedup over on-demand LRU against the transfer/compute ratio, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["regime"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for m in labels:
        pts = sorted((r["ratio"], r["vs_lru"]) for r in rows if r["method"] == m)
        if pts and m != "lru":
            ax.plot(*zip(*pts), "o-", label=labels[m])
    ax.axhline(1.0, color="gray", ls="--", label="on-demand LRU")
    ceiling = sorted((r["ratio"], r["overlap_ceiling"]) for r in rows if r.get("overlap_ceiling"))
    if ceiling:
        ax.plot(*zip(*ceiling), "k--", lw=1, label="LRU's loads fully hidden (ceiling)")
    for name in PROFILES:
        ax.axvline(PROFILES[name].ratio, color="k", ls=":", lw=0.8)
        ax.text(PROFILES[name].ratio, ax.get_ylim()[1], f" {name}", rotation=90, va="top", fontsize=8)
    ax.set_xscale("log")
    ax.set(
        xlabel="one expert's transfer time / one layer's compute time",
        ylabel="decode tokens/s vs on-demand LRU",
        title=f"regime map: {result['regime_budget']:g}% expert budget",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_save_figure(fig, path)


def plot(result: dict, labels: dict[str, str], path: Path) -> None:
    """Tokens/s per budget (bars) and the cache's hit rate (lines), one per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["method"] != "resident"]
    budgets = sorted({r["budget"] for r in rows}, reverse=True)
    methods = [m for m in labels if m != "resident" and any(r["method"] == m for r in rows)]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        tps = [next((r["tokens_per_s"] for r in rows if r["method"] == m and r["budget"] == bu), 0) for bu in budgets]
        hit = [next((r["hit_rate"] for r in rows if r["method"] == m and r["budget"] == bu), 0) for bu in budgets]
        xs = np.arange(len(budgets)) + (i - (len(methods) - 1) / 2) * width
        a.bar(xs, tps, width, label=labels[m])
        b.plot(range(len(budgets)), hit, "o-", label=labels[m])
    resident = next((r for r in result["rows"] if r["method"] == "resident"), None)
    if resident:
        a.axhline(resident["tokens_per_s"], color="gray", ls="--", label="all resident")
    for ax in (a, b):
        ax.set_xticks(range(len(budgets)), [f"{bu:g}%" for bu in budgets])
        ax.set_xlabel("expert budget (share of all experts in memory)")
    a.set(ylabel="decode tokens/s", title=link_line(result).split(" (")[0])
    b.set(ylabel="hit rate", ylim=(0, 1.05), title="expert cache hit rate")
    a.legend(fontsize=8)
    fig.tight_layout()
    atomic_save_figure(fig, path)


def link_line(result: dict) -> str:
    gbps = "unthrottled" if result["link_gbps"] is None else f"{result['link_gbps']:.3g} GB/s"
    line = f"link {gbps} + {result['latency_ms']:.3g} ms per transfer"
    if result["ratio"] is not None:
        expert_ms = result["ratio"] * result["layer_ms"]
        line += (
            f" (profile {result['profile'] or 'custom'}: one expert {expert_ms:.2f} ms = {result['ratio']:.2f} x "
            f"one layer's compute, {result['layer_ms']:.2f} ms measured here)"
        )
    return line


def write_report(result: dict, labels: dict[str, str], out: Path, cmd: str) -> None:
    """Prints the tables and writes moe_bench.json, moe_bench_table.md and moe_bench.png into ``out``, and
    moe_regime.md/.png when the run has a regime map; ``cmd`` is the command line the files quote."""
    md = table(result, labels)
    print(md)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "moe_bench.json", json.dumps(result, indent=1))
    atomic_write_text(
        out / "moe_bench_table.md",
        f"`{cmd}`: {result['prompts']} held-out prompts of {result['prompt_tokens']} tokens, "
        f"{result['max_tokens']} greedy tokens each, float32; expert {result['expert_bytes'] / 1e3:.0f} KB; "
        f"{link_line(result)}.\n\n{md}\n",
    )
    plot(result, labels, out / "moe_bench.png")
    if result["regime"]:
        rmd = table(result, labels, result["regime"], first="ratio")
        print(rmd)
        atomic_write_text(
            out / "moe_regime.md",
            f"`{cmd}`: regime map at a {result['regime_budget']:g}% budget, {result['regime_prompts']} prompts; "
            f"ratio = one expert's transfer time / one layer's compute time ({result['layer_ms']:.2f} ms here); "
            f"profiles: " + ", ".join(f"{p.name} {p.ratio:.2f}" for p in PROFILES.values()) + f".\n\n{rmd}\n",
        )
        plot_regime(result, labels, out / "moe_regime.png")
