"""MoEfication: split a dense llama's FFNs into experts with a router, on this CPU in minutes.

    python -m m2r2_mlx.moe.moefy -o build/smollm2-moe            # SmolLM2-135M: 30 layers x 16 experts, top-4

Layer by layer on the dense model's own residual stream, over a package corpus (the tiny OLMoE's:
Shakespeare, fortunes, the Python docs):

1. collect each FFN neuron's contribution per token, |silu(g_i x) * (u_i x)| * ||down[:, i]||;
2. group the neurons into E equal experts by co-activation: balanced spherical k-means on those
   contribution patterns (neurons that fire on the same tokens share an expert);
3. train a linear router per layer (softmax cross-entropy towards each token's activation mass
   per group), so its top-k names the groups that carry the most of the FFN's output.

The result is a model folder of ``model_type`` moefied_llama (m2r2_mlx/models/moefied_llama.py):
the dense weights, each FFN cut into experts stacked in a SwitchGLU, a router beside it. No
weight is fine-tuned; with all experts chosen it is the dense model. Next to it, held-out token
ids (``heldout.npy``), the build record (``moefy.json``: quality beside the dense model, router
recall per layer) and, with ``--adapters``, an M2R2 adapters folder re-keyed to the new model
(the dense model's adapters: attention and every other base weight are unchanged).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

import m2r2_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx.core on Linux)

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from tqdm.auto import tqdm

from ..atomic import atomic_folder, atomic_save_npy, atomic_write_text
from ..core.config import M2R2Config
from ..core.integrity import record_hashes
from ..errors import M2R2Error, run_cli
from ..models.identity import config_hash
from ..models.moefied_llama import MODEL_TYPE
from ..models.registry import load_model
from ..training.data import read_text_files
from .tiny_olmoe import corpus_documents

PROG = "python -m m2r2_mlx.moe.moefy"
PACKAGED_ADAPTERS = Path(m2r2_mlx.__file__).parent / "trained" / "smollm2"
COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)


# ---------------------------------------------------------------- data
def text_documents(paths: list[str]) -> list[str]:
    """Documents from plain text files: each file's paragraphs (split at blank lines), so a held-out
    set can be whole paragraphs even from a single file."""
    return [d for text in read_text_files(paths) for d in re.split(r"\n\s*\n", text) if d.strip()]


def corpus_ids(
    tokenizer, train_tokens: int, heldout_tokens: int, seq_len: int, seed: int = 0, docs: list[str] | None = None
):
    """(train, held-out) token ids, (n, seq_len) each, from whole documents (default: the package
    corpus) in a seeded order; held-out documents are never in the training set."""
    docs = corpus_documents() if docs is None else docs
    order = np.random.default_rng(seed).permutation(len(docs))
    sets, want = [[], []], [train_tokens, heldout_tokens]
    which, have = 1, 0  # held-out first: its documents are then the same whatever --tokens is
    for d in order:
        ids = tokenizer.encode(docs[d])
        sets[which] += ids
        if len(sets[which]) >= want[which]:
            if which == 0:
                break
            which = 0
        have += 1
    if len(sets[0]) < train_tokens:
        raise M2R2Error(
            f"the corpus holds fewer than {train_tokens + heldout_tokens} tokens; "
            "lower --tokens and --heldout-tokens, or give more --text"
        )
    return tuple(np.array(s[: (w // seq_len) * seq_len], np.int32).reshape(-1, seq_len) for s, w in zip(sets, want))


# ---------------------------------------------------------------- one layer
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


# ---------------------------------------------------------------- quality
def quality(model, ids: np.ndarray, batch: int = 8) -> tuple[float, np.ndarray]:
    """(perplexity, greedy next-token ids (n, T-1)) on held-out sequences."""
    nll, count, greedy = 0.0, 0, []
    for b in range(0, len(ids), batch):
        x = mx.array(ids[b : b + batch])
        logits = model(x[:, :-1]).astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll -= float(mx.take_along_axis(lp, x[:, 1:, None], axis=-1).sum())
        count += x[:, 1:].size
        greedy.append(np.array(mx.argmax(logits, axis=-1)))
    return float(np.exp(nll / count)), np.concatenate(greedy)


# ---------------------------------------------------------------- the build
def build(args) -> dict:
    out = Path(args.out).expanduser()
    for folder in [out] + ([Path(args.adapters_out)] if args.adapters else []):
        if folder.exists() and not args.force:
            raise M2R2Error(f"{folder} already exists; pass --force to replace it")
    if args.experts < 2 or not 1 <= args.top_k <= args.experts:
        raise M2R2Error(
            f"--experts must be at least 2 and --top-k between 1 and the number of experts "
            f"(got {args.experts} and {args.top_k})"
        )
    start = time.perf_counter()
    dense = load_model(args.model)
    cfg = dict(dense.config)
    if cfg.get("model_type") != "llama":
        raise M2R2Error(
            f"MoEfication takes a dense llama-family model (SmolLM2); {dense.name} is {cfg.get('model_type')!r}"
        )
    hidden = cfg["intermediate_size"]
    if hidden % args.experts:
        raise M2R2Error(f"--experts {args.experts} does not divide the FFN width {hidden}; pick a divisor")
    layers = dense.model.model.layers
    n_layers = min(args.layers or len(layers), len(layers))
    docs = text_documents(args.text) if args.text else None
    train, heldout = corpus_ids(dense.tokenizer, args.tokens, args.heldout_tokens, args.seq_len, args.seed, docs)

    weights = {
        k: v
        for k, v in tree_flatten(dense.model.parameters())
        if not (k.startswith("model.layers.") and (int(k.split(".")[2]) >= n_layers or ".mlp." in k))
    }
    h = dense.model.model.embed_tokens(mx.array(train))
    h_moe = h  # the MoEfied model's own stream: down projections are refitted to pull it back to the dense one
    per_layer = []
    for i in tqdm(range(n_layers), desc="moefy", unit="layer"):
        h, x, mass = layer_pass(layers[i], h, args.batch)
        w, st, assign = moefy_layer(
            layers[i], x, mass, args.experts, args.top_k, args.router_steps, args.cluster_tokens, args.seed + i
        )
        mid, acts = routed_pass(layers[i], h_moe, w["gate.weight"], assign, args.top_k, args.batch)
        target = np.array(h).reshape(mid.shape) - mid
        down_t = np.array(layers[i].mlp.down_proj.weight).T  # (H, D)
        if args.refit:
            down_t = refit_down(acts, target, down_t, args.ridge)
            idx = np.stack([np.flatnonzero(assign == e) for e in range(args.experts)])
            w["switch_mlp.down_proj.weight"] = mx.array(down_t[idx].transpose(0, 2, 1))
        ffn = acts @ down_t
        st["ffn_error"] = float(np.linalg.norm(target - ffn, axis=1).mean() / np.linalg.norm(target, axis=1).mean())
        h_moe = mx.array((mid + ffn).reshape(h.shape))
        weights.update({f"model.layers.{i}.mlp.{k}": v for k, v in w.items()})
        per_layer.append({"layer": i, **st})
    build_s = time.perf_counter() - start

    new_cfg = {
        **cfg,
        "model_type": MODEL_TYPE,
        "architectures": ["MoefiedLlamaForCausalLM"],
        "num_hidden_layers": n_layers,
        "num_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "moefied_from": {
            "model": dense.name,
            "config_hash": config_hash(cfg),
            "corpus_tokens": train.size,
            "method": "balanced k-means on neuron contributions; linear router",
        },
    }
    record = {
        "build_s": build_s,
        "train_tokens": int(train.size),
        "heldout_tokens": int(heldout.size),
        "experts": args.experts,
        "top_k": args.top_k,
        "layers": per_layer,
    }
    with atomic_folder(out) as tmp:
        for name in COPIED:
            if (dense.path / name).is_file():
                shutil.copy(dense.path / name, tmp / name)
        atomic_write_text(tmp / "config.json", json.dumps(new_cfg, indent=1))
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        atomic_save_npy(tmp / "heldout.npy", heldout.reshape(-1))
        if not args.no_eval:
            record["quality"] = compare(dense, tmp, heldout, n_layers)
        atomic_write_text(tmp / "moefy.json", json.dumps(record, indent=1))
    if args.adapters:
        rekey_adapters(Path(args.adapters), Path(args.adapters_out), out, new_cfg)
    record["total_s"] = time.perf_counter() - start
    return record


def compare(dense, folder: Path, heldout: np.ndarray, n_layers: int) -> dict:
    """Held-out perplexity of both models and how often their greedy next tokens agree."""
    del dense.model.model.layers[n_layers:]  # a slice (--layers) is compared with the same slice of the dense model
    ppl_dense, g_dense = quality(dense.model, heldout)
    moe = load_model(str(folder), tokenizer=False).model
    ppl_moe, g_moe = quality(moe, heldout)
    return {"dense_ppl": ppl_dense, "moe_ppl": ppl_moe, "greedy_agreement": float((g_dense == g_moe).mean())}


def rekey_adapters(src: Path, dest: Path, model_folder: Path, model_cfg: dict) -> None:
    """The dense model's M2R2 adapters, recorded as made for the MoEfied model (same attention, residual)."""
    cfg = M2R2Config.load(src)
    if cfg.num_layers != model_cfg["num_hidden_layers"]:
        raise M2R2Error(
            f"adapters in {src} are for {cfg.num_layers} layers, the MoEfied model has "
            f"{model_cfg['num_hidden_layers']}; drop --adapters or --layers"
        )
    cfg.base_model = str(model_folder)
    cfg.base_config_hash = config_hash(model_cfg)
    with atomic_folder(dest) as tmp:
        for f in src.iterdir():
            if f.is_file() and f.name != "m2r2_config.json":
                shutil.copy(f, tmp / f.name)
        cfg.save(tmp)
        record_hashes(tmp)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="a dense llama-family model (alias, repo id or folder)")
    p.add_argument("-o", "--out", required=True, help="model folder to write")
    p.add_argument("--experts", type=int, default=16, help="experts per layer (must divide the FFN width)")
    p.add_argument("--top-k", type=int, default=4, help="experts per token")
    p.add_argument("--layers", type=int, default=None, help="MoEfy only the first N layers (a slice, for tests)")
    p.add_argument(
        "--text",
        nargs="+",
        default=None,
        metavar="FILE",
        help="plain text files to learn from (default: the package corpus, see docs/moe_bench.md)",
    )
    p.add_argument("--tokens", type=int, default=16384, help="corpus tokens the grouping and routers learn from")
    p.add_argument("--heldout-tokens", type=int, default=4096, help="held-out tokens for the quality check")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="sequences per forward")
    p.add_argument("--cluster-tokens", type=int, default=4096, help="tokens whose activations group the neurons")
    p.add_argument("--router-steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-refit",
        dest="refit",
        action="store_false",
        help="keep the dense down projections (default: refit them so the routed experts track the "
        "dense model's residual stream)",
    )
    p.add_argument("--ridge", type=float, default=0.05, help="refit: pull towards the dense weights")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out comparison with the dense model")
    p.add_argument(
        "--adapters",
        nargs="?",
        const=str(PACKAGED_ADAPTERS),
        default=None,
        help="also write M2R2 adapters re-keyed to the new model (default: the packaged smollm2 ones)",
    )
    p.add_argument("--adapters-out", default=None, help="where (default: OUT-m2r2)")
    p.add_argument("--force", action="store_true", help="replace existing output folders")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.adapters_out = args.adapters_out or f"{args.out.rstrip('/')}-m2r2"

    def body() -> None:
        record = build(args)
        q = record.get("quality")
        line = (
            f"{args.out}: {len(record['layers'])} layers x {args.experts} experts, top-{args.top_k}, "
            f"built in {record['build_s']:.0f} s"
        )
        if q:
            line += (
                f"; held-out perplexity {q['moe_ppl']:.2f} (dense {q['dense_ppl']:.2f}), "
                f"greedy agreement {q['greedy_agreement']:.1%}"
            )
        print(line)

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
