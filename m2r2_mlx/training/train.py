"""m2r2-train: train M2R2 accelerator adapters on a frozen base model.

    m2r2-train --model smollm2 --text corpus.txt --prompts prompts.jsonl -o m2r2_mlx/trained/smollm2

Recipe (docs/training.md): the slow stream runs once per batch outside the gradient (it is frozen); only the fast
stream's layers are differentiated, and only the adapters get gradients (trainer.Trainer). Loss = sum over gates of
temperature-scaled KL(p_final || p_gate) + align * (1 - cos(h_fast at gate, h_final)). Then ARLA learns on the
trained adapters' exits (the second stage; exit_decisions).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import m2r2_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core on Linux)

import mlx.core as mx
import numpy as np
from tqdm.auto import tqdm

from ..core.adapters import add_context_feature, load_adapters, new_m2r2, save_adapters, widen_adapters
from ..core.arla import ARLA
from ..core.config import AdapterMetrics
from ..core.draft_vocab import rank_tokens, save_draft_vocab
from ..core.hub import upload_adapters
from ..errors import M2R2Error, run_cli
from ..models.blas import blas_info
from ..models.registry import is_repo_id, load_model
from .cli import train_parser
from .config import STAGES, TrainConfig, from_flags, train_gate_indices
from .cpu_kernels import fast_kernels
from .data import DATA_CACHE, DISTILL_LOG, RowSplit, load_rows, split_rows
from .evaluate import gate_agreement
from .exit_decisions import collect_features, train_exit_decisions
from .report import agreement_table
from .trainer import CHECKPOINT, Trainer, save_checkpoint

PROG = "m2r2-train"
DRAFT_VOCAB = "draft_vocab.json"  # written before the adapters folder is saved: ARLA needs it first


@dataclass(frozen=True)
class MLXTrainOptions:
    """m2r2-train's own settings, beside TrainConfig: its second stage (ARLA) and the CPU kernels."""

    arla_rows: int = 48  # training rows whose tokens teach ARLA
    arla_steps: int = 400  # ARLA optimisation steps
    exit_vocab: int = 4096  # ARLA scores exits over the N most frequent tokens of the data; 0: the full vocabulary
    exact_kernels: bool = False  # MLX's own exp-based kernels in self-distillation and training too


def build_parser() -> argparse.ArgumentParser:
    p = train_parser(PROG, "Train M2R2 accelerator adapters on a frozen base model.")
    d = MLXTrainOptions()
    p.add_argument("--private", action="store_true", help="with --upload-repo: create the repo private")
    p.add_argument(
        "--exact-kernels",
        action="store_true",
        help="on the CPU, keep MLX's own exp-based kernels in self-distillation and training too "
        "(default: faster ones with relative error < 1e-6; decoding and evaluation always use MLX's)",
    )
    p.add_argument(
        "--stage",
        choices=STAGES,
        default="both",
        help="train the adapters, then ARLA on their exits (both, default); 'arla' trains only ARLA "
        "on the adapters given by --init or --resume; 'data' only builds OUTPUT/data.npy "
        "(self-distilling --prompts), for a later run's --data",
    )
    p.add_argument(
        "--arla-rows",
        type=int,
        default=d.arla_rows,
        help=f"training rows whose tokens teach ARLA (default {d.arla_rows})",
    )
    p.add_argument(
        "--arla-steps", type=int, default=d.arla_steps, help=f"ARLA optimisation steps (default {d.arla_steps})"
    )
    p.add_argument(
        "--exit-vocab",
        type=int,
        default=d.exit_vocab,
        help="ARLA scores exits over the N most frequent tokens of the data, as early exit will "
        f"(a check then reads N rows of the LM head); 0: the full vocabulary (default {d.exit_vocab})",
    )
    return p


