"""The trainers' shared command line: every flag of TrainConfig, spelled once for m2r2-train and m2r2-train-torch,
which each add their own few on top (training/train.py, m2r2_torch/train.py). No mlx here: the PyTorch trainer builds
its parser where mlx is not installed."""

from __future__ import annotations

import argparse

import m2r2_mlx

from ..core.config import parse_layers
from .config import LOSS_ON, TrainConfig


def parse_ranks(text: str) -> int | tuple[int, ...]:
    try:
        ranks = tuple(int(r) for r in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rank or a comma-separated list of ranks") from None
    return ranks[0] if len(ranks) == 1 else ranks


def train_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A trainer's parser with the flags both trainers share; TrainConfig's defaults are theirs."""
    d = TrainConfig(output="")
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--version", action="version", version=f"%(prog)s {m2r2_mlx.__version__}")
    p.add_argument("--model", help="base model: alias, repo id, folder or .gguf (default: embedded smollm2)")
    p.add_argument("-o", "--output", required=True, help="adapters folder to write")
    p.add_argument("--text", nargs="*", default=[], help="plain text files")
    p.add_argument(
        "--prompts",
        help="jsonl of prompts; the base model's own answers are generated first (self-distillation; the answer "
        "log resumes an interrupted run)",
    )
    p.add_argument("--answer-tokens", type=int, default=d.answer_tokens, help="most tokens per self-distilled answer")
    p.add_argument(
        "--data",
        metavar="ROWS.npy",
        help="train on the token rows of an earlier run (its data.npy) instead of --text/--prompts",
    )
    p.add_argument(
        "--gates",
        type=parse_layers,  # M2R2Error: one line from run_cli, not argparse's usage
        help="comma-separated exit layers, e.g. 6,12,18,24 (default: every --every layers)",
    )
    p.add_argument(
        "--every", type=int, default=d.every, help=f"gate spacing when --gates is not given (default {d.every})"
    )
    p.add_argument(
        "--rank",
        type=parse_ranks,
        help="adapter bottleneck rank, or one per gate interval (e.g. 256,64,64,64) (default 64); m2r2-train "
        "widens --init adapters to wider ranks, which keep computing what they did",
    )
    p.add_argument(
        "--context-feature",
        action="store_true",
        help="the first interval's fast stream also reads the previous position's final state (a zero-"
        "initialised projection added to its start; m2r2-train also adds it to --init adapters)",
    )
    p.add_argument(
        "--train-gates",
        type=lambda text: parse_layers(text, "--train-gates"),
        help="comma-separated gates whose interval's adapters train (default: all); "
        "the others stay as --init gave them and their fast stream does not run",
    )
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="rows per step (over all processes)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--lr", type=float, default=d.lr)
    # distillation's temperature and top-k, named apart from decoding's sampling flags (old names kept)
    p.add_argument(
        "--distill-temp",
        "--temperature",
        dest="distill_temp",
        type=float,
        default=d.distill_temp,
        help=f"distillation temperature (default {d.distill_temp})",
    )
    p.add_argument(
        "--distill-top-k",
        "--top-k",
        dest="distill_top_k",
        type=int,
        default=d.distill_top_k,
        help=f"distil over the union of the teacher's top-k tokens (default {d.distill_top_k})",
    )
    p.add_argument("--align", type=float, default=d.align, help="weight of the cosine alignment term")
    p.add_argument(
        "--loss-on",
        choices=LOSS_ON,
        default=d.loss_on,
        help="positions the loss scores: every one (default), or only those predicting a self-distilled "
        "answer or plain-text token, leaving out prompts and chat template; m2r2-train's ARLA then learns and is "
        "scored on those tokens too (needs the rows' loss mask, DATA.mask.npy, which --stage data writes)",
    )
    p.add_argument("--eval-rows", type=int, default=d.eval_rows, help="held-out rows for the final evaluation")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    p.add_argument(
        "--resume", action="store_true", help="continue from OUTPUT/checkpoint (--stage data: continue the answer log)"
    )
    p.add_argument(
        "--init", metavar="ADAPTERS", help="warm start: begin from this adapters folder (its gates and rank)"
    )
    p.add_argument("--force", action="store_true", help="replace an existing OUTPUT folder")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--upload-repo",
        metavar="OWNER/NAME",
        help="after training, upload the adapters folder to this Hugging Face Hub model repo (created if "
        "needed; log in with `hf auth login` or set HF_TOKEN)",
    )
    return p
