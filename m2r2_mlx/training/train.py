"""m2r2-train: train M2R2 accelerator adapters on a frozen base model.

    m2r2-train --model smollm2 --text corpus.txt --prompts prompts.jsonl -o m2r2_mlx/trained/smollm2

Recipe (docs/training.md): the slow stream runs once per batch outside the
gradient (it is frozen); only the fast stream's layers are differentiated, and
only the adapters get gradients. Loss = sum over gates of temperature-scaled
KL(p_final || p_gate) + align * (1 - cos(h_fast at gate, h_final)).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import m2r2_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core on Linux)

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from tqdm.auto import tqdm

from ..atomic import atomic_folder
from ..core.adapters import add_context_feature, load_adapters, new_m2r2, save_adapters, widen_adapters
from ..core.arla import ARLA
from ..core.draft_vocab import rank_tokens, save_draft_vocab
from ..core.hub import upload_adapters
from ..errors import M2R2Error, run_cli
from ..models.blas import blas_info
from ..models.registry import is_repo_id, load_model
from .cpu_kernels import fast_kernels
from .data import DATA_CACHE, DISTILL_LOG, load_rows, mask_path
from .evaluate import gate_agreement
from .exit_decisions import collect_features, train_exit_decisions
from .losses import gate_loss, teacher_targets

CHECKPOINT = "checkpoint"
DRAFT_VOCAB = "draft_vocab.json"  # written before the adapters folder is saved: ARLA needs it first


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="m2r2-train", description="Train M2R2 accelerator adapters on a frozen base model."
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {m2r2_mlx.__version__}")
    p.add_argument(
        "--model", default=None, help="base model: alias, repo id, folder or .gguf (default: embedded smollm2)"
    )
    p.add_argument("-o", "--output", required=True, help="adapters folder to write")
    p.add_argument("--text", nargs="*", default=[], help="plain text files")
    p.add_argument(
        "--prompts", help="jsonl of prompts; the base model's own answers are generated first (self-distillation)"
    )
    p.add_argument("--answer-tokens", type=int, default=160, help="most tokens per self-distilled answer")
    p.add_argument(
        "--data",
        metavar="ROWS.npy",
        help="train on the token rows of an earlier run (its data.npy) instead of --text/--prompts",
    )
    p.add_argument("--gates", help="comma-separated exit layers, e.g. 6,12,18,24 (default: every --every layers)")
    p.add_argument("--every", type=int, default=6, help="gate spacing when --gates is not given (default 6)")
    p.add_argument(
        "--rank",
        type=parse_ranks,
        default=None,
        help="adapter bottleneck rank, or one per gate interval (e.g. 256,64,64,64); with --init, "
        "wider ranks widen the given adapters, which keep computing what they did (default 64)",
    )
    p.add_argument(
        "--context-feature",
        action="store_true",
        help="the first interval's fast stream also reads the previous position's final state (a zero-"
        "initialised projection added to its start; with --init, added to the given adapters)",
    )
    p.add_argument(
        "--train-gates",
        help="comma-separated gates whose interval's adapters train (default: all); "
        "the others stay as --init gave them and their fast stream does not run",
    )
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=2e-3)
    # distillation's temperature and top-k, named apart from decoding's sampling flags (old names kept)
    p.add_argument(
        "--distill-temp",
        "--temperature",
        dest="temperature",
        type=float,
        default=1.0,
        help="distillation temperature (default 1.0)",
    )
    p.add_argument(
        "--distill-top-k",
        "--top-k",
        dest="top_k",
        type=int,
        default=16,
        help="distil over the union of the teacher's top-k tokens (default 16)",
    )
    p.add_argument("--align", type=float, default=1.0, help="weight of the cosine alignment term")
    p.add_argument(
        "--loss-on",
        choices=("all", "answers"),
        default="all",
        help="positions the loss scores: every one (default), or only those predicting a self-distilled "
        "answer or plain-text token, leaving out prompts and chat template; ARLA then learns and is "
        "scored on those tokens too (needs the rows' loss mask, DATA.mask.npy, which --stage data writes)",
    )
    p.add_argument("--eval-rows", type=int, default=16, help="held-out rows for the final evaluation")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--resume", action="store_true", help="continue from OUTPUT/checkpoint")
    p.add_argument(
        "--init", metavar="ADAPTERS", help="warm start: begin from this adapters folder (its gates and rank)"
    )
    p.add_argument("--force", action="store_true", help="replace an existing OUTPUT folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--upload-repo",
        metavar="OWNER/NAME",
        help="after training, upload the adapters folder to this Hugging Face Hub model repo (created if "
        "needed; log in with `hf auth login` or set HF_TOKEN)",
    )
    p.add_argument("--private", action="store_true", help="with --upload-repo: create the repo private")
    p.add_argument(
        "--exact-kernels",
        action="store_true",
        help="on the CPU, keep MLX's own exp-based kernels in self-distillation and training too "
        "(default: faster ones with relative error < 1e-6; decoding and evaluation always use MLX's)",
    )
    p.add_argument(
        "--stage",
        choices=("data", "adapters", "arla", "both"),
        default="both",
        help="train the adapters, then ARLA on their exits (both, default); 'arla' trains only ARLA "
        "on the adapters given by --init or --resume; 'data' only builds OUTPUT/data.npy "
        "(self-distilling --prompts), for a later run's --data",
    )
    p.add_argument("--arla-rows", type=int, default=48, help="training rows whose tokens teach ARLA (default 48)")
    p.add_argument("--arla-steps", type=int, default=400, help="ARLA optimisation steps (default 400)")
    p.add_argument(
        "--exit-vocab",
        type=int,
        default=4096,
        help="ARLA scores exits over the N most frequent tokens of the data, as early exit will "
        "(a check then reads N rows of the LM head); 0: the full vocabulary (default 4096)",
    )
    return p


def parse_ranks(text: str) -> int | list[int]:
    try:
        ranks = [int(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rank or a comma-separated list of ranks") from None
    return ranks[0] if len(ranks) == 1 else ranks


def scored_positions(h: mx.array, scored: mx.array | None) -> mx.array:
    """The states (B, T, D) at the flat position indices ``scored`` as (n, D); all of them, unchanged, for None."""
    return h if scored is None else h.reshape(-1, h.shape[-1])[scored]


class Trainer:
    """One optimisation step at a time: frozen slow pass, then gradients through the fast stream only."""

    def __init__(
        self,
        m2r2,
        lr: float,
        steps: int,
        temperature: float = 1.0,
        align: float = 1.0,
        warmup: int = 20,
        top_k: int = 16,
        gate_indices: list[int] | None = None,
    ):
        self.m2r2, self.temperature, self.align, self.top_k = m2r2, temperature, align, top_k
        self.gate_indices = gate_indices  # None: every gate's interval trains
        if gate_indices is not None:  # the other intervals' adapters neither run nor take optimizer state
            for j, (start, stop) in enumerate(m2r2.config.intervals()):
                if j not in gate_indices:
                    for i in range(start, stop):
                        m2r2.adapters[i].freeze()
                    if j == 0 and getattr(m2r2, "context", None) is not None:
                        m2r2.context.freeze()
        warmup = min(warmup, max(steps // 10, 1))
        schedule = optim.join_schedules(
            [optim.linear_schedule(lr * 0.01, lr, warmup), optim.cosine_decay(lr, max(steps - warmup, 1), lr * 0.05)],
            [warmup],
        )
        self.opt = optim.AdamW(learning_rate=schedule, weight_decay=0.0)
        self.value_and_grad = nn.value_and_grad(m2r2, self.loss)

    def loss(self, model, states, kv, final, rows, teacher, scored):
        total, kls = 0.0, []
        for fast in model.fast_states(states, kv, self.gate_indices):
            loss, kl = gate_loss(
                model.parts, scored_positions(fast, scored), final, rows, teacher, self.temperature, self.align
            )
            total = total + loss
            kls.append(kl)
        return total, mx.stack(kls)

    def frozen_pass(self, ids: mx.array, scored: mx.array | None = None):
        """The slow stream and the teacher distribution: computed once per batch, no gradient. ``scored``: the
        flat indices of the (B, T) positions the loss scores (None: all); the teacher's head runs on those only."""
        states, final, kv = self.m2r2.slow_pass(ids)
        states = {k: mx.stop_gradient(v) for k, v in states.items()}
        kv = [(mx.stop_gradient(k), mx.stop_gradient(v)) for k, v in kv]
        final = mx.stop_gradient(scored_positions(final, scored))
        rows, teacher = teacher_targets(self.m2r2.parts, final, self.temperature, self.top_k)
        mx.eval(states, kv, final, teacher)
        return states, kv, final, rows, teacher, scored

    def step(self, ids: mx.array, scored: mx.array | None = None) -> tuple[float, list[float]]:
        (loss, kls), grads = self.value_and_grad(self.m2r2, *self.frozen_pass(ids, scored))
        self.opt.update(self.m2r2, grads)
        mx.eval(self.m2r2.parameters(), self.opt.state, loss, kls)
        return loss.item(), kls.tolist()

    def eval_loss(self, ids: mx.array, scored: mx.array | None = None) -> float:
        loss, _ = self.loss(self.m2r2, *self.frozen_pass(ids, scored))
        return loss.item()

    def restore(self, path: Path) -> None:
        self.opt.init(self.m2r2.trainable_parameters())
        self.opt.state = tree_unflatten(list(mx.load(str(path)).items()))