def train(config: TrainConfig, options: MLXTrainOptions = MLXTrainOptions()) -> Path:
    """Run ``config.stage``: the token rows only ("data"), the adapters ("adapters"), ARLA on given adapters
    ("arla") or both; returns OUTPUT, an adapters folder (or the rows' folder)."""
    if options.exit_vocab < 0:
        raise M2R2Error(f"--exit-vocab must be 0 (the full vocabulary) or a token count (got {options.exit_vocab})")
    config.check()
    out = prepare_output(config)
    mx.random.seed(config.seed)
    print(blas_info().describe(), file=sys.stderr)
    lm = load_model(config.model)
    lm.model.freeze()
    fast = not options.exact_kernels  # self-distillation and training: data, not decoding
    if config.stage == "data":
        with fast_kernels(lm.model, fast):
            rows, mask = load_rows(config, lm, out)
        scored = "" if mask is None else f" ({100 * mask.mean():.0f}% of the positions predict answers or text)"
        print(f"{out / DATA_CACHE}: {len(rows)} rows of {rows.shape[1]} tokens{scored}", file=sys.stderr)
        return out
    m2r2, start = adapters_to_train(config, lm, out)
    gate_indices = train_gate_indices(m2r2.config, config.train_gates)
    if getattr(m2r2, "arla", None) is not None:
        m2r2.arla.freeze()  # adapter training leaves an inherited ARLA alone; the ARLA stage trains a new one
    with fast_kernels(lm.model, fast):
        rows, mask = load_rows(config, lm, out)
    split = split_rows(config, rows, mask, out)
    trainer = Trainer(m2r2, lr=config.lr, steps=config.steps, loss=config.loss, gate_indices=gate_indices)
    if start and (out / CHECKPOINT / "optimizer.safetensors").is_file():
        trainer.restore(out / CHECKPOINT / "optimizer.safetensors")
    t0 = time.perf_counter()
    fit(trainer, config, split, config.steps if config.stage == "arla" else start, fast, out)

    print("held-out evaluation…", file=sys.stderr)
    agreement = gate_agreement(m2r2, split.heldout, mask=split.heldout_mask)
    seconds = time.perf_counter() - t0
    vocab = draft_vocab_from(rows, out, lm)
    exit_auc = {}
    if config.stage in ("arla", "both"):
        exit_ids = vocab[: options.exit_vocab] if options.exit_vocab else None
        answers = config.loss_on == "answers"  # then ARLA too learns on the tokens early exit decides: answers
        with fast_kernels(lm.model, fast):  # features are training data, like the distilled answers
            exit_auc = train_arla(
                m2r2,
                split.train[: options.arla_rows],
                split.heldout,
                options.arla_steps,
                config.seed,
                exit_ids,
                split.train_mask[: options.arla_rows] if answers else None,
                split.heldout_mask if answers else None,
            )
    # the ARLA stage keeps the recipe of the adapters it was given; the figures are this run's
    extra = dict(m2r2.config.extra) if config.stage == "arla" else {}
    if config.stage != "arla":
        extra.update(recipe=config.recipe(options), seconds=round(seconds, 1))
    m2r2.config.extra = {**extra, "train_rows": int(len(split.train))}
    m2r2.config.metrics = AdapterMetrics(heldout_agreement=agreement, exit_auc=exit_auc)
    save_adapters(m2r2, out, overwrite=True, keep=(DATA_CACHE, DISTILL_LOG, DRAFT_VOCAB))  # data: for --data
    print(agreement_table(agreement))
    return out


def prepare_output(config: TrainConfig) -> Path:
    out = Path(config.output)
    if out.exists() and not config.resume and not config.force:
        raise M2R2Error(f"{out} already exists; pass --resume to continue it or --force to start over")
    if config.force and not config.resume:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    return out


def adapters_to_train(config: TrainConfig, lm, out: Path):
    """(the adapters to train, the step they are at): OUTPUT's checkpoint (resume), those of --init (or, for the
    ARLA stage, OUTPUT's own) or new ones; widened to ``config.rank`` and given a context feature if asked."""
    ck = out / CHECKPOINT
    start = 0
    if config.resume and ck.is_dir():
        m2r2 = load_adapters(lm, ck / "adapters")
        start = json.loads((ck / "state.json").read_text())["step"]
    elif config.init or (config.stage == "arla" and (out / "m2r2_config.json").is_file()):
        m2r2 = load_adapters(lm, config.init or out)
    elif config.stage == "arla":
        raise M2R2Error(
            "--stage arla trains ARLA on existing adapters: pass --init FOLDER, or --resume an OUTPUT that has them"
        )
    else:
        gates = list(config.gates) if config.gates else None
        m2r2 = new_m2r2(lm, gates=gates, every=config.every, rank=config.adapter_rank or 64)
    if config.rank and m2r2.config.adapter_rank != config.adapter_rank:
        m2r2 = widen_adapters(m2r2, config.adapter_rank, config.seed)
    if config.context_feature:
        add_context_feature(m2r2)
    return m2r2, start


