"""How an MoE model routes: load balance, routing entropy, expert reuse between tokens, predictability.

    python -m experiments.moe_routing --model build/tiny-olmoe --tokens build/olmoe-data/eval.npy

Per MoE layer, on held-out tokens: the share of routed picks each expert gets (max/mean:
1.0 is perfect balance), the mean per-token routing entropy as a fraction of log(E), how
often an expert picked for token t is picked again for token t+1 (the locality an LRU
cache lives on; k/E by chance), and the recall of next-layer pre-gating (layer l+1's
router applied to layer l's input: the baseline predictor). Writes a markdown table and a
PNG (expert load heat map, per-layer curves).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import m2r2_mlx  # noqa: F401  (fast BLAS before mlx)
from m2r2_mlx.atomic import atomic_save_figure, atomic_write_text
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.moe.blocks import moe_blocks, router, top_k

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class RecordingGate(nn.Module):
    """The block's router, unchanged, keeping its inputs and logits for analysis."""

    def __init__(self, gate: nn.Module):
        super().__init__()
        self.inner, self.inputs, self.logits = gate, [], []

    def __call__(self, x):
        out = self.inner(x)
        self.inputs.append(x)
        self.logits.append(out)
        return out


def routing_stats(model, tokens: np.ndarray, seq_len: int = 512, max_tokens: int = 16384) -> list[dict]:
    blocks = moe_blocks(model)
    if not blocks:
        raise M2R2Error("this model has no SwitchGLU mixture-of-experts layers to analyse")
    n = min(tokens.size // seq_len, max_tokens // seq_len)
    if n < 1:
        raise M2R2Error(f"routing statistics need at least {seq_len} tokens (--max-tokens and the token file)")
    gates = []
    for _, block in blocks:
        block.gate = RecordingGate(block.gate)
        gates.append(block.gate)
    try:
        for i in range(n):
            out = model(mx.array(tokens[i * seq_len : (i + 1) * seq_len][None].astype(np.int32)))
            mx.eval(out, [g.logits[-1] for g in gates], [g.inputs[-1] for g in gates])
    finally:
        for (_, block), gate in zip(blocks, gates):
            block.gate = gate.inner
    rows = []
    for j, ((layer, block), gate) in enumerate(zip(blocks, gates)):
        k = top_k(block)
        logits = np.concatenate([np.array(l, dtype=np.float32).reshape(-1, l.shape[-1]) for l in gate.logits])
        E = logits.shape[-1]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        picks = np.argpartition(-logits, k - 1, axis=-1)[:, :k]
        load_share = np.bincount(picks.ravel(), minlength=E) / picks.size
        entropy = -(probs * np.log(probs + 1e-12)).sum(-1).mean() / np.log(E)
        # reuse within each sequence: token t+1's picks that token t also picked
        per_seq = picks.reshape(n, seq_len, k)
        same = (per_seq[:, 1:, :, None] == per_seq[:, :-1, None, :]).any(-1).mean()
        row = dict(
            layer=layer,
            experts=E,
            k=k,
            load=load_share,
            max_over_mean=load_share.max() * E,
            cv=load_share.std() / load_share.mean(),
            entropy=float(entropy),
            reuse=float(same),
            chance=k / E,
        )
        if j + 1 < len(blocks):  # next-layer pre-gating recall
            x = mx.concatenate([a.reshape(-1, a.shape[-1]) for a in gate.inputs])
            pred = np.array(router(blocks[j + 1][1])(x))  # the routers are restored by now
            actual = np.concatenate([np.array(l).reshape(-1, l.shape[-1]) for l in gates[j + 1].logits])
            actual = np.argpartition(-actual, k - 1, axis=-1)[:, :k]
            row["pregate_recall"] = float((pred[:, :, None] == actual[:, None, :]).any(-1).mean())
        rows.append(row)
    return rows


def table(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| layer | max/mean load | load CV | routing entropy / log E | next-token reuse (chance) | pre-gating recall |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        pg = f"{r['pregate_recall']:.1%}" if "pregate_recall" in r else "n/a (last layer)"
        lines.append(
            f"| {r['layer']} | {r['max_over_mean']:.2f} | {r['cv']:.2f} | {r['entropy']:.2f} | "
            f"{r['reuse']:.1%} ({r['chance']:.1%}) | {pg} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw=dict(width_ratios=[1.6, 1]))
    loads = np.stack([r["load"] * r["experts"] for r in rows])
    im = a.imshow(loads, aspect="auto", cmap="viridis")
    a.set(
        xlabel="expert",
        ylabel="layer",
        title="expert load (share x E; 1 = even)",
        yticks=range(len(rows)),
        yticklabels=[r["layer"] for r in rows],
    )
    fig.colorbar(im, ax=a)
    layers = [r["layer"] for r in rows]
    b.plot(layers, [r["reuse"] for r in rows], "o-", label="next-token reuse")
    b.plot(layers, [r["chance"] for r in rows], "--", color="gray", label="reuse by chance (k/E)")
    b.plot(layers, [r["entropy"] for r in rows], "s-", label="routing entropy / log E")
    pg = [(r["layer"], r["pregate_recall"]) for r in rows if "pregate_recall" in r]
    b.plot(*zip(*pg), "^-", label="pre-gating recall")
    b.set(xlabel="layer", ylim=(0, 1.05), title="routing per layer")
    b.legend(fontsize=8)
    fig.tight_layout()
    atomic_save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.moe_routing", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="build/tiny-olmoe")
    ap.add_argument(
        "--tokens",
        type=Path,
        default=Path("build/olmoe-data/eval.npy"),
        help="held-out token ids (.npy) in the model's vocabulary",
    )
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--out", type=Path, default=Path("m2r2-bench-results/moe_routing"))
    return ap


def _main() -> int:
    args = build_parser().parse_args()
    if not args.tokens.is_file():
        raise M2R2Error(
            f"{args.tokens} not found; build it with: python -m m2r2_tools.tiny_olmoe data -o build/olmoe-data"
        )
    lm = load_model(args.model)
    tokens = np.load(args.tokens)
    rows = routing_stats(lm.model, tokens, max_tokens=args.max_tokens)
    used = min(tokens.size // 512, args.max_tokens // 512) * 512
    text = table(rows, f"Routing of `{args.model}` on {used:,} held-out tokens.")
    print(text)
    atomic_write_text(args.out / "moe_routing_table.md", text)
    plot(rows, args.out / "moe_routing.png")
    return 0


def main() -> None:
    sys.exit(run_cli("moe_routing", _main))


if __name__ == "__main__":
    main()
