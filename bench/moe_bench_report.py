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


def counter(r: dict, key: str):
    """A row's counter from its device-clock run where it has one (deterministic), else its wall-clock run's."""
    return r.get(f"device_{key}", r.get(key))


def table(result: dict, labels: dict[str, str], rows: list[dict] | None = None, first: str = "budget") -> str:
    """The rows as markdown, the device clock first; ``first="ratio"``: the regime map's rows (wall clock), led by
    their transfer/compute ratio. Counters (hit rate to fast rows) are the device-clock run's where it ran."""
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    lines = [
        f"| {first} | method | slots/layer | device tokens/s | device vs LRU | wall tokens/s | wall vs LRU | "
        "hit rate | loads/token | device stall ms/token | wall stall ms/token | precision | recall | MB/token | "
        "fast rows/token | overlap ceiling | tokens = resident |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"] if rows is None else rows:
        if first == "ratio":
            lead = f"{r['ratio']:g}"
        else:
            lead = "all" if r["method"] == "resident" else f"{r['budget']:g}%"
        x = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
        lines.append(
            f"| {lead} | {labels[r['method']]} | {r.get('slots', '-')} | {f(r.get('device_tokens_per_s'), '.1f')} | "
            f"{x(r.get('device_vs_lru'))} | {f(r.get('tokens_per_s'), '.1f')} | {x(r.get('vs_lru'))} | "
            f"{f(counter(r, 'hit_rate'), '.1%')} | {f(counter(r, 'loads_per_token'), '.1f')} | "
            f"{f(r.get('device_stall_ms_per_token'), '.2f')} | {f(r.get('stall_ms_per_token'), '.2f')} | "
            f"{f(counter(r, 'precision'), '.1%')} | {f(counter(r, 'recall'), '.1%')} | "
            f"{f(counter(r, 'mb_per_token'), '.2f')} | {f(counter(r, 'fast_layer_passes_per_token'), '.0f')} | "
            f"{x(r.get('overlap_ceiling'))} | {'yes' if r['same_as_resident'] else 'NO'} |"
        )
    return "\n".join(lines)


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
    for p in PROFILES.values():
        if p.ratio is not None:
            ax.axvline(p.ratio, color="k", ls=":", lw=0.8)
            ax.text(p.ratio, ax.get_ylim()[1], f" {p.name}", rotation=90, va="top", fontsize=8)
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
    """Tokens/s per budget (bars; the device clock's where it ran) and the cache's hit rate (lines), one per
    method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = "device_tokens_per_s" if "device" in result.get("clocks", ()) else "tokens_per_s"
    rows = [r for r in result["rows"] if r["method"] != "resident"]
    budgets = sorted({r["budget"] for r in rows}, reverse=True)
    methods = [m for m in labels if m != "resident" and any(r["method"] == m for r in rows)]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        tps = [next((r[speed] for r in rows if r["method"] == m and r["budget"] == bu), 0) for bu in budgets]
        hit = [
            next((counter(r, "hit_rate") for r in rows if r["method"] == m and r["budget"] == bu), 0) for bu in budgets
        ]
        xs = np.arange(len(budgets)) + (i - (len(methods) - 1) / 2) * width
        a.bar(xs, tps, width, label=labels[m])
        b.plot(range(len(budgets)), hit, "o-", label=labels[m])
    resident = next((r for r in result["rows"] if r["method"] == "resident"), None)
    if resident:
        a.axhline(resident[speed], color="gray", ls="--", label="all resident")
    for ax in (a, b):
        ax.set_xticks(range(len(budgets)), [f"{bu:g}%" for bu in budgets])
        ax.set_xlabel("expert budget (share of all experts in memory)")
    clock = f"device clock, {result['device_profile']['name']} profile" if speed != "tokens_per_s" else "wall clock"
    a.set(ylabel=f"decode tokens/s ({clock})", title=link_line(result).split(" (")[0])
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


def clock_line(result: dict) -> str:
    if result.get("device_profile") is None:
        return " Wall clock only."
    p = result["device_profile"]
    kinds = "".join(f", {kind} {us:.3g} us" for kind, us in p["fixed_us"])
    shares = "".join(f", {kind} at {share:.2g} of the bandwidth" for kind, share in p["shares"])
    return (
        f" Device clock (modelled, deterministic): the {p['name']} profile, {p['what']}: memory "
        f"{p['memory_gbps']:.3g} GB/s x {p['bandwidth_share']:g}, {p['tflops']:.3g} TFLOP/s, "
        f"{p['launch_us']:.3g} us a kernel{kinds}{shares}, {p['sync_us']:.3g} us a host round trip, "
        f"link {p['link_gbps']:g} GB/s + {p['latency_ms']:g} ms (m2r2_mlx/moe/profiles.py). "
        "Wall clock: this machine with the emulated link."
    )


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
        f"{link_line(result)}.{clock_line(result)}\n\n{md}\n",
    )
    plot(result, labels, out / "moe_bench.png")
    if result["regime"]:
        rmd = table(result, labels, result["regime"], first="ratio")
        print(rmd)
        atomic_write_text(
            out / "moe_regime.md",
            f"`{cmd}`: regime map at a {result['regime_budget']:g}% budget, {result['regime_prompts']} prompts; "
            f"ratio = one expert's transfer time / one layer's compute time ({result['layer_ms']:.2f} ms here); "
            "profiles: "
            + ", ".join(f"{p.name} {p.ratio:.2f}" for p in PROFILES.values() if p.ratio is not None)
            + f".\n\n{rmd}\n",
        )
        plot_regime(result, labels, out / "moe_regime.png")
