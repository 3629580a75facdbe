"""When may a token leave at gate j? ARLA, and the baselines it is judged against.

- confidence: max-softmax of the gate's exit distribution (free);
- linear probe: one logistic regression per gate on the normed fast-stream state;
- ARLA (arla.py): attention over the token's latent trajectory z_1..z_j (with the exit
  distribution's own statistics in each latent, where the head is built to read them).

Label at (token, gate j) = "the exit token at gate j equals the full model's token".
The frozen work (slow pass, fast stream, exit heads) runs once per row and is cached
as features; ARLA and the probes then train on those features in seconds, so the
second stage of m2r2-train costs about one evaluation pass over its rows.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from ..core.arla import exit_stats
from ..models.base_model import SubsetHead


def collect_features(
    m2r2, rows: np.ndarray, batch_size: int = 4, progress=None, exit_ids=None, mask: np.ndarray | None = None
) -> dict:
    """Per token and gate: fast-stream state h (N, J, D), exit statistics (N, J, 3: confidence, margin,
    entropy), confidence (N, J), the exit token (N, J) and label (N, J). ``exit_ids``: score the exits over these
    tokens only (as early exit does with ``m2r2.exit_head``); the label still asks for the full model's token.
    ``mask`` (rows' shape): the tokens to keep (the loss mask: answers and text, as early exit meets them)."""
    parts = m2r2.parts
    subset = None if exit_ids is None else SubsetHead(parts, exit_ids)  # rows gathered once, not per batch
    hs, stats, labels, tokens = [], [], [], []
    for i in range(0, len(rows), batch_size):
        ids = mx.array(rows[i : i + batch_size])
        states, final, kv = m2r2.slow_pass(ids)
        target = parts.head(final).argmax(-1)
        fast = m2r2.fast_states(states, kv)
        h_b, s_b, l_b, t_b = [], [], [], []
        for h in fast:
            logits = parts.head(h) if subset is None else subset(h)
            s_b.append(exit_stats(logits))
            token = logits.argmax(-1) if subset is None else subset.ids[logits.argmax(-1)]
            l_b.append(token == target)
            t_b.append(token)
            h_b.append(h)
        mx.eval(h_b, s_b, l_b, t_b)
        D = h_b[0].shape[-1]
        keep = slice(None) if mask is None else mask[i : i + batch_size].ravel()
        hs.append(np.stack([np.array(h).reshape(-1, D) for h in h_b], axis=1)[keep])
        stats.append(np.stack([np.array(x).reshape(-1, x.shape[-1]) for x in s_b], axis=1)[keep])
        labels.append(np.stack([np.array(lb).ravel() for lb in l_b], axis=1)[keep])
        tokens.append(np.stack([np.array(t).ravel() for t in t_b], axis=1)[keep])
        if progress:
            progress(len(ids))
    stats = np.concatenate(stats)
    return {
        "h": np.concatenate(hs),
        "stats": stats,
        "confidence": stats[..., 0],
        "label": np.concatenate(labels),
        "token": np.concatenate(tokens),
    }


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U with tied ranks averaged); nan if one class is absent."""
    labels = labels.astype(bool)
    pos, neg = labels.sum(), (~labels).sum()
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):  # average ranks over ties
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


class LinearProbes(nn.Module):
    """One logistic regression per gate on the normed fast-stream state (the simple learned baseline)."""

    def __init__(self, dims: int, num_gates: int):
        super().__init__()
        self.norm = nn.RMSNorm(dims)
        self.heads = [nn.Linear(dims, 1) for _ in range(num_gates)]

    def __call__(self, h: mx.array) -> mx.array:  # (N, J, D) -> logits (N, J)
        x = self.norm(h)
        return mx.concatenate([head(x[:, j]) for j, head in enumerate(self.heads)], axis=-1)


def arla_logits(arla, h: mx.array, stats: mx.array) -> mx.array:
    """ARLA's exit logit at every gate of (N, J, D) fast-stream states with their (N, J, 3) exit statistics."""
    reads = getattr(arla, "exit_stats", False)
    zs = mx.stack(
        [arla.latent(h[:, j], j, stats[:, j]) if reads else arla.latent(h[:, j], j) for j in range(h.shape[1])], axis=1
    )
    return arla.logits_all(zs)


def fit(
    model,
    forward,
    inputs: list[np.ndarray],
    y: np.ndarray,
    steps: int = 400,
    batch: int = 512,
    lr: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    """Binary cross-entropy on every (token, gate); ``forward(model, *inputs)``; returns the loss curve."""
    rng = np.random.default_rng(seed)
    opt = optim.AdamW(learning_rate=optim.cosine_decay(lr, steps, lr * 0.05), weight_decay=0.01)

    def loss_fn(m, yb, *xb):
        return nn.losses.binary_cross_entropy(forward(m, *xb), yb, with_logits=True, reduction="mean")

    step = nn.value_and_grad(model, loss_fn)
    losses = []
    for _ in range(steps):
        idx = rng.integers(0, len(y), min(batch, len(y)))
        loss, grads = step(model, mx.array(y[idx].astype(np.float32)), *(mx.array(x[idx]) for x in inputs))
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        losses.append(loss.item())
    return losses


def predict(forward, model, inputs: list[np.ndarray], chunk: int = 4096) -> np.ndarray:
    n = len(inputs[0])
    out = [
        np.array(mx.sigmoid(forward(model, *(mx.array(x[i : i + chunk]) for x in inputs)))) for i in range(0, n, chunk)
    ]
    return np.concatenate(out)


def train_exit_decisions(m2r2, train_feats: dict, eval_feats: dict, steps: int = 400, seed: int = 0) -> dict:
    """Train ARLA (kept in ``m2r2.arla``) and the per-gate probes; ROC AUC of all three on held-out tokens."""
    mx.random.seed(seed)
    probe = lambda m, hb: m(hb)  # noqa: E731
    probes = LinearProbes(train_feats["h"].shape[-1], train_feats["h"].shape[1])
    fit(probes, probe, [train_feats["h"]], train_feats["label"], steps, seed=seed)
    arla_in = lambda f: [f["h"], f["stats"]]  # noqa: E731
    arla_curve = fit(m2r2.arla, arla_logits, arla_in(train_feats), train_feats["label"], steps, seed=seed)
    scores = {
        "confidence": eval_feats["confidence"],
        "linear probe": predict(probe, probes, [eval_feats["h"]]),
        "arla": predict(arla_logits, m2r2.arla, arla_in(eval_feats)),
    }
    y = eval_feats["label"]
    return {
        "gates": list(m2r2.config.gates),
        "tokens": int(len(y)),
        "positive_rate": y.mean(0).round(4).tolist(),
        "auc": {name: [round(roc_auc(s[:, j], y[:, j]), 4) for j in range(y.shape[1])] for name, s in scores.items()},
        "arla_loss": [round(arla_curve[0], 4), round(arla_curve[-1], 4)],
    }
