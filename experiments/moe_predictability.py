"""How precisely can any predictor name a layer's experts a few MoE layers ahead on the bench's model? The gate
needs above 95% at 3 layers of lead; the lookahead maps reached 84-85% then (89.5% at 2 layers now). This measures
what the design change the last rounds named (a classifier on the top-k set, reading several earlier layers,
fitted on more routed text) would reach, before anyone builds it into the product.

    python -m experiments.moe_predictability [--model build/smollm2-moe] [--out DIR]

Teacher-forced routes of the all-resident model over the build's training ids (``train.npy``) and its held-out
ids (``heldout.npy``), at sampled target layers. Per target layer t and lead L, each predictor reads router inputs
of layers t-L and below and names t's top-k experts:

- ``router``: t's own router on layer t-L's input (pre-gating that far ahead);
- ``ridge``: the lookahead map (ridge regression to t's router logits from layer t-L's input, pulled towards the
  router, as moe/lookahead.py fits it);
- ``ridge, 3 layers``: the same from layers t-L, t-L-1 and t-L-2 side by side (and with a ridge 100x weaker);
- ``classifier``, ``classifier, 3 layers``: a two-layer MLP on layer t-L's input, or on all three, trained as a
  multi-label classifier of t's top-k set (binary cross-entropy per expert, AdamW).

Each is fitted on the first 16,384 training tokens (the lookahead maps' size) and on all 65,536 (``--sizes``).
The score is held-out recall of the top-k (= precision, as k are named). Figures depend only on the seed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import m2r2_mlx  # noqa: F401  (first: preloads OpenBLAS)
from m2r2_mlx.atomic import atomic_write_text
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.moe.blocks import moe_blocks, top_k
from m2r2_mlx.moe.lookahead import record_routes, ridge_towards

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from tqdm.auto import tqdm

LEADS = (1, 2, 3)
DEPTH = 3  # source layers a multi-layer predictor reads


def collect(lm, blocks: dict, ids: np.ndarray, seq_len: int = 128, batch: int = 8) -> dict[int, tuple]:
    """Every MoE layer's router inputs (float16) and logits over ``ids`` in rows of ``seq_len``."""
    rows = ids.reshape(-1)[: ids.size // seq_len * seq_len].astype(np.int32).reshape(-1, seq_len)
    xs, zs = {l: [] for l in blocks}, {l: [] for l in blocks}
    for b in tqdm(range(0, len(rows), batch), desc="routes", unit="batch"):
        for l, (x, z) in record_routes(lm.model, blocks, rows[b : b + batch]).items():
            xs[l].append(x.reshape(-1, x.shape[-1]).astype(np.float16))
            zs[l].append(z.reshape(-1, z.shape[-1]))
    return {l: (np.concatenate(xs[l]), np.concatenate(zs[l])) for l in blocks}


def recall(scores: np.ndarray, logits: np.ndarray, k: int) -> float:
    pick = np.argsort(-scores, -1)[:, :k]
    true = np.argsort(-logits, -1)[:, :k]
    return float(np.mean([len(set(p) & set(t)) / k for p, t in zip(pick, true)]))


def ridge(x: np.ndarray, z: np.ndarray, prior: np.ndarray, strengths=(1.0,)) -> list[np.ndarray]:
    """Weights (D+1, E) of ridge regression from x to z, pulled towards ``prior`` (scaled to the inputs' energy),
    one per strength."""
    x = np.concatenate([x.astype(np.float64), np.ones((len(x), 1))], 1)
    xtx, xtz = x.T @ x, x.T @ z
    return [ridge_towards(xtx, xtz, prior, strength) for strength in strengths]


def affine(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) @ w[:-1].astype(np.float32) + w[-1].astype(np.float32)


class Classifier(nn.Module):
    def __init__(self, dims: int, experts: int, hidden: int = 512):
        super().__init__()
        self.up, self.out = nn.Linear(dims, hidden), nn.Linear(hidden, experts)

    def __call__(self, x):
        return self.out(nn.gelu(self.up(x)))


def fit_classifier(x: np.ndarray, labels: np.ndarray, epochs: int = 6, batch: int = 512, seed: int = 0):
    """An MLP trained to say which experts are in the top-k set; returns a scorer over raw inputs."""
    mx.random.seed(seed)
    mean, std = x.mean(0, dtype=np.float64), x.std(0, dtype=np.float64) + 1e-4
    xn = mx.array(((x - mean) / std).astype(np.float32))
    y = mx.array(labels.astype(np.float32))
    model = Classifier(x.shape[1], labels.shape[1])
    opt = optim.AdamW(learning_rate=1e-3, weight_decay=0.01)

    def loss(m, xb, yb):
        return nn.losses.binary_cross_entropy(m(xb), yb, with_logits=True, reduction="mean")

    step = nn.value_and_grad(model, loss)
    order = np.random.default_rng(seed)
    for _ in range(epochs):
        for i in np.array_split(order.permutation(len(x)), max(len(x) // batch, 1)):
            idx = mx.array(i)
            _, grads = step(model, xn[idx], y[idx])
            opt.update(model, grads)
            mx.eval(model.parameters(), opt.state)
    return lambda a: np.array(model(mx.array(((a - mean) / std).astype(np.float32))))


def members(logits: np.ndarray, k: int) -> np.ndarray:
    out = np.zeros_like(logits, dtype=bool)
    np.put_along_axis(out, np.argsort(-logits, -1)[:, :k], True, -1)
    return out


def measure(blocks: dict, train: dict, held: dict, targets: list[int], sizes: list[int]) -> list[dict]:
    rows, layers = [], sorted(blocks)
    jobs = [(t, lead, n) for lead in LEADS for n in sizes for t in targets]
    for t, lead, n in tqdm(jobs, desc="predictors", unit="fit"):
        i = layers.index(t)
        srcs = [layers[i - lead - d] for d in range(DEPTH)]
        k, gate = top_k(blocks[t]), blocks[t].gate
        w_gate = np.array(gate.weight.astype(mx.float32)).T
        prior = np.concatenate([w_gate, np.zeros((1, w_gate.shape[1]))], 0)
        x1, z = train[srcs[0]][0][:n], train[t][1][:n]
        xh1, zh = held[srcs[0]][0], held[t][1]
        x3 = np.concatenate([train[s][0][:n] for s in srcs], 1)
        xh3 = np.concatenate([held[s][0] for s in srcs], 1)
        prior3 = np.concatenate([w_gate, np.zeros((x3.shape[1] - w_gate.shape[0] + 1, w_gate.shape[1]))], 0)
        (w1,), (w3, w3_weak) = ridge(x1, z, prior), ridge(x3, z, prior3, (1.0, 0.01))
        scores = {
            "router": xh1.astype(np.float32) @ w_gate,
            "ridge": affine(xh1, w1),
            "ridge, 3 layers": affine(xh3, w3),
            "ridge, 3 layers, ridge 0.01": affine(xh3, w3_weak),
            "classifier": fit_classifier(x1, members(z, k))(xh1),
            "classifier, 3 layers": fit_classifier(x3, members(z, k))(xh3),
        }
        for name, s in scores.items():
            rows.append({"target": t, "lead": lead, "tokens": n, "predictor": name, "recall": recall(s, zh, k)})
    return rows


def table(rows: list[dict]) -> str:
    names = list(dict.fromkeys(r["predictor"] for r in rows))
    head = "| lead | training tokens | " + " | ".join(names) + " |"
    lines = [head, "|" + "---|" * (len(names) + 2)]
    for lead in LEADS:
        for n in dict.fromkeys(r["tokens"] for r in rows):
            cells = []
            for name in names:
                v = [r["recall"] for r in rows if (r["lead"], r["tokens"], r["predictor"]) == (lead, n, name)]
                cells.append(f"{100 * np.mean(v):.1f}%")
            lines.append(f"| {lead} | {n:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.moe_predictability", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", type=Path, default=Path("build/smollm2-moe"))
    parser.add_argument("--targets", default="8,12,16,20,24,29", help="MoE layers predicted (comma-separated)")
    parser.add_argument("--sizes", default="16384,65536", help="training tokens each predictor is fitted on")
    parser.add_argument("--out", type=Path, default=Path("m2r2-bench-results/moe_predictability"))
    return parser


def main() -> None:
    args = build_parser().parse_args()

    def body() -> None:
        paths = [args.model / "train.npy", args.model / "heldout.npy"]
        for p in paths:
            if not p.is_file():
                raise M2R2Error(f"{p} not found; build the bench's model: python -m m2r2_bench.moe_bench_build")
        lm = load_model(str(args.model), tokenizer=False)
        blocks = dict(moe_blocks(lm.model))
        layers = sorted(blocks)
        targets = [int(t) for t in args.targets.split(",")]
        if any(t not in layers or layers.index(t) < max(LEADS) + DEPTH - 1 for t in targets):
            raise M2R2Error(f"--targets must be MoE layers from {layers[max(LEADS) + DEPTH - 1]} on")
        sizes = [int(n) for n in args.sizes.split(",")]
        train_ids, held_ids = (np.load(p) for p in paths)
        train, held = collect(lm, blocks, train_ids[: max(sizes)]), collect(lm, blocks, held_ids)
        rows = measure(blocks, train, held, targets, [min(n, len(train[targets[0]][1])) for n in sizes])
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out / "results.json", json.dumps(rows, indent=1))
        text = (
            f"Held-out top-{top_k(blocks[targets[0]])} recall (= precision) at MoE layers {targets}, their mean; "
            f"{len(held[targets[0]][1]):,} held-out tokens. `python -m experiments.moe_predictability`\n\n"
            + table(rows)
            + "\n"
        )
        atomic_write_text(args.out / "results.md", text)
        print(text)

    sys.exit(run_cli("moe_predictability", body))


if __name__ == "__main__":
    main()
