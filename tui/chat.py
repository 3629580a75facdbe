"""m2r2-chat: chat with a model in the terminal, or print one answer with --prompt.

    m2r2-chat                                   # Textual chat on the embedded SmolLM2-135M
    m2r2-chat --model phi3                      # a hub model by alias (downloaded once)
    m2r2-chat --prompt "What is the capital of France?"   # one answer, no UI
"""

from __future__ import annotations

import argparse
import sys

import m2r2_mlx  # noqa: F401  (preloads OpenBLAS on Linux before mlx.core)
from m2r2_mlx.decoding.decoders import DEFAULT_DRAFT, DEFAULT_DRAFT_VOCAB, DEFAULT_THRESHOLD, MODE_HELP, MODES
from m2r2_mlx.decoding.stats import AnswerStats
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.models.blas import blas_info
from m2r2_mlx.models.registry import ALIASES, DEFAULT_MODEL, load_model, resolve_model_path

from .app import ChatApp
from .session import generation_options, make_session


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="m2r2-chat", description="Chat with an MLX model; every token is coloured by its exit depth."
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"alias ({', '.join(ALIASES)}), Hugging Face repo id, local folder or .gguf file (default: "
             f"{DEFAULT_MODEL}, embedded)",
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="plain",
        help="; ".join(f"{m}: {h}" for m, h in MODE_HELP.items()) + " (default: plain)",
    )
    p.add_argument(
        "--adapters", default=None, help="M2R2 adapters folder (default: the packaged ones for the embedded model)"
    )
    p.add_argument(
        "--gate", type=int, default=None, help="exit layer that drafts come from (default: the adapters' first gate)"
    )
    p.add_argument(
        "--draft",
        type=int,
        default=DEFAULT_DRAFT,
        help=f"most drafted tokens per verification step (default: {DEFAULT_DRAFT})",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        help=f"stop drafting when a draft's probability falls below this (default: {DEFAULT_THRESHOLD}; 0 = never)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help=f"score drafts over the model's N most frequent tokens only (default: {DEFAULT_DRAFT_VOCAB} "
        "where the adapters have draft_vocab.json; 0 = the full LM head)",
    )
    p.add_argument(
        "--tau",
        type=float,
        default=0.9,
        help="early-exit threshold at the first gate; deeper gates ask more, in proportion to the compute "
        "they still save (default: 0.9)",
    )
    p.add_argument("--flat-tau", action="store_true", help="early exit: the same --tau at every gate")
    p.add_argument("--prompt", help="print the answer to this prompt and exit (no terminal UI)")
    p.add_argument("--max-tokens", type=int, default=512, help="most tokens per answer (default: 512)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--system-prompt", default=None, help="system prompt (default: the model's own)")
    p.add_argument(
        "--memory-budget",
        default=None,
        metavar="B",
        help="MoE models: keep only this much of the experts in memory, e.g. 25%% or 2GB (default: all)",
    )
    p.add_argument(
        "--expert-predictor",
        default="pregating",
        choices=["pregating", "m2r2", "none"],
        help="with --memory-budget: who loads experts ahead of time (m2r2 needs --adapters for the model)",
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="with --memory-budget: throttle expert loads to this many GB/s (emulates a discrete GPU)",
    )
    return p


def check_args(args: argparse.Namespace) -> None:
    if args.draft < 1:
        raise M2R2Error(f"--draft must be at least 1 (got {args.draft})")
    if args.max_tokens < 1:
        raise M2R2Error(f"--max-tokens must be at least 1 (got {args.max_tokens})")
    if args.temp < 0:
        raise M2R2Error(f"--temp must be 0 (greedy) or positive (got {args.temp})")
    if not 0 <= args.tau <= 1.5:
        raise M2R2Error(f"--tau must be in [0, 1] (above 1 never exits; got {args.tau})")
    if not 0 <= args.threshold <= 1:
        raise M2R2Error(f"--threshold must be in [0, 1] (got {args.threshold})")
    if args.draft_vocab is not None and args.draft_vocab < 0:
        raise M2R2Error(f"--draft-vocab must be 0 (the full head) or a positive count (got {args.draft_vocab})")
    if not 0 < args.top_p <= 1:
        raise M2R2Error(f"--top-p must be in (0, 1] (got {args.top_p})")


def one_shot(args: argparse.Namespace) -> int:

    lm = load_model(args.model)
    session = make_session(args, lm)
    stats = AnswerStats()
    for ev in session.send(args.prompt, **generation_options(args)):
        stats.add(ev)
        sys.stdout.write(ev.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    experts = ""
    if session.expert_cache is not None:
        c = session.expert_cache.stats
        experts = f" | experts: {c.hit_rate:.0%} hit, {c.bytes_per_token / 1e6:.2f} MB/token moved"
        session.expert_cache.close()  # stop the expert loader thread
    print(f"[{lm.name} | {args.mode} | {stats.summary()}{experts} | {blas_info().name} BLAS]", file=sys.stderr)
    return 0


def _main() -> int:
    args = build_parser().parse_args()
    check_args(args)
    if args.prompt is not None:
        return one_shot(args)
    resolve_model_path(args.model)  # bad names fail here with one line; a first import shows progress
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise M2R2Error('no terminal to draw the chat in; pass --prompt "..." for a one-shot answer')
    ChatApp(args).run()
    return 0


def main() -> None:
    sys.exit(run_cli("m2r2-chat", _main))


if __name__ == "__main__":
    main()
