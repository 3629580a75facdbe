"""MoE decoding with a memory-budgeted expert cache: on-demand LRU vs pre-gating vs M2R2 ahead-of-time loading.

    python -m m2r2_mlx.moe.moefy -o build/smollm2-moe --adapters      # once: the MoEfied SmolLM2 (~5 min)
    m2r2-bench --moe --profile macbook --regime-map 0.25,0.5,1,2,4,8

For each expert budget (a share of all experts held in memory) and each method, greedy
decoding of the same prompts, batch 1, in one run: tokens/s (decode only), speedup over
on-demand LRU at the same budget, hit rate, prediction precision/recall, loads, bytes moved
and stall time per token. Methods: all experts resident (no cache: the upper bound), on-demand
LRU (mixtral-offloading style), next-layer pre-gating on the slow state, M2R2 ahead-of-time
loading (the fast stream run ahead through each interval, or fused as a second row of the slow
pass), and a shuffled-prediction control. Every method's tokens are checked against the
all-resident model's. The link between "host" (the expert files, memory-mapped) and "HBM" (the
slot tensors) is throttled: --link-gbps/--latency-ms, or --profile (m2r2_mlx/moe/profiles.py),
which sets it so that one expert's transfer time over one layer's compute time (the all-resident
decode step measured here, shared over the layers) is a real device's. --regime-map reruns every
method across that ratio: where ahead-of-time loading pays and where it cannot.
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
from m2r2_mlx.moe.cache import resolve_slots
from m2r2_mlx.moe.predictors import PREDICTORS
from m2r2_mlx.moe.profiles import PROFILES, get_profile, link_for
from m2r2_mlx.moe.serve import attach_predictor, store_folder

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from tqdm.auto import tqdm

# every registered predictor that needs no recorded run; on-demand loading is the "lru" row
PREDICTED = tuple(name for name, e in PREDICTORS.items() if name != "none" and not e.needs_trace)
METHODS = ("resident", "lru", *PREDICTED)
LABELS = {"resident": "all resident", "lru": "on-demand LRU", **{name: PREDICTORS[name].label for name in PREDICTED}}
DEFAULT_MODEL = Path("build/smollm2-moe")  # python -m m2r2_mlx.moe.moefy -o build/smollm2-moe --adapters


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="m2r2-bench --moe", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="an mlx-lm MoE model (alias, repo id or folder)")
    p.add_argument("--adapters", default=None, help="M2R2 adapters for that model (default: MODEL-m2r2)")
    p.add_argument(
        "--experts",
        type=Path,
        default=None,
        help="expert store folder (default: m2r2's cache, keyed by the model's weights; exported on first use)",
    )
    p.add_argument("--budgets", default="100,50,25", help="expert budgets, percent of all experts")
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated, of {', '.join(METHODS)} (resident always runs: it is the token reference)",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="held-out token ids (.npy): prompts are windows of it (default: the model folder's heldout.npy)",
    )
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=48, help="new tokens per prompt")
    p.add_argument("--link-gbps", type=float, default=0.5, help="throttled link bandwidth, GB/s (0: unthrottled)")
    p.add_argument("--latency-ms", type=float, default=0.05, help="throttled link latency per transfer")
    p.add_argument(
        "--profile",
        default=None,
        help=f"device profile, one of {', '.join(PROFILES)}: the link is set "
        "so that one expert's transfer / one layer's compute (measured here) is the device's",
    )
    p.add_argument("--ratio", type=float, default=None, help="as --profile, with this transfer/compute ratio")
    p.add_argument(
        "--regime-map",
        default=None,
        metavar="RATIOS",
        help="also run every method at these transfer/compute ratios (comma-separated) at "
        "--regime-budget: moe_regime.md/.png",
    )
    p.add_argument("--regime-budget", type=float, default=25.0)
    p.add_argument("--regime-prompts", type=int, default=3, help="prompts per regime-map point")
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


def setup(args, method: str, budget: float, store, link: Link | None):
    """A freshly loaded model with this method's cache and predictor; returns (model, cache, predictor)."""
    lm = load_model(args.model, tokenizer=False)  # token ids in, token ids out
    if method == "resident":
        return lm.model, None, None
    cache = offload_experts(lm.model, store, budget / 100, policy=args.policy, link=link)
    name = "none" if method == "lru" else method
    m2r2 = load_adapters(lm, args.adapters) if PREDICTORS[name].needs_adapters else None
    predictor = attach_predictor(cache, name, m2r2, args.m2r2_intervals)
    return lm.model, cache, predictor


