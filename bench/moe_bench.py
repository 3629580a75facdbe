"""MoE decoding with a memory-budgeted expert cache: on-demand LRU vs pre-gating vs M2R2 ahead-of-time loading.

    m2r2-bench --moe --model build/tiny-olmoe --adapters build/tiny-olmoe-m2r2 --budgets 100,50,25,12.5

For each expert budget (a share of all experts held in memory) and each method, greedy
decoding of the same prompts, batch 1, in one run: tokens/s (decode only), speedup over
on-demand LRU at the same budget, hit rate, prediction precision/recall, bytes moved and
stall time per token. Methods: all experts resident (no cache: the upper bound), on-demand
LRU (mixtral-offloading style), next-layer pre-gating on the slow state, M2R2 fast-stream
ahead-of-time loading, and a shuffled-prediction control. Every method's tokens are
checked against the all-resident model's. The link between "host" (the expert files,
memory-mapped) and "HBM" (the slot tensors) is throttled (--link-gbps, --latency-ms) to
emulate a discrete GPU's PCIe on unified memory, reproducibly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import m2r2_mlx  # noqa: F401  (fast BLAS before mlx)
from m2r2_mlx.atomic import atomic_save_figure, atomic_write_text
from m2r2_mlx.core.adapters import load_adapters
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.moe import ExpertStore, Link, offload_experts
from m2r2_mlx.moe.serve import attach_predictor, store_folder

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from tqdm.auto import tqdm

METHODS = ("resident", "lru", "pregating", "m2r2", "shuffled")
LABELS = {"resident": "all resident", "lru": "on-demand LRU", "pregating": "pre-gating (next layer)",
          "m2r2": "M2R2 ahead-of-time", "shuffled": "shuffled control"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="m2r2-bench --moe", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="build/tiny-olmoe", help="an mlx-lm MoE model (alias, repo id or folder)")
    p.add_argument("--adapters", default="build/tiny-olmoe-m2r2", help="M2R2 adapters trained on that model")
    p.add_argument(
        "--experts",
        type=Path,
        default=None,
        help="expert store folder (default: m2r2's cache, keyed by the model's weights; exported on first use)",
    )
    p.add_argument("--budgets", default="100,50,25,12.5", help="expert budgets, percent of all experts")
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated, of {', '.join(METHODS)} (resident always runs: it is the token reference)",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        default=Path("build/olmoe-data/eval.npy"),
        help="held-out token ids (.npy): prompts are windows of it",
    )
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=48, help="new tokens per prompt")
    p.add_argument("--link-gbps", type=float, default=0.5, help="throttled link bandwidth, GB/s (0: unthrottled)")
    p.add_argument("--latency-ms", type=float, default=0.05, help="throttled link latency per transfer")
    p.add_argument("--policy", default="lru", choices=["lru", "lfu"])
    p.add_argument(
        "--m2r2-intervals",
        type=int,
        default=None,
        help="M2R2: run the fast stream ahead in the first N gate intervals only (default: all)",
    )
    p.add_argument("--out", type=Path, default=Path("docs"), help="folder for moe_bench.md/.json/.png")
    return p


def greedy(model, prompt: np.ndarray, n: int, on_prefilled=None) -> tuple[list[int], float]:
    """Greedy tokens and the decode time (prefill excluded)."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt[None].astype(np.int32)), cache=cache)
    tok = int(mx.argmax(logits[0, -1]).item())
    if on_prefilled:
        on_prefilled()
    out, start = [tok], time.perf_counter()
    for _ in range(n - 1):
        logits = model(mx.array([[tok]]), cache=cache)
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
    return out, time.perf_counter() - start


