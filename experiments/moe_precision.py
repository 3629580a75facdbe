"""How precise a predictor the MoE gate needs: the true routes with a share of each layer's experts swapped for
wrong ones, through the planner, on the macbook device clock (docs/moe_bench.md, "What a predictor must reach").

    python -m experiments.moe_precision [--budgets 25,37.5,50] [--lead 3] [--precisions 0.6,...,1] [--out DIR]

A noisy oracle knows each (step, layer)'s true experts ``--lead`` MoE layers ahead (into the next token's first
layers) and names each one with probability ``precision``, else a wrong expert in its place (seeded per step and
layer, so every run and every request for a layer see the same guess). It costs nothing, as the lookahead maps cost
about one router matmul a layer. Rows: on-demand LRU, then each precision through the planner (not governed). Two
held-out prompts, 23 decode tokens each, the bench's model (build/smollm2-moe); the same figures on every run.
Writes results.md and precision.png under --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from m2r2_mlx.atomic import atomic_write_text
from m2r2_mlx.moe import Oracle
from m2r2_mlx.moe.planner import PlannerConfig, PrefetchPlanner

import numpy as np

from experiments.moe_planner_gap import measure_changed, short_run

LEAD = 3
PRECISIONS = (0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0)


class NoisyOracle(Oracle):
    """The true routes, each expert swapped for a wrong one with probability 1 - ``precision``."""

    def __init__(self, trace, precision: float, lookahead: int = LEAD, seed: int = 0):
        super().__init__(trace, lookahead)
        self.precision, self.seed = precision, seed

    def routes(self, step: int, layer: int) -> list[int]:
        true = super().routes(step, layer)
        rng = np.random.default_rng((self.seed, step, layer))
        wrong = [e for e in rng.permutation(self.cache.num_experts(layer)).tolist() if e not in true]
        assert len(wrong) >= len(true), "a wrong expert for every true one needs top-k <= experts / 2"
        return [e if rng.random() < self.precision else wrong.pop() for e in true]


def _planned(precision: float, lead: int):
    def change(model, cache, predictor, run):
        predictor.detach()
        PrefetchPlanner(PlannerConfig(governed=False)).attach(cache)
        return model, cache, NoisyOracle(run.traces[0], precision, lead).attach(cache)

    return change


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="25,37.5,50")
    parser.add_argument("--lead", type=int, default=LEAD, help="MoE layers between a prediction and its layer")
    parser.add_argument("--precisions", default=",".join(f"{p:g}" for p in PRECISIONS))
    parser.add_argument("--out", type=Path, default=Path("docs/moe_precision"))
    args = parser.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    precisions = [float(p) for p in args.precisions.split(",")]
    run, rows = short_run(), []
    for budget in budgets:
        lru = measure_changed(run, "lru", budget)
        rows.append((budget, None, lru, lru))
        for precision in precisions:
            row = measure_changed(run, "oracle", budget, _planned(precision, args.lead))
            rows.append((budget, precision, row, lru))
            print(budget, precision, f"{row['tokens_per_s'] / lru['tokens_per_s']:.2f}x", flush=True)
    head = "| budget | predictor | device tokens/s | vs LRU | hit rate | loads/token | stall ms/token | same tokens |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for budget, precision, row, lru in rows:
        label = "on-demand LRU" if precision is None else f"{precision:.0%} precise, planned"
        lines.append(
            f"| {budget:g}% | {label} | {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / lru['tokens_per_s']:.2f}x "
            f"| {row['hit_rate']:.1%} | {row['loads_per_token']:.1f} | {row['stall_ms_per_token']:.1f} "
            f"| {'yes' if row['same_as_resident'] else 'NO'} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    command = (
        f"python -m experiments.moe_precision --budgets {args.budgets} --lead {args.lead} "
        f"--precisions {args.precisions} --out {args.out}"
    )
    atomic_write_text(args.out / "results.md", f"`{command}`\n\n" + "\n".join(lines) + "\n")
    _plot(rows, args.out / "precision.png", args.lead)
    print("\n".join(lines))


def _plot(rows, path: Path, lead: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for budget in sorted({r[0] for r in rows}):
        pts = [
            (precision, row["tokens_per_s"] / lru["tokens_per_s"])
            for b, precision, row, lru in rows
            if b == budget and precision is not None
        ]
        ax.plot(*zip(*pts), marker="o", label=f"{budget:g}% of the experts")
    ax.axhline(1.3, color="grey", linestyle="--", linewidth=1, label="issue 40's gate (1.3x LRU)")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("predictor precision (share of named experts the layer uses)")
    ax.set_ylabel("device tokens/s vs on-demand LRU")
    ax.set_title(f"macbook device clock, {lead} MoE layer(s) of lead, through the planner")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