def fit(trainer: Trainer, config: TrainConfig, split: RowSplit, start: int, fast: bool, out: Path) -> None:
    """Steps ``start`` to ``config.steps`` on random batches of the training rows, checkpointing on the way."""
    rng = np.random.default_rng(config.seed + start)
    bar = tqdm(range(start, config.steps), initial=start, total=config.steps, desc="training adapters", unit="step")
    tokens, t0 = 0, time.perf_counter()
    for step in bar:
        batch = rng.integers(0, len(split.train), config.batch_size)
        ids = mx.array(split.train[batch])
        scored = mx.array(np.flatnonzero(split.train_mask[batch])) if config.loss_on == "answers" else None
        if scored is None or scored.size:  # rows inside long prompts only: nothing to score (the mean would be NaN)
            with fast_kernels(trainer.m2r2.base, fast):
                loss, kls = trainer.step(ids, scored)
            tokens += ids.size
            bar.set_postfix(
                loss=f"{loss:.3f}",
                kl="/".join(f"{k:.2f}" for k in kls),
                tok_s=f"{tokens / (time.perf_counter() - t0):.0f}",
            )
        if (step + 1) % config.checkpoint_every == 0 and step + 1 < config.steps:
            save_checkpoint(trainer.m2r2, trainer.opt, step + 1, out)
    bar.close()


def train_arla(
    m2r2,
    train_rows: np.ndarray,
    eval_rows: np.ndarray,
    steps: int,
    seed: int,
    exit_ids=None,
    train_mask: np.ndarray | None = None,
    eval_mask: np.ndarray | None = None,
) -> dict:
    """Second stage: ARLA on the trained adapters' exits, with the baselines' ROC AUC beside it;
    ``exit_ids``: the vocabulary subset exits are scored over (recorded as config.exit_vocab); the masks:
    the rows' tokens to learn from and score (None: all)."""
    cfg = m2r2.config
    cfg.arla, cfg.arla_exit_stats = True, True
    cfg.exit_vocab = 0 if exit_ids is None else len(exit_ids)
    m2r2.arla = ARLA(cfg.hidden_size, cfg.arla_dim, len(cfg.gates), exit_stats=True)
    with tqdm(total=len(train_rows) + len(eval_rows), desc="ARLA features", unit="row") as bar:
        train_feats = collect_features(m2r2, train_rows, progress=bar.update, exit_ids=exit_ids, mask=train_mask)
        eval_feats = collect_features(m2r2, eval_rows, progress=bar.update, exit_ids=exit_ids, mask=eval_mask)
    result = train_exit_decisions(m2r2, train_feats, eval_feats, steps, seed)
    for name, aucs in result["auc"].items():
        print(
            f"exit ROC AUC, {name:>12s}: " + "  ".join(f"L{g} {a:.3f}" for g, a in zip(cfg.gates, aucs)),
            file=sys.stderr,
        )
    return result


def draft_vocab_from(rows: np.ndarray, out: Path, lm) -> list[int]:
    """The draft head's vocabulary (draft_vocab.json), counted on the same rows; its ids, most frequent first."""
    tokens, cover = rank_tokens(rows, int(lm.config["vocab_size"]))
    save_draft_vocab(out, tokens, cover, source=f"m2r2-train rows: {rows.size} tokens")
    return tokens


def _main() -> int:
    args = build_parser().parse_args()
    config, options = from_flags(TrainConfig, vars(args)), from_flags(MLXTrainOptions, vars(args))
    if config.upload_repo and not is_repo_id(config.upload_repo):  # before hours of training, not after
        raise M2R2Error(f"--upload-repo {config.upload_repo!r} is not a Hub repo id; name it as owner/name")
    out = train(config, options)
    if config.upload_repo and config.stage != "data":
        url = upload_adapters(out, config.upload_repo, private=args.private)
        print(f"uploaded {out} to {url} (try: m2r2-chat --adapters {config.upload_repo} --mode speculative)")
    return 0


def main() -> None:
    sys.exit(run_cli(PROG, _main))


if __name__ == "__main__":
    main()