def save_checkpoint(m2r2, opt, step: int, out: Path) -> None:
    with atomic_folder(out / CHECKPOINT) as tmp:
        save_adapters(m2r2, tmp / "adapters")
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
        (tmp / "state.json").write_text(json.dumps({"step": step}))


def train(args) -> Path:
    if args.exit_vocab < 0:
        raise M2R2Error(f"--exit-vocab must be 0 (the full vocabulary) or a token count (got {args.exit_vocab})")
    out = Path(args.output)
    ck = out / CHECKPOINT
    if out.exists() and not args.resume and not args.force:
        raise M2R2Error(f"{out} already exists; pass --resume to continue it or --force to start over")
    if args.force and not args.resume:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    mx.random.seed(args.seed)

    print(blas_info().describe(), file=sys.stderr)
    lm = load_model(args.model)
    lm.model.freeze()
    if args.stage == "data":
        with fast_kernels(not args.exact_kernels):
            rows, mask = load_rows(args, lm, out)
        scored = "" if mask is None else f" ({100 * mask.mean():.0f}% of the positions predict answers or text)"
        print(f"{out / DATA_CACHE}: {len(rows)} rows of {rows.shape[1]} tokens{scored}", file=sys.stderr)
        return out
    gates = [int(g) for g in args.gates.split(",")] if args.gates else None
    start = 0
    if args.resume and ck.is_dir():
        m2r2 = load_adapters(lm, ck / "adapters")
        start = json.loads((ck / "state.json").read_text())["step"]
    elif args.init or (args.stage == "arla" and (out / "m2r2_config.json").is_file()):
        m2r2 = load_adapters(lm, args.init or out)
    elif args.stage == "arla":
        raise M2R2Error(
            "--stage arla trains ARLA on existing adapters: pass --init FOLDER, or --resume an OUTPUT that has them"
        )
    else:
        m2r2 = new_m2r2(lm, gates=gates, every=args.every, rank=args.rank or 64)
    if args.rank and m2r2.config.adapter_rank != args.rank:
        m2r2 = widen_adapters(m2r2, args.rank, args.seed)
    if args.context_feature:
        add_context_feature(m2r2)
    gate_indices = train_gate_indices(m2r2, args.train_gates)
    if getattr(m2r2, "arla", None) is not None:
        m2r2.arla.freeze()  # adapter training leaves an inherited ARLA alone; the ARLA stage trains a new one
    with fast_kernels(not args.exact_kernels):  # self-distillation: data, not decoding
        rows, mask = load_rows(args, lm, out)
    if args.loss_on == "answers" and mask is None:
        where = mask_path(args.data or out / DATA_CACHE)
        raise M2R2Error(
            f"--loss-on answers needs the rows' loss mask {where}; rebuild the rows with --stage data, which writes it"
        )
    n_eval = min(args.eval_rows, max(1, len(rows) // 10))
    eval_rows, train_rows = rows[:n_eval], rows[n_eval:]
    eval_mask, train_mask = (None, None) if mask is None else (mask[:n_eval], mask[n_eval:])
    if len(train_rows) < args.batch_size:
        raise M2R2Error(f"{len(train_rows)} training rows of {args.seq_len} tokens is fewer than one batch; add data")

    trainer = Trainer(
        m2r2,
        lr=args.lr,
        steps=args.steps,
        temperature=args.temperature,
        align=args.align,
        top_k=args.top_k,
        gate_indices=gate_indices,
    )
    if start and (ck / "optimizer.safetensors").is_file():
        trainer.restore(ck / "optimizer.safetensors")

    if args.stage == "arla":
        start = args.steps  # the adapters are given: straight to the second stage
    rng = np.random.default_rng(args.seed + start)
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="training adapters", unit="step")
    tokens, t0 = 0, time.perf_counter()
    for step in bar:
        batch = rng.integers(0, len(train_rows), args.batch_size)
        ids = mx.array(train_rows[batch])
        scored = mx.array(np.flatnonzero(train_mask[batch])) if args.loss_on == "answers" else None
        if scored is None or scored.size:  # rows inside long prompts only: nothing to score (the mean would be NaN)
            with fast_kernels(not args.exact_kernels):
                loss, kls = trainer.step(ids, scored)
            tokens += ids.size
            bar.set_postfix(
                loss=f"{loss:.3f}",
                kl="/".join(f"{k:.2f}" for k in kls),
                tok_s=f"{tokens / (time.perf_counter() - t0):.0f}",
            )
        if (step + 1) % args.checkpoint_every == 0 and step + 1 < args.steps:
            save_checkpoint(m2r2, trainer.opt, step + 1, out)
    bar.close()

    print("held-out evaluation…", file=sys.stderr)
    metrics = gate_agreement(m2r2, eval_rows, mask=eval_mask)
    extra = dict(m2r2.config.extra) if args.stage == "arla" else {}
    extra.update(
        {
            "heldout_agreement": metrics,
            "train_rows": int(len(train_rows)),
        }
    )
    if args.stage != "arla":
        extra.update(
            {
                "recipe": {k: v for k, v in vars(args).items() if k not in ("resume", "force", "output")},
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
    vocab = draft_vocab_from(rows, out, lm)
    if args.stage in ("arla", "both"):
        exit_ids = vocab[: args.exit_vocab] if args.exit_vocab else None
        with fast_kernels(not args.exact_kernels):  # features are training data, like the distilled answers
            answers = args.loss_on == "answers"  # then ARLA too learns on the tokens early exit decides: answers
            extra["exit_auc"] = train_arla(
                m2r2,
                train_rows[: args.arla_rows],
                eval_rows,
                args.arla_steps,
                args.seed,
                exit_ids,
                train_mask[: args.arla_rows] if answers else None,
                eval_mask if answers else None,
            )
    m2r2.config.extra = extra
    save_adapters(
        m2r2, out, overwrite=True, keep=(DATA_CACHE, DISTILL_LOG, DRAFT_VOCAB)
    )  # data: for --stage arla / --data
    scored = metrics.get("scored")
    for j, g in enumerate(metrics["gates"]):
        line = (
            f"gate L{g}: naive exit {100 * metrics['naive'][j]:.1f}%  m2r2 {100 * metrics['m2r2'][j]:.1f}%  "
            f"(top-1 agreement with the full model, {metrics['tokens']} held-out tokens)"
        )
        if scored:
            line += (
                f"; answers and text only: {100 * scored['naive'][j]:.1f}% / {100 * scored['m2r2'][j]:.1f}% "
                f"({scored['tokens']})"
            )
        print(line)
    return out


def train_gate_indices(m2r2, train_gates: str | None) -> list[int] | None:
    """Indices of the gates --train-gates names (None: all), for Trainer."""
    if not train_gates:
        return None
    gates = m2r2.config.gates
    try:
        chosen = sorted({gates.index(int(g)) for g in train_gates.split(",")})
    except ValueError:
        raise M2R2Error(f"--train-gates {train_gates} must name gates of the adapters, which are {gates}") from None
    if m2r2.config.adapter_form != "parallel_bottleneck":
        raise M2R2Error("--train-gates needs bottleneck adapters (a LoRA delta serves every interval of its layer)")
    return chosen


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
    if args.upload_repo and not is_repo_id(args.upload_repo):  # before hours of training, not after
        raise M2R2Error(f"--upload-repo {args.upload_repo!r} is not a Hub repo id; name it as owner/name")
    out = train(args)
    if args.upload_repo and args.stage != "data":
        url = upload_adapters(out, args.upload_repo, private=args.private)
        print(f"uploaded {out} to {url} (try: m2r2-chat --adapters {args.upload_repo} --mode speculative)")
    return 0


def main() -> None:
    sys.exit(run_cli("m2r2-train", _main))


if __name__ == "__main__":
    main()
