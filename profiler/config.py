"""What one m2r2-profile run is asked to do, checked before any model is loaded: each bad value is one line."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from m2r2_mlx.decoding.methods import resolve_for_method
from m2r2_mlx.decoding.options import DecodingOptions
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.moe.cache import parse_budget
from m2r2_mlx.moe.serve import ExpertBudget

import mlx.core as mx

DEFAULT_PROMPT = "Explain how a CPU cache works, and why it makes programs faster. Keep it short."
DEFAULT_TOKENS = 64


@dataclass(frozen=True)
class ProfileConfig:
    model: str  # resolved from the names given (methods.resolve_for_method)
    adapters: str | None
    options: DecodingOptions  # the method and its settings; generation.max_tokens is --tokens
    prompt: str
    out: Path | None = None  # summaries, the table and the PNG
    trace: Path | None = None  # the Chrome trace-event JSON
    experts: ExpertBudget | None = None
    metal_capture: Path | None = None
    repeats: int = 1  # decodes each way, alternating; the fastest of each is reported


def check_metal_capture(path: Path | None) -> None:
    """Metal capture needs a Mac, and Metal reads MTL_CAPTURE_ENABLED when the process starts."""
    if path is None:
        return
    if sys.platform != "darwin" or not mx.metal.is_available():
        raise M2R2Error(
            f"--metal-capture needs a Mac (Metal); this machine runs MLX on its {mx.default_device().type.name}: "
            "open the --trace file in ui.perfetto.dev instead"
        )
    if os.environ.get("MTL_CAPTURE_ENABLED") != "1":
        raise M2R2Error(
            "--metal-capture needs MTL_CAPTURE_ENABLED=1 set before the start: MTL_CAPTURE_ENABLED=1 m2r2-profile ..."
        )
    if path.suffix != ".gputrace":
        raise M2R2Error(f"--metal-capture writes an Xcode .gputrace document; name it FILE.gputrace (got {path})")
    if path.exists():
        raise M2R2Error(f"{path} already exists and Metal will not overwrite it; remove it or choose another name")
    if not path.parent.is_dir():
        raise M2R2Error(f"the folder of --metal-capture {path} does not exist; create it or choose another path")


def check_trace(path: Path | None) -> None:
    if path is not None and not path.parent.is_dir():
        raise M2R2Error(f"the folder of --trace {path} does not exist; create {path.parent} or choose another path")


def profile_config(values: dict) -> ProfileConfig:
    """From the command line's values (an options dict); the model and adapters are decided from names alone, so a
    method that needs adapters the model lacks fails here, before any download."""
    tokens = values["tokens"]
    if tokens < 1:
        raise M2R2Error(f"--tokens must be at least 1 (got {tokens}): the profile needs a step to measure")
    repeats = values.get("repeats", 1)
    if repeats < 1:
        raise M2R2Error(f"--repeats must be at least 1 (got {repeats})")
    options = DecodingOptions.from_values({**values, "max_tokens": tokens})
    if options.decode.compile:
        raise M2R2Error(
            "--compile fuses each step into one graph, which cannot be split by component; profile without it "
            "(its speed against plain decoding: docs/benchmarks.md)"
        )
    trace = Path(values["trace"]) if values.get("trace") else None
    check_trace(trace)
    capture = Path(values["metal_capture"]) if values.get("metal_capture") else None
    check_metal_capture(capture)
    experts = None
    if values.get("memory_budget") is not None:
        parse_budget(values["memory_budget"])  # one line for a bad budget, before loading anything
        experts = ExpertBudget(values["memory_budget"], values["expert_predictor"])
    model, folder = resolve_for_method(values["model"], values["adapters"], options.decode.method)
    out = Path(values["out"]) if values.get("out") else None
    return ProfileConfig(
        model, None if folder is None else str(folder), options, values["prompt"], out, trace, experts, capture, repeats
    )
