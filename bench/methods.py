"""The methods m2r2-bench compares, each a Decoder built from the run's settings, and one question's turns
decoded as a chat."""

from __future__ import annotations

import time
from dataclasses import dataclass

from m2r2_mlx.decoding.chat import ChatSession
from m2r2_mlx.decoding.config import DecodeConfig, GenerationConfig
from m2r2_mlx.decoding.drafters import ForcedDrafter
from m2r2_mlx.decoding.methods import DRAFTERS, PLANNERS, make_decoder, speculative_engine
from m2r2_mlx.decoding.methods import METHODS as USER_METHODS
from m2r2_mlx.decoding.protocols import Decoder
from m2r2_mlx.decoding.stats import AnswerStats
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.models.registry import load_model

import mlx.core as mx

from .peers import MlxLmDecoder

# the methods a user picks (m2r2_mlx.decoding.methods.METHODS), then the baselines only the bench runs
BASELINES = {
    "plain-compiled": "plain, --compile",
    "mlx-lm": "mlx-lm stream_generate",
    "layerskip": "naive layer-skip (the slow state's own exit drafts, every draft verified)",
    "mlx-lm-spec": "mlx-lm 2-model speculative",
}
BENCH_METHODS = (*USER_METHODS, *BASELINES)
LABELS = {
    "plain": "plain (ours)",
    "speculative": "M2R2 speculative (lookup + fast stream, cost planner)",
    "lookup": "prompt lookup",
    "fast": "M2R2 fast stream alone",
    "early-exit": "M2R2 early exit (lossy)",
    **BASELINES,
}
LOSSLESS = tuple(name for name in BENCH_METHODS if name not in USER_METHODS or USER_METHODS[name].lossless)


@dataclass(frozen=True)
class MethodSettings:
    adapters: str | None = None
    gate: int | None = None
    max_draft: int | None = None
    threshold: float | None = None  # fast and layerskip
    draft_vocab: int | None = None
    draft_model: str | None = None  # mlx-lm-spec's
    tau: float | None = None  # early-exit (None: its default)


def method_names(methods: str, draft_model: str | None = None) -> list[str]:
    """The comma-separated ``methods``, checked; plain always runs (every speedup is over plain in the same run)."""
    names = [m.strip() for m in methods.split(",") if m.strip()]
    if draft_model and "mlx-lm-spec" not in names:
        names.append("mlx-lm-spec")
    bad = [m for m in names if m not in BENCH_METHODS]
    if bad:
        raise M2R2Error(f"unknown methods {bad}; choose from {', '.join(BENCH_METHODS)}")
    if "mlx-lm-spec" in names and not draft_model:
        raise M2R2Error("mlx-lm-spec needs --draft-model (a small model sharing the tokenizer)")
    return names if "plain" in names else ["plain", *names]


def layerskip(lm, config: DecodeConfig, adapters: str | None) -> Decoder:
    """The naive self-speculative baseline: the slow state's own exit at the first gate drafts, as the fast
    method's settings (every draft verified, the same draft length and threshold)."""
    fast = USER_METHODS["fast"]
    threshold = fast.threshold if config.threshold is None else config.threshold
    drafter = DRAFTERS["layerskip"](lm, config, adapters, threshold)
    planner = PLANNERS["verify-all"](lm, [ForcedDrafter(), drafter])
    return speculative_engine(lm, [drafter], planner, max_draft=config.max_draft or fast.max_draft, name="layerskip")


def make_method(lm, name: str, s: MethodSettings) -> Decoder:
    if name == "mlx-lm":
        return MlxLmDecoder(lm)
    if name == "mlx-lm-spec":
        return MlxLmDecoder(lm, load_model(s.draft_model).model, s.max_draft or USER_METHODS["lookup"].max_draft)
    tau = {} if s.tau is None else {"tau": s.tau}
    config = DecodeConfig(
        "plain" if name in ("plain-compiled", "layerskip") else name,
        gate=s.gate,
        max_draft=s.max_draft,
        threshold=s.threshold,
        draft_vocab=s.draft_vocab,
        compile=name == "plain-compiled",
        **tau,
    )
    if name == "layerskip":
        return layerskip(lm, config, s.adapters)
    return make_decoder(lm, config, s.adapters)


def make_methods(lm, names: list[str], settings: MethodSettings) -> dict[str, Decoder]:
    return {name: make_method(lm, name, settings) for name in names}


def agreement(lm, sequence: list[int], answer: list[int]) -> tuple[int, int]:
    """(answer tokens equal to the full model's greedy token on the same prefix, answer tokens checked): the
    quality of a lossy method's answer, teacher-forced (``sequence``: the cache's tokens after the answer, which
    end with the answer but its last token)."""
    start = len(sequence) - (len(answer) - 1)  # where the answer begins: its first token predicts its second
    if len(answer) < 2:
        return 0, 0
    logits = lm.model(mx.array(sequence)[None])[0, start:]
    best = mx.argmax(logits, axis=-1).tolist()
    return sum(int(b == a) for b, a in zip(best, answer[1:])), len(answer) - 1


def run_turns(lm, decode: Decoder, turns: list[str], generation: GenerationConfig) -> list[dict]:
    """One question as a chat; per turn: tokens, text, decode rate, acceptance lengths, peak memory, layers skipped,
    and for a lossy method its agreement with the full model."""
    session = ChatSession(lm, decoder=decode)
    lossy = decode.name in USER_METHODS and not USER_METHODS[decode.name].lossless
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
        wall = time.perf_counter() - t0
        out.append(
            {
                "tokens": tokens,
                "text": session.last_answer,
                "new_tokens": len(tokens),
                "wall_time": wall,
                "decode_time": decode_s,
                "accept_lengths": stats.accept_lengths,
                "drafted_by": dict(stats.drafted_by),
                "exit_layers": stats.exit_layers,
                "layer_passes": stats.layer_passes,
                "layers_skipped": stats.layers_skipped,
                "agreement": agreement(lm, session.cache.tokens, tokens) if lossy else None,
                "peak_memory_gb": mx.get_peak_memory() / 1e9,
            }
        )
    return out
