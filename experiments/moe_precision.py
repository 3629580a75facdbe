"""How precise a predictor the MoE gate needs: the true routes with a share of each layer's experts swapped for
wrong ones, through the planner, on the macbook device clock (docs/moe_bench.md, "What a predictor must reach").

    python -m experiments.moe_precision [--budgets 25,37.5,50] [--out docs/moe_precision]

A noisy oracle knows each (step, layer)'s true experts 3 MoE layers ahead (into the next token's first layers) and
names each one with probability ``precision``, else a wrong expert in its place (seeded per step and layer, so
every run and every request for a layer see the same guess). It costs nothing, as the lookahead maps cost about
one router matmul a layer. Rows: on-demand LRU, then each precision through the planner (not governed). Two
held-out prompts, 23 decode tokens each, the bench's model (build/smollm2-moe); the same figures on every run.
Writes results.md and precision.png under --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from m2r2_mlx.atomic import atomic_write_text
from m2r2_mlx.moe import Oracle
from m2r2_mlx.moe.planner import PlannerConfig, PrefetchPlanner
from m2r2_mlx.moe.profiles import get_profile

import numpy as np

from m2r2_bench import moe_rows
from m2r2_bench.moe_bench import MoEBenchConfig, open_store
from m2r2_bench.moe_rows import BenchRun, measure

MODEL = "build/smollm2-moe"
LEAD = 3
PRECISIONS = (0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0)


class NoisyOracle(Oracle):
    """The true routes, each expert swapped for a wrong one with probability 1 - ``precision``."""

    def __init__(self, trace, precision: float, lookahead: int = LEAD, seed: int = 0):
        super().__init__(trace, lookahead)
        self.precision, self.seed = precision, seed

    def on_layer(self, layer, x) -> None:
        cache, n = self.cache, len(self.cache.layers)
        for j in range(cache.ordinal(layer) + 1, cache.ordinal(layer) + 1 + self.lookahead):
            step, target = cache.step + j // n, cache.layers[j % n]
            if true := self.trace.get((step, target)):
                cache.prefetch(target, self.guess(step, target, true), step=step)

    def guess(self, step: int, layer: int, true: list[int]) -> list[int]:
        rng = np.random.default_rng((self.seed, step, layer))
        wrong = [e for e in rng.permutation(self.cache.num_experts(layer)).tolist() if e not in true]
        assert len(wrong) >= len(true), "a wrong expert for every true one needs top-k <= experts / 2"
        return [e if rng.random() < self.precision else wrong.pop() for e in true]


def _planned(precision: float):
    def change(model, cache, predictor, run):
        predictor.detach()
        PrefetchPlanner(PlannerConfig(governed=False)).attach(cache)
        return model, cache, NoisyOracle(run.traces[0], precision).attach(cache)

    return change


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="25,37.5,50")
    parser.add_argument("--out", type=Path, default=Path("docs/moe_precision"))
    args = parser.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    config = MoEBenchConfig(
        model=MODEL, adapters=f"{MODEL}-m2r2", profile=get_profile("macbook"), num_prompts=2, max_tokens=24
    )
    ids = np.load(f"{MODEL}/heldout.npy")
    prompts = [ids[i * (ids.size // 2) :][:48] for i in range(2)]
    store, _ = open_store(config)
    run = BenchRun(config, store, prompts)
    measure(run, "resident", 100.0, None, "device")  # the reference tokens
    setup, rows = moe_rows.setup, []
    try:
        for budget in budgets:
            lru = measure(run, "lru", budget, None, "device")
            rows.append((budget, "on-demand LRU", lru, lru))
            for precision in PRECISIONS:
                moe_rows.setup = lambda *a, c=_planned(precision): c(*setup(*a), a[0])
                row = measure(run, "oracle", budget, None, "device")
                moe_rows.setup = setup
                rows.append((budget, f"{precision:.0%} precise, planned", row, lru))
                print(budget, precision, f"{row['tokens_per_s'] / lru['tokens_per_s']:.2f}x", flush=True)
    finally:
        moe_rows.setup = setup
    head = "| budget | predictor | device tokens/s | vs LRU | hit rate | loads/token | stall ms/token | same tokens |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for budget, label, row, lru in rows:
        lines.append(
            f"| {budget:g}% | {label} | {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / lru['tokens_per_s']:.2f}x "
            f"| {row['hit_rate']:.1%} | {row['loads_per_token']:.1f} | {row['stall_ms_per_token']:.1f} "
            f"| {'yes' if row['same_as_resident'] else 'NO'} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m experiments.moe_precision " + f"--budgets {args.budgets} --out {args.out}"
    atomic_write_text(args.out / "results.md", f"`{command}`\n\n" + "\n".join(lines) + "\n")
    _plot(rows, args.out / "precision.png")
    print("\n".join(lines))


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for budget in sorted({r[0] for r in rows}):
        pts = [
            (float(label.split("%")[0]) / 100, row["tokens_per_s"] / lru["tokens_per_s"])
            for b, label, row, lru in rows
            if b == budget and label != "on-demand LRU"
        ]
        ax.plot(*zip(*pts), marker="o", label=f"{budget:g}% of the experts")
    ax.axhline(1.3, color="grey", linestyle="--", linewidth=1, label="issue 40's gate (1.3x LRU)")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("predictor precision (share of named experts the layer uses)")
    ax.set_ylabel("device tokens/s vs on-demand LRU")
    ax.set_title("macbook device clock, 3 MoE layers of lead, through the planner")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
