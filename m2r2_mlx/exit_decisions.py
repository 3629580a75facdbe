"""When may a token leave at gate j? ARLA, and the baselines it is judged against.

- confidence: max-softmax of the gate's exit distribution (free);
- linear probe: one logistic regression per gate on the normed fast-stream state;
- ARLA (arla.py): attention over the token's latent trajectory z_1..z_j.

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


def collect_features(m2r2, rows: np.ndarray, batch_size: int = 4, progress=None) -> dict:
    """Per token and gate: fast-stream state (N, J, D), exit confidence (N, J) and label (N, J)."""
    parts = m2r2.parts
    hs, confs, labels = [], [], []
    for i in range(0, len(rows), batch_size):
        ids = mx.array(rows[i : i + batch_size])
        states, final, kv = m2r2.slow_pass(ids)
        target = parts.head(final).argmax(-1)
        fast = m2r2.fast_states(states, kv)
        h_b, c_b, l_b = [], [], []
        for h in fast:
            probs = mx.softmax(parts.head(h).astype(mx.float32), axis=-1)
            c_b.append(probs.max(-1))
            l_b.append(probs.argmax(-1) == target)
            h_b.append(h)
        mx.eval(h_b, c_b, l_b)
        D = h_b[0].shape[-1]
        hs.append(np.stack([np.array(h).reshape(-1, D) for h in h_b], axis=1))
        confs.append(np.stack([np.array(c).ravel() for c in c_b], axis=1))
        labels.append(np.stack([np.array(lb).ravel() for lb in l_b], axis=1))
        if progress:
            progress(len(ids))
    return {"h": np.concatenate(hs), "confidence": np.concatenate(confs), "label": np.concatenate(labels)}


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


def arla_logits(arla, h: mx.array) -> mx.array:
    """ARLA's exit logit at every gate of (N, J, D) fast-stream states."""
    zs = mx.stack([arla.latent(h[:, j], j) for j in range(h.shape[1])], axis=1)
    return arla.logits_all(zs)


def fit(model, forward, h: np.ndarray, y: np.ndarray, steps: int = 400, batch: int = 512, lr: float = 3e-3,
        seed: int = 0) -> list[float]:
    """Binary cross-entropy on every (token, gate); returns the loss curve."""
    rng = np.random.default_rng(seed)
    opt = optim.AdamW(learning_rate=optim.cosine_decay(lr, steps, lr * 0.05), weight_decay=0.01)

    def loss_fn(m, hb, yb):
        return nn.losses.binary_cross_entropy(forward(m, hb), yb, with_logits=True, reduction="mean")

    step = nn.value_and_grad(model, loss_fn)
    losses = []
    for _ in range(steps):
        idx = rng.integers(0, len(h), min(batch, len(h)))
        loss, grads = step(model, mx.array(h[idx]), mx.array(y[idx].astype(np.float32)))
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        losses.append(loss.item())
    return losses


def predict(forward, model, h: np.ndarray, chunk: int = 4096) -> np.ndarray:
    out = [np.array(mx.sigmoid(forward(model, mx.array(h[i : i + chunk])))) for i in range(0, len(h), chunk)]
    return np.concatenate(out)


def train_exit_decisions(m2r2, train_feats: dict, eval_feats: dict, steps: int = 400, seed: int = 0) -> dict:
    """Train ARLA (kept in ``m2r2.arla``) and the per-gate probes; ROC AUC of all three on held-out tokens."""
    mx.random.seed(seed)
    probes = LinearProbes(train_feats["h"].shape[-1], train_feats["h"].shape[1])
    fit(probes, lambda m, hb: m(hb), train_feats["h"], train_feats["label"], steps, seed=seed)
    arla_curve = fit(m2r2.arla, arla_logits, train_feats["h"], train_feats["label"], steps, seed=seed)
    scores = {
        "confidence": eval_feats["confidence"],
        "linear probe": predict(lambda m, hb: m(hb), probes, eval_feats["h"]),
        "arla": predict(arla_logits, m2r2.arla, eval_feats["h"]),
    }
    y = eval_feats["label"]
    return {
        "gates": list(m2r2.config.gates),
        "tokens": int(len(y)),
        "positive_rate": y.mean(0).round(4).tolist(),
        "auc": {name: [round(roc_auc(s[:, j], y[:, j]), 4) for j in range(y.shape[1])] for name, s in scores.items()},
        "arla_loss": [round(arla_curve[0], 4), round(arla_curve[-1], 4)],
    }


class ARLARule:
    """Early exit's rule from ARLA: p_exit at gate j from the latents of the gates this token has passed."""

    def __init__(self, arla):
        self.arla = arla

    def __call__(self, logits: mx.array, h_exit: mx.array, gate_index: int, trail: list) -> float:
        trail.append(self.arla.latent(h_exit.reshape(-1), gate_index))
        return mx.sigmoid(self.arla(mx.stack(trail))).item()
