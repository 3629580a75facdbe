"""The methods m2r2-bench compares, each a Decoder built from the run's settings, and one question's turns
decoded as a chat."""

from __future__ import annotations

import time
from dataclasses import dataclass

from m2r2_mlx.decoding.chat import ChatSession
from m2r2_mlx.decoding.config import DRAFT_DEFAULTS, DecodeConfig, GenerationConfig
from m2r2_mlx.decoding.decoders import make_decoder
from m2r2_mlx.decoding.protocols import Decoder
from m2r2_mlx.decoding.stats import AnswerStats
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.models.registry import load_model

import mlx.core as mx

from .peers import MlxLmDecoder

METHODS = ("plain", "plain-compiled", "mlx-lm", "speculative", "fast", "layerskip", "lookup", "mlx-lm-spec")
LABELS = {
    "plain": "plain (ours)",
    "plain-compiled": "plain, --compile",
    "mlx-lm": "mlx-lm stream_generate",
    "speculative": "M2R2 speculative (lookup + fast stream, cost planner)",
    "fast": "M2R2 fast stream alone",
    "layerskip": "naive layer-skip",
    "lookup": "prompt lookup",
    "mlx-lm-spec": "mlx-lm 2-model speculative",
}


@dataclass(frozen=True)
class MethodSettings:
    adapters: str | None = None
    gate: int | None = None
    max_draft: int | None = None
    threshold: float | None = None  # fast and layerskip
    draft_vocab: int | None = None
    draft_model: str | None = None  # mlx-lm-spec's


def method_names(methods: str, draft_model: str | None = None) -> list[str]:
    """The comma-separated ``methods``, checked; plain always runs (every speedup is over plain in the same run)."""
    names = [m.strip() for m in methods.split(",") if m.strip()]
    if draft_model and "mlx-lm-spec" not in names:
        names.append("mlx-lm-spec")
    bad = [m for m in names if m not in METHODS]
    if bad:
        raise M2R2Error(f"unknown methods {bad}; choose from {', '.join(METHODS)}")
    if "mlx-lm-spec" in names and not draft_model:
        raise M2R2Error("mlx-lm-spec needs --draft-model (a small model sharing the tokenizer)")
    return names if "plain" in names else ["plain", *names]


def make_method(lm, name: str, s: MethodSettings) -> Decoder:
    if name == "mlx-lm":
        return MlxLmDecoder(lm)
    if name == "mlx-lm-spec":
        return MlxLmDecoder(lm, load_model(s.draft_model).model, s.max_draft or DRAFT_DEFAULTS["always"].max_draft)
    if name == "plain-compiled":
        return make_decoder(lm, DecodeConfig(compile=True))
    if name == "speculative":  # what --mode speculative does by default: lookup and the fast stream, cost planner
        config = DecodeConfig("speculative", gate=s.gate, max_draft=s.max_draft, draft_vocab=s.draft_vocab)
        return make_decoder(lm, config, s.adapters)
    if name == "plain":
        return make_decoder(lm, "plain")
    # every proposal verified: the fast stream alone, naive layer skip, prompt lookup
    mode = {"fast": "speculative"}.get(name, name)
    threshold = 0.0 if mode == "lookup" else s.threshold
    config = DecodeConfig(
        mode,
        gate=s.gate,
        drafter="fast",
        planner="always",
        max_draft=s.max_draft,
        threshold=threshold,
        draft_vocab=s.draft_vocab if mode != "lookup" else 0,
    )
    return make_decoder(lm, config, s.adapters)


def make_methods(lm, names: list[str], settings: MethodSettings) -> dict[str, Decoder]:
    return {name: make_method(lm, name, settings) for name in names}


def run_turns(lm, decode: Decoder, turns: list[str], generation: GenerationConfig) -> list[dict]:
    """One question as a chat; per turn: tokens, text, decode rate, acceptance lengths, peak memory."""
    session = ChatSession(lm, decoder=decode)
    out = []
    for text in turns:
        mx.reset_peak_memory()
        stats, times, tokens = AnswerStats(), [], []
        t0 = time.perf_counter()
        for ev in session.send(text, generation):
            times.append(time.perf_counter())
            tokens.append(ev.token)
            stats.add(ev)
        decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
        out.append(
            {
                "tokens": tokens,
                "text": session.last_answer,
                "new_tokens": len(tokens),
                "wall_time": time.perf_counter() - t0,
                "decode_time": decode_s,
                "accept_lengths": stats.accept_lengths,
                "drafted_by": dict(stats.drafted_by),
                "exit_layers": stats.exit_layers,
                "layer_passes": stats.layer_passes,
                "peak_memory_gb": mx.get_peak_memory() / 1e9,
            }
        )
    return out
