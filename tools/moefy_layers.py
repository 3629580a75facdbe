"""MoEfication of one dense llama layer (moefy builds the model from these, layer after layer): each FFN neuron's
contribution per token, neurons grouped into equal experts by co-activation, a linear router per layer, and the
experts' down projections refitted so the routed layer tracks the dense model's residual stream."""

from __future__ import annotations

import m2r2_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx.core on Linux)

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx_lm.models.base import create_attention_mask


def layer_pass(layer, h: mx.array, batch: int) -> tuple[mx.array, np.ndarray, np.ndarray]:
    """The dense layer over all sequences: (next residual, FFN inputs (N, D), neuron contributions (N, H))."""
    w_norm = mx.linalg.norm(layer.mlp.down_proj.weight, axis=0)  # each neuron's output direction's length
    outs, xs, masses = [], [], []
    for b in range(0, h.shape[0], batch):
        hb = h[b : b + batch]
        hb = hb + layer.self_attn(layer.input_layernorm(hb), create_attention_mask(hb, None))
        x = layer.post_attention_layernorm(hb)
        a = nn.silu(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x)
        out = hb + layer.mlp.down_proj(a)
        mass = mx.abs(a) * w_norm
        mx.eval(out, x, mass)
        outs.append(out)
        xs.append(np.array(x).reshape(-1, x.shape[-1]))
        masses.append(np.array(mass).reshape(-1, mass.shape[-1]))
    return mx.concatenate(outs), np.concatenate(xs), np.concatenate(masses)


def balanced_kmeans(features: np.ndarray, k: int, iters: int = 15, seed: int = 0) -> np.ndarray:
    """Cluster ids (rows of ``features``) into ``k`` clusters of exactly n/k rows each.

    Spherical k-means (cosine similarity) whose assignment step is greedy under a capacity:
    the most similar (row, centroid) pairs are taken first, a centroid stops taking rows when
    full. Rows that fire together (similar patterns over tokens) end up in one cluster.
    """
    n = features.shape[0]
    cap = n // k
    f = features / (np.linalg.norm(features, axis=1, keepdims=True) + 1e-8)
    rng = np.random.default_rng(seed)
    centroids = f[rng.choice(n, k, replace=False)]
    assign = np.zeros(n, np.int64)
    for _ in range(iters):
        sim = f @ centroids.T
        order = np.argsort(-sim, axis=None)
        assign[:] = -1
        count = np.zeros(k, np.int64)
        for flat in order:
            row, c = divmod(int(flat), k)
            if assign[row] < 0 and count[c] < cap:
                assign[row] = c
                count[c] += 1
        new = np.stack([f[assign == c].mean(0) for c in range(k)])
        new /= np.linalg.norm(new, axis=1, keepdims=True) + 1e-8
        if np.allclose(new, centroids):
            break
        centroids = new
    return assign


def train_router(x: np.ndarray, group_mass: np.ndarray, steps: int, seed: int = 0) -> mx.array:
    """A linear router (E, D): softmax cross-entropy towards each token's share of mass per group."""
    mx.random.seed(seed)
    router = nn.Linear(x.shape[1], group_mass.shape[1], bias=False)
    router.weight = mx.zeros_like(router.weight)
    xs = mx.array(x)
    target = mx.array(group_mass / group_mass.sum(1, keepdims=True))
    opt = optim.Adam(learning_rate=1e-2)

    def loss_fn(r):
        return -(target * nn.log_softmax(r(xs), axis=-1)).sum(-1).mean()

    step = nn.value_and_grad(router, loss_fn)
    for _ in range(steps):
        _, grads = step(router)
        opt.update(router, grads)
        mx.eval(router.parameters(), opt.state)
    return router.weight


def routed_share(x: np.ndarray, group_mass: np.ndarray, router: mx.array, k: int) -> dict:
    """How well the router's top-k matches the groups with the most mass (per token, averaged)."""
    picked = np.argpartition(-np.array(mx.array(x) @ router.T), k - 1, axis=1)[:, :k]
    best = np.argpartition(-group_mass, k - 1, axis=1)[:, :k]
    total = group_mass.sum(1)
    got = np.take_along_axis(group_mass, picked, 1).sum(1)
    top = np.take_along_axis(group_mass, best, 1).sum(1)
    recall = np.mean([len(set(p) & set(b)) / k for p, b in zip(picked, best)])
    return {
        "router_mass": float((got / total).mean()),
        "oracle_mass": float((top / total).mean()),
        "router_recall_of_top_groups": float(recall),
    }


def routed_pass(layer, h: mx.array, router: mx.array, assign: np.ndarray, k: int, batch: int):
    """The MoEfied layer's own stream up to its FFN: (state after attention (N, D), routed activations (N, H):
    each neuron's silu(g x) * (u x) where its expert is among the token's top-k, else 0)."""
    mids, acts = [], []
    member = mx.array(assign)
    for b in range(0, h.shape[0], batch):
        hb = h[b : b + batch]
        hb = hb + layer.self_attn(layer.input_layernorm(hb), create_attention_mask(hb, None))
        x = layer.post_attention_layernorm(hb)
        top = mx.argpartition(-(x @ router.T), kth=k - 1, axis=-1)[..., :k]  # (B, T, k)
        chosen = (top[..., None] == member).any(axis=-2)  # (B, T, H): the neuron's expert was picked
        a = nn.silu(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x) * chosen
        mx.eval(hb, a)
        mids.append(np.array(hb).reshape(-1, hb.shape[-1]))
        acts.append(np.array(a).reshape(-1, a.shape[-1]))
    return np.concatenate(mids), np.concatenate(acts)


def refit_down(acts: np.ndarray, target: np.ndarray, down_t: np.ndarray, ridge: float) -> np.ndarray:
    """Down projections (H, D) so that the routed activations reproduce ``target``: ridge regression pulled
    towards the dense weights, ``min |A W - Y|^2 + lam |W - W_dense|^2`` with lam = ridge x mean diag(A^T A)."""
    a = acts.astype(np.float64)
    gram = a.T @ a
    lam = ridge * np.trace(gram) / len(gram)
    rhs = a.T @ target.astype(np.float64) + lam * down_t
    return np.linalg.solve(gram + lam * np.eye(len(gram)), rhs).astype(np.float32)


def moefy_layer(
    layer, x: np.ndarray, mass: np.ndarray, experts: int, k: int, router_steps: int, cluster_tokens: int, seed: int
) -> tuple[dict[str, mx.array], dict, np.ndarray]:
    """Experts and router of one layer (weights named as in MoefiedMLP), its build statistics, the grouping."""
    rows = np.random.default_rng(seed).choice(len(mass), min(cluster_tokens, len(mass)), replace=False)
    assign = balanced_kmeans(mass[rows].T, experts, seed=seed)
    groups = [np.flatnonzero(assign == e) for e in range(experts)]
    onehot = np.zeros((mass.shape[1], experts), np.float32)
    onehot[np.arange(mass.shape[1]), assign] = 1
    group_mass = mass @ onehot
    router = train_router(x, group_mass, router_steps, seed)
    idx = mx.array(np.stack(groups))  # (E, H/E) neuron ids per expert
    g, u, d = layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight, layer.mlp.down_proj.weight
    weights = {
        "gate.weight": router,
        "switch_mlp.gate_proj.weight": g[idx],  # (E, H/E, D)
        "switch_mlp.up_proj.weight": u[idx],
        "switch_mlp.down_proj.weight": d.T[idx].transpose(0, 2, 1),  # (E, D, H/E)
    }
    return weights, routed_share(x, group_mass, router, k), assign
