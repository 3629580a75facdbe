"""A small OLMoE, trained from scratch on package corpora: the MoE model the expert cache is measured on.

No trained MoE ships in a package, so this builds one reproducibly, in three steps:

    python -m m2r2_tools.tiny_olmoe data  -o build/olmoe-data    # corpus + BPE tokenizer + token ids (CPU, ~1 min)
    python -m m2r2_tools.tiny_olmoe train --data build/olmoe-data -o build/olmoe-torch --device cuda
    python -m m2r2_tools.tiny_olmoe export build/olmoe-torch --data build/olmoe-data -o build/tiny-olmoe

Training is PyTorch (olmoe_train; the model, mlx-lm's ``olmoe`` written out with the same weight names, is
olmoe_model), so ``export`` only casts and writes: mlx-lm loads the folder as is. A test checks the two forwards
agree on a random tiny config.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from m2r2_mlx.atomic import atomic_folder, refuse_existing
from m2r2_mlx.errors import M2R2Error, run_cli

import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .corpora import add_corpus_arguments, corpus_paths
from .corpus_sources import Corpora

PROG = "python -m m2r2_tools.tiny_olmoe"

# 8 layers x 32 experts (top-4) of 96 hidden units: ~25M parameters, experts ~76% of the bytes.
CONFIG = dict(
    model_type="olmoe",
    vocab_size=8192,
    hidden_size=256,
    num_hidden_layers=8,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_experts=32,
    num_experts_per_tok=4,
    norm_topk_prob=False,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n\n{% endfor %}"


def build_data(
    out: Path, vocab_size: int, corpora: Corpora | None = None, holdout: float = 0.01, seed: int = 0
) -> dict:
    """Train a byte-level BPE on the corpus (``corpora.documents``), encode it, split off held-out documents."""
    docs = (corpora or Corpora()).documents
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(docs))
    n_eval = max(1, int(len(docs) * holdout))
    eval_docs, train_docs = [docs[i] for i in order[:n_eval]], [docs[i] for i in order[n_eval:]]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        show_progress=True,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(train_docs, trainer=trainer)
    eos = tok.token_to_id(SPECIALS[0])

    def encode(ds):
        ids = [np.array(e.ids + [eos], dtype=np.uint16) for e in tok.encode_batch(ds)]
        return np.concatenate(ids)

    train_ids, eval_ids = encode(train_docs), encode(eval_docs)
    with atomic_folder(out) as tmp:
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "eos_token": SPECIALS[0],
                    "pad_token": SPECIALS[0],
                    "model_max_length": CONFIG["max_position_embeddings"],
                    "chat_template": CHAT_TEMPLATE,
                },
                indent=1,
            )
        )
        np.save(tmp / "train.npy", train_ids)
        np.save(tmp / "eval.npy", eval_ids)
    return {"documents": len(docs), "train_tokens": int(train_ids.size), "eval_tokens": int(eval_ids.size)}


def mlx_weights(trained: Path) -> dict:
    """The PyTorch shards as float32 MLX arrays, under the same (mlx-lm) names."""
    shards = sorted(trained.glob("model-*.safetensors"))
    if not shards:
        raise M2R2Error(f"{trained} holds no model-*.safetensors; run the train step first")
    weights = {}
    for s in shards:
        weights.update({k: v.astype(mx.float32) for k, v in mx.load(str(s)).items()})
    return weights


def export(trained: Path, data: Path, out: Path, force: bool) -> Path:
    """bf16 PyTorch shards -> one float32 MLX folder that mlx-lm loads (names already match)."""
    refuse_existing(out, force)
    missing = [
        p for p in (trained / "config.json", data / "tokenizer.json", data / "tokenizer_config.json") if not p.is_file()
    ]
    if missing:
        raise M2R2Error(f"{missing[0]} is missing; run the data and train steps first")
    weights = mlx_weights(trained)
    with atomic_folder(out) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text((trained / "config.json").read_text())
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (tmp / name).write_text((data / name).read_text())
        if (trained / "training.json").exists():
            (tmp / "training.json").write_text((trained / "training.json").read_text())
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data", help="corpus + BPE tokenizer + token ids")
    d.add_argument("-o", "--output", type=Path, required=True)
    d.add_argument("--vocab", type=int, default=CONFIG["vocab_size"])
    d.add_argument("--force", action="store_true", help="replace an existing output folder")
    add_corpus_arguments(d)
    t = sub.add_parser("train", help="train in PyTorch (cuda, mps or cpu)")
    t.add_argument("--data", type=Path, required=True)
    t.add_argument("-o", "--output", type=Path, required=True)
    t.add_argument("--device", default="cuda")
    t.add_argument(
        "--steps",
        type=int,
        default=1000,
        help="1000 (33M tokens, ~7 epochs) gave the lowest held-out loss of 600/1000/2000",
    )
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--seq", type=int, default=512)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-minutes", type=float, default=7.0, help="stop early at this wall time")
    t.add_argument("--shard-mb", type=float, default=15.0)
    t.add_argument("--force", action="store_true", help="replace an existing output folder")
    e = sub.add_parser("export", help="PyTorch shards -> float32 MLX folder")
    e.add_argument("trained", type=Path)
    e.add_argument("--data", type=Path, required=True)
    e.add_argument("-o", "--output", type=Path, required=True)
    e.add_argument("--force", action="store_true")
    return ap


def _main() -> int:
    a = build_parser().parse_args()
    if a.cmd == "data":
        refuse_existing(a.output, a.force)
        corpora = Corpora(corpus_paths(a.fortunes, a.python_docs, a.npm_root))
        print(json.dumps(build_data(a.output, a.vocab, corpora)))
    elif a.cmd == "train":
        refuse_existing(a.output, a.force)
        if not (a.data / "train.npy").exists():
            raise M2R2Error(f"{a.data} holds no train.npy; run the data step first")
        # here, not at the top: only this step needs PyTorch
        from .olmoe_train import OlmoeTraining, train

        run = OlmoeTraining(a.device, a.steps, a.batch, a.seq, a.lr, a.seed, a.max_minutes, a.shard_mb)
        s = train(a.data, a.output, run, CONFIG)
        print(json.dumps({k: v for k, v in s.items() if k != "log"}))
    else:
        print(f"wrote {export(a.trained, a.data, a.output, a.force)}")
    return 0


def main() -> None:
    sys.exit(run_cli(PROG, _main))


if __name__ == "__main__":
    main()