def check_args(args) -> tuple[list[str], list[float]]:
    """Every input checked before anything loads: one line each."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise M2R2Error(f"unknown MoE method(s) {', '.join(bad)}; choose from {', '.join(METHODS)}")
    try:
        budgets = [float(b) for b in args.budgets.split(",")]
        args.ratios = [float(r) for r in args.regime_map.split(",")] if args.regime_map else []
    except ValueError:
        raise M2R2Error(
            f"--budgets and --regime-map take comma-separated numbers, got {args.budgets!r} and {args.regime_map!r}"
        ) from None
    if args.profile is not None and args.ratio is not None:
        raise M2R2Error("--profile and --ratio both set the link; pass one")
    args.device = get_profile(args.profile) if args.profile is not None else None
    if args.ratio is not None and not args.ratio > 0 or any(not r > 0 for r in args.ratios):
        raise M2R2Error("transfer/compute ratios (--ratio, --regime-map) must be positive")
    if args.num_prompts < 1 or args.max_tokens < 2 or args.prompt_tokens < 1 or args.regime_prompts < 1:
        raise M2R2Error(
            "--num-prompts, --regime-prompts and --prompt-tokens must be at least 1, --max-tokens at least 2"
        )
    folder = Path(args.model)
    args.adapters = args.adapters or f"{str(args.model).rstrip('/')}-m2r2"
    if args.prompts is None:
        own = folder / "heldout.npy"
        args.prompts = own if own.is_file() else Path("build/olmoe-data/eval.npy")
    if not args.prompts.is_file():
        raise M2R2Error(
            f"{args.prompts} not found; build the model with python -m m2r2_mlx.moe.moefy -o {folder} "
            "--adapters (it writes heldout.npy), or pass --prompts"
        )
    return methods, budgets


def measure(args, method, budget, store, link, prompts, reference) -> dict:
    """One row: decode tokens/s and the cache's counters over ``prompts``, tokens checked against ``reference``."""
    model, cache, predictor = setup(args, method, budget, store, link)
    greedy(model, prompts[0][:8], 4)  # warm-up: compile paths, fill the cache's slots
    fast = predictor is not None and predictor.fast_layer_passes is not None

    def measure_from_here(cache=cache, predictor=predictor):  # after each prompt's prefill: count decode steps only
        if cache:
            cache.reset()
        if fast:
            predictor.fast_layer_passes = 0

    stats, passes, tokens, seconds, same = [], [], 0, [], True
    for p_i, prompt in enumerate(prompts):
        out, dt = greedy(model, prompt, args.max_tokens, on_prefilled=measure_from_here)
        if method == "resident":
            reference[p_i] = out
        same &= reference[p_i] == out
        seconds.append(dt)
        tokens += len(out) - 1
        if cache:
            stats.append(cache.stats.summary())
        if fast:
            passes.append(predictor.fast_layer_passes)
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
            loads_per_token=(agg("misses") + agg("prefetch_loads")) / max(1, steps),
            stall_ms_per_token=1e3 * agg("stall_s") / max(1, steps),
            slots=f"{min(cache.slots_per_layer.values())}/{cache.num_experts(cache.layers[0])}",
        )
        if passes:
            row["fast_layer_passes_per_token"] = sum(passes) / max(1, steps)
        cache.close()
    return row


def with_vs_lru(
    rows: list[dict], key: str = "budget", compute_ms: float | None = None, expert_ms: dict | None = None
) -> list[dict]:
    """Speedup over LRU at the same budget (or ratio); on LRU rows, the overlap ceiling: LRU's loads hidden
    behind compute in full, ``T_lru / max(compute, loads x one expert's transfer)``. With as many slots as
    experts per token every policy makes LRU's misses, so no predictor can pass it there."""
    for r in rows:
        lru = next((x for x in rows if x["method"] == "lru" and x[key] == r[key]), None)
        r["vs_lru"] = r["tokens_per_s"] / lru["tokens_per_s"] if lru else None
        if r["method"] == "lru" and compute_ms and expert_ms:
            t = expert_ms[r[key]] if key == "ratio" else expert_ms[None]
            r["overlap_ceiling"] = (1e3 / r["tokens_per_s"]) / max(compute_ms, r["loads_per_token"] * t)
    return rows