def setup(args, method: str, budget: float, store):
    """A freshly loaded model with this method's cache and predictor; returns (model, cache, predictor)."""
    lm = load_model(args.model, tokenizer=False)  # token ids in, token ids out
    if method == "resident":
        return lm.model, None, None
    link = Link(args.link_gbps or None, args.latency_ms if args.link_gbps else 0.0)
    cache = offload_experts(lm.model, store, budget / 100, policy=args.policy, link=link)
    m2r2 = load_adapters(lm, args.adapters) if method == "m2r2" else None
    predictor = attach_predictor(cache, "none" if method == "lru" else method, m2r2, args.m2r2_intervals)
    return lm.model, cache, predictor


def run(args) -> dict:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise M2R2Error(f"unknown MoE method(s) {', '.join(bad)}; choose from {', '.join(METHODS)}")
    try:
        budgets = [float(b) for b in args.budgets.split(",")]
    except ValueError:
        raise M2R2Error(f"--budgets must be comma-separated percentages, got {args.budgets!r}") from None
    if args.num_prompts < 1 or args.max_tokens < 2 or args.prompt_tokens < 1:
        raise M2R2Error("--num-prompts and --prompt-tokens must be at least 1, --max-tokens at least 2")
    if not args.prompts.is_file():
        raise M2R2Error(f"{args.prompts} not found; build it with scripts/build_tiny_olmoe.sh")
    ids = np.load(args.prompts)
    span = args.prompt_tokens
    if ids.size < args.num_prompts * span * 4:
        raise M2R2Error(f"{args.prompts} holds {ids.size} tokens, too few for {args.num_prompts} prompts of {span}")
    stride = ids.size // args.num_prompts
    prompts = [ids[i * stride : i * stride + span] for i in range(args.num_prompts)]

    lm = load_model(args.model, tokenizer=False)
    folder = args.experts or store_folder(lm)
    if not (folder / "experts.json").exists():
        print(f"exporting experts to {folder} (once)", file=sys.stderr)
        ExpertStore.export(lm.model, folder)
    del lm
    store = ExpertStore.open(folder)

    runs = [("resident", 100.0)]  # always: the tokens every other row is checked against
    runs += [(m, b) for b in budgets for m in methods if m != "resident"]
    reference, rows = {}, []
    bar = tqdm(total=len(runs) * len(prompts), desc="moe bench", unit="prompt")
    for method, budget in runs:
        model, cache, predictor = setup(args, method, budget, store)
        greedy(model, prompts[0][:8], 4)  # warm-up: compile paths, fill the cache's slots

        def measure_from_here(cache=cache, predictor=predictor):  # after each prompt's prefill: count decode steps only
            if cache:
                cache.reset()
            if hasattr(predictor, "fast_layer_passes"):
                predictor.fast_layer_passes = 0

        stats, passes, tokens, seconds, same = [], [], 0, [], True
        for p_i, prompt in enumerate(prompts):
            bar.set_postfix_str(f"{method} {budget:g}%")
            out, dt = greedy(model, prompt, args.max_tokens, on_prefilled=measure_from_here)
            if method == "resident":
                reference[p_i] = out
            same &= reference[p_i] == out
            seconds.append(dt)
            tokens += len(out) - 1
            if cache:
                stats.append(cache.stats.summary())
            if hasattr(predictor, "fast_layer_passes"):
                passes.append(predictor.fast_layer_passes)
            bar.update()
        row = {
            "method": method,
            "budget": budget,
            "tokens": tokens,
            "decode_s": sum(seconds),
            "tokens_per_s": tokens / sum(seconds),
            "same_as_resident": same,
        }
        if cache:
            agg = lambda k, stats=stats: sum(s[k] for s in stats)  # noqa: E731
            steps = agg("tokens")
            row.update(
                hit_rate=agg("hits") / max(1, agg("hits") + agg("misses")),
                precision=agg("predicted_used") / agg("predicted") if agg("predicted") else None,
                recall=agg("predicted_used") / agg("used_when_predicted") if agg("used_when_predicted") else None,
                mb_per_token=agg("bytes_moved") / max(1, steps) / 1e6,
                stall_ms_per_token=1e3 * agg("stall_s") / max(1, steps),
                slots=f"{min(cache.slots_per_layer.values())}/{cache.num_experts(cache.layers[0])}",
            )
            if passes:
                row["fast_layer_passes_per_token"] = sum(passes) / max(1, steps)
            cache.close()
        rows.append(row)
    bar.close()
    for r in rows:
        lru = next((x for x in rows if x["method"] == "lru" and x["budget"] == r["budget"]), None)
        r["vs_lru"] = r["tokens_per_s"] / lru["tokens_per_s"] if lru else None
    return {
        "model": str(args.model),
        "link_gbps": args.link_gbps,
        "latency_ms": args.latency_ms,
        "expert_bytes": store.expert_bytes(store.layers[0]),
        "prompts": len(prompts),
        "prompt_tokens": span,
        "max_tokens": args.max_tokens,
        "rows": rows,
    }


