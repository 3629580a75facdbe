"""Where the lookahead row loses to the true routes, on the macbook device clock (docs/moe_bench.md, round 5).

    python -m experiments.moe_planner_gap [BUDGET]      # default 25 (percent of the experts)

Rows: on-demand LRU; the lookahead adapters as the bench runs them (planned, governed), without the governor, and
with every prediction loaded (no planner); the true routes 3 MoE layers ahead through the planner, and every one
loaded with Belady's eviction. Two held-out prompts, 23 decode tokens each, the bench's model (build/smollm2-moe).
"""

from __future__ import annotations

import sys

from m2r2_mlx.moe import Oracle
from m2r2_mlx.moe.planner import PlannerConfig, PrefetchPlanner
from m2r2_mlx.moe.profiles import get_profile

import numpy as np

from m2r2_bench import moe_rows
from m2r2_bench.moe_bench import MoEBenchConfig, open_store
from m2r2_bench.moe_rows import BenchRun, measure

MODEL = "build/smollm2-moe"


def _no_governor(model, cache, predictor, run):
    cache.planner.governor = None
    return model, cache, predictor


def _no_planner(model, cache, predictor, run):
    cache.planner.detach()
    return model, cache, predictor


def _true_routes_planned(model, cache, predictor, run):
    predictor.detach()
    PrefetchPlanner(PlannerConfig(governed=False)).attach(cache)
    return model, cache, Oracle(run.traces[0], lookahead=3).attach(cache)


def _true_routes(model, cache, predictor, run):
    predictor.detach()
    return model, cache, Oracle(run.traces[0], lookahead=3).attach(cache)


ROWS = [
    ("on-demand LRU", "lru", None),
    ("lookahead adapters, planned, governed", "lookahead", None),
    ("lookahead adapters, planned, no governor", "lookahead", _no_governor),
    ("lookahead adapters, every prediction loaded", "lookahead", _no_planner),
    ("true routes 3 layers ahead, through the planner", "oracle", _true_routes_planned),
    ("true routes 3 layers ahead, every one loaded", "oracle", _true_routes),
]


def short_run() -> BenchRun:
    """The bench's model on two held-out prompts of 48 tokens, 23 decode tokens each, on the macbook device
    clock, its all-resident tokens recorded as the reference."""
    config = MoEBenchConfig(
        model=MODEL, adapters=f"{MODEL}-m2r2", profile=get_profile("macbook"), num_prompts=2, max_tokens=24
    )
    ids = np.load(f"{MODEL}/heldout.npy")
    prompts = [ids[i * (ids.size // 2) :][:48] for i in range(2)]
    store, _ = open_store(config)
    run = BenchRun(config, store, prompts)
    measure(run, "resident", 100.0, None, "device")
    return run


def measure_changed(run: BenchRun, method: str, budget: float, change=None) -> dict:
    """One device-clock row of ``method``, its (model, cache, predictor) passed through ``change`` first."""
    setup = moe_rows.setup
    if change is not None:
        moe_rows.setup = lambda *a: change(*setup(*a), a[0])
    try:
        return measure(run, method, budget, None, "device")
    finally:
        moe_rows.setup = setup


def main() -> None:
    budget = float(sys.argv[1]) if len(sys.argv) > 1 else 25.0
    run = short_run()
    print(f"{budget:g}% | tokens/s | hit rate | loads/token | stall ms/token")
    for label, method, change in ROWS:
        row = measure_changed(run, method, budget, change)
        print(
            f"{label} | {row['tokens_per_s']:.1f} | {row['hit_rate']:.1%} | {row['loads_per_token']:.1f} | "
            f"{row['stall_ms_per_token']:.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
