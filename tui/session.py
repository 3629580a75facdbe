"""From m2r2-chat's options to a decoder and a chat session: shared by the one-shot mode and the Textual app
(which also rebuilds the decoder when the mode or tau changes live)."""

from __future__ import annotations

import argparse

from m2r2_mlx.decoding.chat import ChatSession
from m2r2_mlx.decoding.decoders import make_decoder as decoder_for
from m2r2_mlx.moe.serve import serve_with_budget

from . import options


def generation_options(args: argparse.Namespace) -> dict:
    return options.generation_options(vars(args))


def make_decoder(args: argparse.Namespace, lm):
    """The decoder the options name (also when the TUI switches mode or tau)."""
    return decoder_for(lm, args.mode, args.adapters, **options.decoder_options(vars(args)))


def make_session(args: argparse.Namespace, lm):
    decoder = make_decoder(args, lm)
    expert_cache = None
    # the budget after the decoder: the M2R2 predictor wraps the layers, which would rename the projections
    # LoRA adapters attach to
    if args.memory_budget is not None:
        expert_cache = serve_with_budget(
            lm, args.memory_budget, predictor=args.expert_predictor, adapters=args.adapters, link_gbps=args.link_gbps
        )
    return ChatSession(
        lm,
        system_prompt=args.system_prompt,
        decoder=decoder,
        expert_cache=expert_cache,
        **options.cache_options(vars(args)),
    )