def run(args) -> dict:
    methods, budgets = check_args(args)
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
    num_layers = len(lm.model.layers)
    del lm
    store = ExpertStore.open(folder)
    for b in budgets + ([args.regime_budget] if args.ratios else []):
        resolve_slots(b / 100, store)  # a budget below top-k fails now, in one line, before any run

    reference: dict = {}
    bar = tqdm(
        total=(1 + len(budgets) * (len(methods) - ("resident" in methods))) * len(prompts)
        + len(args.ratios) * (len(methods) - ("resident" in methods)),
        desc="moe bench",
        unit="run",
    )
    # all experts resident: the tokens every other row is checked against, and this machine's compute
    resident = measure(args, "resident", 100.0, store, None, prompts, reference)
    bar.update(len(prompts))
    # one layer's compute on this machine: the all-resident decode step shared over the layers
    layer_ms = 1e3 / resident["tokens_per_s"] / num_layers
    ratio = args.device.ratio if args.device else args.ratio
    if ratio is not None:
        link = link_for(ratio, store.expert_bytes(), layer_ms)
    else:
        link = Link(args.link_gbps or None, args.latency_ms if args.link_gbps else 0.0)
    rows = [resident]
    for b in budgets:
        for m in methods:
            if m == "resident":
                continue
            bar.set_postfix_str(f"{m} {b:g}%")
            rows.append(measure(args, m, b, store, fresh(link), prompts, reference))
            bar.update(len(prompts))
    regime = []
    for r in args.ratios:
        for m in methods:
            if m == "resident":
                continue
            bar.set_postfix_str(f"ratio {r:g} {m}")
            row = measure(
                args,
                m,
                args.regime_budget,
                store,
                link_for(r, store.expert_bytes(), layer_ms),
                prompts[: args.regime_prompts],
                reference,
            )
            regime.append({**row, "ratio": r})
            bar.update()
    bar.close()
    return {
        "model": str(args.model),
        "profile": args.profile,
        "ratio": ratio,
        "layer_ms": layer_ms,
        "link_gbps": link.gb_per_s,
        "latency_ms": link.latency_ms,
        "expert_bytes": store.expert_bytes(store.layers[0]),
        "prompts": len(prompts),
        "prompt_tokens": span,
        "max_tokens": args.max_tokens,
        "rows": with_vs_lru(
            rows,
            compute_ms=1e3 / resident["tokens_per_s"],
            expert_ms={None: link.min_seconds(store.expert_bytes()) * 1e3},
        ),
        "regime_budget": args.regime_budget,
        "regime_prompts": min(args.regime_prompts, len(prompts)),
        "regime": with_vs_lru(
            regime, "ratio", compute_ms=1e3 / resident["tokens_per_s"], expert_ms={r: r * layer_ms for r in args.ratios}
        ),
    }


def fresh(link: Link) -> Link:
    """A new link with the same settings (its counters and channel are per run)."""
    return Link(link.gb_per_s, link.latency_ms)


def table(result: dict, rows: list[dict] | None = None, first: str = "budget") -> str:
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
            f"| {lead} | {LABELS[r['method']]} | {r.get('slots', '-')} | {r['tokens_per_s']:.1f} | "
            f"{f(r['vs_lru'], '.2f')}x | {f(r.get('hit_rate'), '.1%')} | {f(r.get('precision'), '.1%')} | "
            f"{f(r.get('recall'), '.1%')} | {f(r.get('loads_per_token'), '.1f')} | {f(r.get('mb_per_token'), '.2f')} | "
            f"{f(r.get('stall_ms_per_token'), '.2f')} | {f(r.get('fast_layer_passes_per_token'), '.0f')} | "
            f"{f(r.get('overlap_ceiling'), '.2f')}{'x' if r.get('overlap_ceiling') else ''} | "
            f"{'yes' if r['same_as_resident'] else 'NO'} |"
        )
    return "\n".join(lines).replace("| -x |", "| - |")


def plot_regime(result: dict, path: Path) -> None:
    """Speedup over on-demand LRU against the transfer/compute ratio, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["regime"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for m in METHODS:
        pts = sorted((r["ratio"], r["vs_lru"]) for r in rows if r["method"] == m)
        if pts and m != "lru":
            ax.plot(*zip(*pts), "o-", label=LABELS[m])
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
        f"{link_line(result)}.\n\n{md}\n",
    )
    plot(result, args.out / "moe_bench.png")
    if result["regime"]:
        rmd = table(result, result["regime"], first="ratio")
        print(rmd)
        atomic_write_text(
            args.out / "moe_regime.md",
            f"`{cmd}`: regime map at a {result['regime_budget']:g}% budget, {result['regime_prompts']} prompts; "
            f"ratio = one expert's transfer time / one layer's compute time ({result['layer_ms']:.2f} ms here); "
            f"profiles: " + ", ".join(f"{p.name} {p.ratio:.2f}" for p in PROFILES.values()) + f".\n\n{rmd}\n",
        )
        plot_regime(result, args.out / "moe_regime.png")
    return 0


def main(argv: list[str] | None = None) -> None:
    sys.exit(run_cli("m2r2-bench --moe", lambda: _main(argv)))


if __name__ == "__main__":
    main()
