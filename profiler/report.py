"""The profile for a developer: a JSON summary (what the plot and docs read) and a Markdown report."""

from __future__ import annotations

from .session import Breakdown

MB, MS = 1e6, 1e3


def summary(profile: Breakdown) -> dict:
    p, r = profile, profile.roofline
    steps = len(p.decode_steps)
    return {
        "model": p.model,
        "label": p.label,
        "machine": p.machine.to_json(),
        "prompt_tokens": p.prompt_tokens,
        "tokens": len(p.measured.tokens),
        "decode_steps": steps,
        "tokens_per_step": p.tokens_per_step,
        "same_tokens": p.same_tokens,
        "unmeasured_tokens_per_s": p.unmeasured.tokens_per_s,
        "measured_tokens_per_s": p.measured.tokens_per_s,
        "step_ms": p.step_ms,
        "coverage": p.coverage,
        "rows": [
            {
                "phase": w.phase,
                "component": w.component,
                "label": w.label,
                "ms_per_step": MS * w.seconds / max(steps, 1),
                "share": w.seconds / p.steps_s if p.steps_s else 0.0,
                "calls_per_step": w.calls / max(steps, 1),
            }
            for w in p.rows
        ],
        "forwards": [s.__dict__ for s in p.sizes],
        "draft_steps": p.draft[0],
        "draft_ms_per_draft_step": MS * p.draft[1] / p.draft[0] if p.draft[0] else None,
        "roofline": r.to_json(),
        "experts": p.experts,
    }


def _table(s: dict) -> list[str]:
    lines = ["| component | ms per step | share | calls per step |", "|---|---:|---:|---:|"]
    for row in s["rows"]:
        lines.append(
            f"| {row['label']} | {row['ms_per_step']:.2f} | {row['share']:.1%} | {row['calls_per_step']:.1f} |"
        )
    total = sum(row["ms_per_step"] for row in s["rows"])
    lines.append(f"| **measured step** | **{total:.2f}** | 100% | |")
    return lines


def _forwards(s: dict) -> list[str]:
    bw, rate = s["machine"]["bandwidth_gbs"], s["machine"]["gflops"]
    lines = [
        "| positions | forwards | ms each (measured) | MB read | GFLOP | memory floor ms | compute floor ms | bound |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for b in s["roofline"]["forwards"]:
        lines.append(
            f"| {b['positions']} | {next(f['count'] for f in s['forwards'] if f['positions'] == b['positions'])} | "
            f"{MS * b['measured_s']:.1f} | {b['bytes'] / MB:.0f} | {b['flops'] / 1e9:.2f} | "
            f"{MS * b['memory_s']:.1f} | {MS * b['compute_s']:.1f} | {b['limit']} |"
        )
    pre = s["roofline"]["prefill"]
    lines.append(
        f"| prefill {pre['positions']} | 1 | {MS * pre['measured_s']:.1f} | {pre['bytes'] / MB:.0f} | "
        f"{pre['flops'] / 1e9:.2f} | {MS * pre['memory_s']:.1f} | {MS * pre['compute_s']:.1f} | {pre['limit']} |"
    )
    lines.append("")
    lines.append(
        f"Floors at this machine's {bw:.1f} GB/s and {rate:.0f} GFLOP/s ({s['machine']['dtype']} matrix product)."
    )
    return lines


def _experts(s: dict) -> list[str]:
    lines = [
        "| run | loads per token | stall ms per token | reads busy ms per token | MB read per token | hit rate |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for run, e in s["experts"].items():
        lines.append(
            f"| {run} | {e['loads_per_token']:.2f} | {e['stall_ms_per_token']:.2f} | "
            f"{e['read_busy_ms_per_token']:.2f} | {e['mb_per_token']:.2f} | {e['hit_rate']:.1%} |"
        )
    return lines


def markdown(s: dict) -> str:
    m, r = s["machine"], s["roofline"]
    cost = s["measured_tokens_per_s"] / s["unmeasured_tokens_per_s"] if s["unmeasured_tokens_per_s"] else 0.0
    lines = [
        f"# m2r2-profile: {s['model']}, {s['label']}",
        "",
        f"MLX on the {m['device'].upper()}; a prompt of {s['prompt_tokens']} tokens, {s['tokens']} tokens decoded in "
        f"{s['decode_steps']} decode steps ({s['tokens_per_step']:.2f} tokens per step).",
        "",
        "## What measuring costs",
        "",
        f"Unmeasured {s['unmeasured_tokens_per_s']:.1f} tokens/s, measured {s['measured_tokens_per_s']:.1f} tokens/s "
        f"({cost:.2f}x): each timed call evaluates its result before the next starts, so nothing is pipelined. "
        f"Same tokens profiled and unprofiled: {'yes' if s['same_tokens'] else 'NO'}.",
        "",
        f"## Where a step's time goes ({s['step_ms']:.2f} ms per measured step)",
        "",
        *_table(s),
        "",
        f"The steps cover {s['coverage']:.1%} of the measured decode's wall time (the rest is the measuring loop).",
    ]
    if s["draft_steps"]:
        lines.append(f"Fast-stream draft steps: {s['draft_steps']}, {s['draft_ms_per_draft_step']:.2f} ms each.")
    lines += [
        "",
        "## Roofline",
        "",
        f"Bytes read per token (weights and keys/values): {r['bytes_per_token'] / MB:.0f} MB; at the unmeasured "
        f"{s['unmeasured_tokens_per_s']:.1f} tokens/s that is {r['achieved_gbs']:.1f} GB/s: **decoding runs at "
        f"{r['share_of_bandwidth']:.0%} of this machine's memory limit** ({m['bandwidth_gbs']:.1f} GB/s, a streaming "
        "copy through MLX on the same device).",
        "",
        *_forwards(s),
    ]
    if r["ridge_positions"]:
        lines.append(f"A forward turns compute-bound from about {r['ridge_positions']:.0f} positions.")
    if s["experts"]:
        lines += ["", "## Experts within the memory budget", "", *_experts(s)]
    return "\n".join(lines) + "\n"
