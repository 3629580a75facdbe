"""What `m2r2-bench --moe` writes: results.md (the table, with the command), rows.jsonl (one row a line) and
moe_bench.png (moe_bench.py runs it).

``labels`` maps each method the bench knows, in the order tables and legends show them, to its name there.
"""

from __future__ import annotations

import json
from pathlib import Path

import m2r2_mlx  # noqa: F401  (fast BLAS before mlx)
from m2r2_mlx.atomic import atomic_save_figure, atomic_write_text

import numpy as np


def table(result: dict, labels: dict[str, str]) -> str:
    """The rows as markdown."""
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    x = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    lines = [
        "| budget | method | slots/layer | tokens/s | vs LRU | hit rate | loads/token | MB read/token | read GB/s | "
        "stall ms/token | precision | recall | tokens = resident |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lead = "all" if r["method"] == "resident" else f"{r['budget']:g}%"
        lines.append(
            f"| {lead} | {labels[r['method']]} | {r.get('slots', '-')} | {r['tokens_per_s']:.1f} | "
            f"{x(r.get('vs_lru'))} | {f(r.get('hit_rate'), '.1%')} | {f(r.get('loads_per_token'), '.1f')} | "
            f"{f(r.get('mb_per_token'), '.1f')} | {f(r.get('read_gbps'), '.2f')} | "
            f"{f(r.get('stall_ms_per_token'), '.1f')} | {f(r.get('precision'), '.1%')} | {f(r.get('recall'), '.1%')} | "
            f"{'yes' if r['same_as_resident'] else 'NO'} |"
        )
    return "\n".join(lines)


def heading(result: dict, cmd: str) -> str:
    """What the table measured: the command, the prompts, the clock and the disk."""
    disk = result["disk"]
    line = (
        f"`{cmd}`: {result['prompts']} held-out prompts of {result['prompt_tokens']} tokens, {result['max_tokens']} "
        f"greedy tokens each, float32; one expert {result['expert_bytes'] / 1e6:.2f} MB. Disk probe: "
        f"{disk['gbps']:.2f} GB/s in 4 MB direct reads, one expert read alone in {disk['expert_ms']:.2f} ms"
        f"{'' if disk['direct'] else ' (the file system refused direct reads: the page cache served them)'}. "
    )
    if result["clock"] == "wall":
        how = "around the page cache (direct reads)" if result["io"] == "direct" else "through the page cache"
        return line + f"Wall clock: this machine, experts read from its disk {how}; read GB/s: bytes over busy time."
    p = result["device_profile"]
    kinds = "".join(f", {kind} {us:.3g} us" for kind, us in p["fixed_us"])
    shares = "".join(f", {kind} at {share:.2g} of the bandwidth" for kind, share in p["shares"])
    return line + (
        f"Device clock (modelled, deterministic): the {p['name']} profile, {p['what']}: memory "
        f"{p['memory_gbps']:.3g} GB/s x {p['bandwidth_share']:g}, {p['tflops']:.3g} TFLOP/s, "
        f"{p['launch_us']:.3g} us a kernel{kinds}{shares}, {p['sync_us']:.3g} us a host round trip, "
        f"link {p['link_gbps']:.3g} GB/s + {p['latency_ms']:.3g} ms (m2r2_mlx/moe/profiles.py)."
    )


def plot(result: dict, labels: dict[str, str], path: Path) -> None:
    """Tokens/s per budget (bars) and the cache's hit rate (lines), one per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["method"] != "resident"]
    budgets = sorted({r["budget"] for r in rows}, reverse=True)
    methods = [m for m in labels if m != "resident" and any(r["method"] == m for r in rows)]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(len(methods), 1)
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
    clock = "wall clock, this machine" if result["clock"] == "wall" else f"device clock, {result['profile']} profile"
    a.set(ylabel=f"decode tokens/s ({clock})", title="decode speed")
    b.set(ylabel="hit rate", ylim=(0, 1.05), title="expert cache hit rate")
    a.legend(fontsize=8)
    fig.tight_layout()
    atomic_save_figure(fig, path)


def write_report(result: dict, labels: dict[str, str], out: Path, cmd: str) -> None:
    """Prints the table and writes results.md, rows.jsonl (the run's settings first, then a row a line) and
    moe_bench.png into ``out``; ``cmd`` is the command line they quote."""
    md = table(result, labels)
    print(md)
    out.mkdir(parents=True, exist_ok=True)
    head = {k: v for k, v in result.items() if k != "rows"}
    lines = [json.dumps({"run": head, "command": cmd})] + [json.dumps(r) for r in result["rows"]]
    atomic_write_text(out / "rows.jsonl", "\n".join(lines) + "\n")
    atomic_write_text(out / "results.md", f"{heading(result, cmd)}\n\n{md}\n")
    plot(result, labels, out / "moe_bench.png")
