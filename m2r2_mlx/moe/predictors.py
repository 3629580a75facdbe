"""Who predicts which experts the next layers will need: the ``Predictor`` protocol, and ``PREDICTORS``, the one
registry of predictors a user can pick by name (`m2r2-chat --expert-predictor`, ``serve_with_budget``, `m2r2-bench
--moe`). A new predictor is one entry here; the bench registers its measurement controls beside these
(bench/moe_controls.py).

A predictor is built unattached from ``PredictorInputs`` (what some predictors need: M2R2 adapters, lookahead maps),
then ``attach(cache)`` hooks it into an ``ExpertCache``: it asks ``cache.prefetch`` for the experts of layers the
forward pass has not reached yet. ``detach()`` unhooks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

from ..core.fast_stream import M2R2Model
from ..errors import M2R2Error
from .baselines import NoPrediction, PreGating
from .cache import ExpertCache
from .fast_predictor import FastStreamPredictor
from .fused_predictor import FusedPredictor
from .lookahead import DEFAULT_FIT, LookaheadAdapterPredictor, LookaheadAdapters


@runtime_checkable
class Predictor(Protocol):
    """Names experts ahead of the forward pass, through the cache it is attached to."""

    # layer passes (or fused rows) its fast stream ran since the counter was last zeroed; None: it runs none
    fast_layer_passes: int | None

    def attach(self, cache: ExpertCache) -> Predictor:
        """Start predicting for ``cache``'s forward passes; returns itself."""
        ...

    def detach(self) -> None:
        """Stop predicting; the model and cache are as before ``attach``."""
        ...

    def own_modules(self) -> list:
        """The module trees it runs beside the model (its own weights): what a device clock meters with it."""
        ...


@dataclass(frozen=True)
class PredictorInputs:
    m2r2: M2R2Model | None = None  # adapters trained on the model (entries that need_adapters)
    lookahead: LookaheadAdapters | None = None  # fitted to the model (entries that need_lookahead)


@dataclass(frozen=True)
class PredictorEntry:
    name: str
    label: str  # how tables and plots name it
    help: str
    build: Callable[[PredictorInputs], Predictor]  # unattached
    needs_adapters: bool = False
    needs_lookahead: bool = False  # lookahead adapters fitted to the model (lookahead.py)
    planned: bool = False  # a PrefetchPlanner (planner.py) loads only the predictions expected to pay


PREDICTORS: dict[str, PredictorEntry] = {
    e.name: e
    for e in (
        PredictorEntry(
            "pregating",
            "pre-gating (next layer)",
            "the next layer's router on this layer's input (the slow state as a stand-in for its own)",
            lambda i: PreGating(),
        ),
        PredictorEntry(
            "pregating-planned",
            "pre-gating (next layer), planned",
            "pre-gating's predictions, loaded only where the prefetch planner expects them to pay",
            lambda i: PreGating(),
            planned=True,
        ),
        PredictorEntry(
            "lookahead",
            f"lookahead maps ({DEFAULT_FIT.lead} layers ahead, {DEFAULT_FIT.depth} read), planned",
            f"a linear map per layer from the router inputs of {DEFAULT_FIT.depth} MoE layers, the nearest "
            f"{DEFAULT_FIT.lead} earlier (across the token boundary); planned (fitted to the model: python -m "
            "m2r2_mlx.moe lookahead MODEL)",
            lambda i: LookaheadAdapterPredictor(i.lookahead),
            needs_lookahead=True,
            planned=True,
        ),
        PredictorEntry(
            "fast",
            "M2R2 fast stream, run ahead",
            "M2R2's fast stream runs each gate interval ahead of the slow one; its exit state feeds the next "
            "interval's routers; planned (needs adapters for the model)",
            lambda i: FastStreamPredictor(i.m2r2),
            needs_adapters=True,
            planned=True,
        ),
        PredictorEntry(
            "fast-fused",
            "M2R2 fast stream, fused rows",
            "M2R2's fast stream as a second row of the slow stream's own layer calls; planned (needs bottleneck "
            "adapters)",
            lambda i: FusedPredictor(i.m2r2),
            needs_adapters=True,
            planned=True,
        ),
        PredictorEntry(
            "none",
            "on demand",
            "no prediction: experts load when the router picks them",
            lambda i: NoPrediction(),
        ),
    )
}


def get_predictor(name: str, registry: dict[str, PredictorEntry] = PREDICTORS) -> PredictorEntry:
    try:
        return registry[name]
    except KeyError:
        raise M2R2Error(f"unknown expert predictor {name!r}; choose from {', '.join(registry)}") from None


def build_predictor(entry: PredictorEntry, inputs: PredictorInputs | None = None) -> Predictor:
    """``entry``'s predictor, unattached; what it needs is checked first, in one line."""
    inputs = inputs or PredictorInputs()
    if entry.needs_adapters and inputs.m2r2 is None:
        raise M2R2Error(f"the {entry.name} expert predictor needs M2R2 adapters trained on the model")
    if entry.needs_lookahead and inputs.lookahead is None:
        raise M2R2Error(f"the {entry.name} expert predictor needs lookahead adapters fitted to the model")
    return entry.build(inputs)
