"""Decoding strategies by name, behind one call shape: ``decode(prompt, cache=, context_length=, **options)``."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable, Iterator

from .errors import M2R2Error
from .generate import TokenEvent, generate

MODES = ("plain", "speculative")
PACKAGED_ADAPTERS = Path(__file__).resolve().parent / "trained"

Decoder = Callable[..., Iterator[TokenEvent]]


def packaged_adapters(model_name: str | None) -> Path | None:
    """Adapters that ship with m2r2 for a model alias (today: the embedded smollm2)."""
    from .registry import DEFAULT_MODEL

    folder = PACKAGED_ADAPTERS / (model_name or DEFAULT_MODEL).lower()
    return folder if (folder / "m2r2_config.json").is_file() else None


def load_m2r2(lm, adapters: str | Path | None = None, mode: str = "this mode"):
    """The given adapters, else the packaged ones for the model; one clear line if there are none."""
    from .adapters import load_adapters

    folder = adapters or packaged_adapters(lm.name)
    if folder is None:
        raise M2R2Error(f"{mode} needs M2R2 adapters for {lm.name!r}; pass --adapters DIR (train them with m2r2-train)")
    return load_adapters(lm, folder)


def make_decoder(lm, mode: str = "plain", adapters: str | Path | None = None, *,
                 gate: int | None = None, max_draft: int = 6, threshold: float = 0.0) -> Decoder:
    """A decoder for ``lm``; M2R2 modes load ``adapters`` (default: the packaged ones for the model).

    ``gate`` is the exit layer drafts come from (one of the adapters' gates; default the first).
    """
    if mode == "plain":
        return partial(generate, lm.model, lm.tokenizer)
    if mode not in MODES:
        raise M2R2Error(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
    m2r2 = load_m2r2(lm, adapters, f"mode {mode!r}")
    gates = m2r2.config.gates
    gate = gates[0] if gate is None else gate
    if gate not in gates:
        raise M2R2Error(f"gate {gate} is not one of the adapters' gates {gates}")
    from .speculative import speculative_generate

    def speculative(prompt, *, temperature: float = 0.0, top_p: float = 1.0, seed=None, **kw):
        if temperature > 0:
            raise M2R2Error("speculative mode is greedy for now; use --temp 0, or --mode plain to sample")
        return speculative_generate(m2r2, lm.tokenizer, prompt, gate_index=gates.index(gate),
                                    max_draft=max_draft, threshold=threshold, **kw)

    speculative.exit_layers = [gate, lm.num_layers]  # for legends: where tokens can come from
    return speculative