def table(result: dict) -> str:
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    lines = [
        "| budget | method | slots/layer | tokens/s | vs LRU | hit rate | precision | recall | MB/token | "
        "stall ms/token | tokens = resident |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        budget = "all" if r["method"] == "resident" else f"{r['budget']:g}%"
        lines.append(
            f"| {budget} | {LABELS[r['method']]} | {r.get('slots', '-')} | {r['tokens_per_s']:.1f} | "
            f"{f(r['vs_lru'], '.2f')}x | {f(r.get('hit_rate'), '.1%')} | {f(r.get('precision'), '.1%')} | "
            f"{f(r.get('recall'), '.1%')} | {f(r.get('mb_per_token'), '.2f')} | "
            f"{f(r.get('stall_ms_per_token'), '.2f')} | {'yes' if r['same_as_resident'] else 'NO'} |"
        )
    return "\n".join(lines).replace("| -x |", "| - |")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["method"] != "resident"]
    budgets = sorted({r["budget"] for r in rows}, reverse=True)
    methods = [m for m in METHODS if m != "resident" and any(r["method"] == m for r in rows)]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        tps = [next((r["tokens_per_s"] for r in rows if r["method"] == m and r["budget"] == bu), 0) for bu in budgets]
        hit = [next((r["hit_rate"] for r in rows if r["method"] == m and r["budget"] == bu), 0) for bu in budgets]
        xs = np.arange(len(budgets)) + (i - (len(methods) - 1) / 2) * width
        a.bar(xs, tps, width, label=LABELS[m])
        b.plot(range(len(budgets)), hit, "o-", label=LABELS[m])
    resident = next((r for r in result["rows"] if r["method"] == "resident"), None)
    if resident:
        a.axhline(resident["tokens_per_s"], color="gray", ls="--", label="all resident")
    for ax in (a, b):
        ax.set_xticks(range(len(budgets)), [f"{bu:g}%" for bu in budgets])
        ax.set_xlabel("expert budget (share of all experts in memory)")
    a.set(ylabel="decode tokens/s", title=f"throttled link {result['link_gbps']:g} GB/s")
    b.set(ylabel="hit rate", ylim=(0, 1.05), title="expert cache hit rate")
    a.legend(fontsize=8)
    fig.tight_layout()
    atomic_save_figure(fig, path)


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run(args)
    md = table(result)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    cmd = " ".join(["m2r2-bench --moe", *(argv if argv is not None else sys.argv[1:])])
    atomic_write_text(args.out / "moe_bench.json", json.dumps(result, indent=1))
    atomic_write_text(
        args.out / "moe_bench_table.md",
        f"`{cmd}`: {result['prompts']} held-out prompts of {result['prompt_tokens']} tokens, "
        f"{result['max_tokens']} greedy tokens each, float32; expert {result['expert_bytes'] / 1e3:.0f} KB; "
        f"link {result['link_gbps']:g} GB/s + {result['latency_ms']:g} ms per transfer.\n\n{md}\n",
    )
    plot(result, args.out / "moe_bench.png")
    return 0


def main(argv: list[str] | None = None) -> None:
    sys.exit(run_cli("m2r2-bench --moe", lambda: _main(argv)))


if __name__ == "__main__":
    main()
