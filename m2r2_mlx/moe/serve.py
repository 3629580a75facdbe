"""Serve a loaded MoE model within an expert memory budget: what `m2r2-chat --memory-budget` does.

The experts are exported once into m2r2's cache folder (keyed by the model's folder), then
offloaded to a budgeted cache with a background loader and a predictor: next-layer
pre-gating by default, or M2R2's fast stream when adapters for the model are given.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

from ..core.adapters import load_adapters
from ..core.fast_stream import M2R2Model
from ..errors import M2R2Error
from ..models.registry import LoadedModel, cache_home
from .blocks import moe_blocks
from .cache import ExpertCache, parse_budget
from .link import Link
from .lookahead import LookaheadAdapters
from .offload import offload_experts
from .planner import PrefetchPlanner
from .predictors import Predictor, PredictorInputs, build_predictor, get_predictor
from .prefetch import DevicePrefetcher, Prefetcher
from .store import ExpertStore


@dataclass(frozen=True)
class ExpertBudget:
    """MoE models within a memory budget (``--memory-budget``): who loads experts ahead of time, and an emulated
    link's speed; m2r2-chat's, m2r2-server's and m2r2-profile's."""

    budget: str
    predictor: str = "pregating"
    link_gbps: float | None = None


def store_folder(lm: LoadedModel) -> Path:
    """Where this model's experts are exported: keyed by its folder and its weight files (name, size,
    mtime), so a rebuilt or re-downloaded model gets a fresh export instead of stale experts."""
    files = sorted(lm.path.resolve().glob("*.safetensors"))
    ident = [str(lm.path.resolve())] + [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    key = hashlib.sha256("\n".join(ident).encode()).hexdigest()[:12]
    return cache_home() / "experts" / f"{lm.path.name}-{key}"


def exported_store(lm: LoadedModel, folder: Path | None = None) -> ExpertStore:
    """``lm``'s expert store in ``folder`` (default ``store_folder``), exported there first if it is not."""
    folder = folder or store_folder(lm)
    if not ExpertStore.finished(folder):
        print(f"exporting {lm.name}'s experts to {folder} (once)", file=sys.stderr)
        # layer by layer, each released once written: a lazily loaded model never holds all its experts
        store = ExpertStore.export(lm.model, folder, force=True, release=True)
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        print(f"exported {len(store.layers)} MoE layers' experts: {size / 1e9:.2f} GB", file=sys.stderr)
    return ExpertStore.open(folder)


def serve_with_budget(
    lm: LoadedModel, budget: str, *, predictor: str = "pregating", adapters=None, link_gbps: float | None = None
) -> ExpertCache:
    """Offload ``lm``'s experts to a cache of ``budget`` ("25%", "2GB", 0.25); returns the cache."""
    if not moe_blocks(lm.model):
        raise M2R2Error(
            f"--memory-budget applies to mixture-of-experts models (e.g. --model olmoe); {lm.name} has no experts"
        )
    entry = get_predictor(predictor)
    if entry.needs_trace:
        raise M2R2Error(f"--expert-predictor {predictor} replays a recorded run; serving has none to replay")
    parse_budget(budget)  # bad input fails before the (possibly long) export
    m2r2 = None
    if entry.needs_adapters:
        if adapters is None:
            raise M2R2Error(f"--expert-predictor {predictor} needs --adapters trained on this model")
        m2r2 = load_adapters(lm, adapters)
    store = exported_store(lm)
    lookahead = LookaheadAdapters.load(lm.path) if entry.needs_lookahead else None
    cache = offload_experts(lm.model, store, budget, link=Link(link_gbps) if link_gbps is not None else None)
    attach_predictor(cache, predictor, m2r2, lookahead=lookahead)
    return cache


def attach_predictor(
    cache: ExpertCache,
    predictor: str,
    m2r2: M2R2Model | None = None,
    intervals: int | None = None,
    trace: dict[tuple[int, int], list[int]] | None = None,
    lookahead=None,
) -> Predictor:
    """The named predictor (predictors.PREDICTORS) attached to ``cache``, with a background loader where it loads
    ahead. ``m2r2``: the loaded adapters, for the M2R2 predictors; ``intervals``: how many gate intervals the
    run-ahead fast stream runs in (default all); ``trace``: the recorded run the oracle replays; ``lookahead``: the
    model's lookahead adapters (lookahead.py). A cache that holds every expert loads nothing: predicting there
    only costs, so it gets no predictor."""
    entry = get_predictor(predictor)  # an unknown name is one line, whatever the budget
    if cache.holds_every_expert:
        predictor, entry = "none", get_predictor("none")
    built = build_predictor(
        predictor, PredictorInputs(m2r2=m2r2, intervals=intervals, trace=trace, lookahead=lookahead)
    )
    if entry.loads_ahead:
        (DevicePrefetcher if cache.clock.modelled else Prefetcher)(cache)
    if entry.planned:
        PrefetchPlanner().attach(cache)
    return built.attach(cache)


def budget_line(cache: ExpertCache, width: int = 20) -> str:
    """'[█████░░░…] 25% · 1.2 MB' : the share of all experts held in memory."""
    total = sum(cache.num_experts(l) for l in cache.layers)
    held = sum(cache.slots_per_layer.values())
    fill = round(width * held / total)
    mb = cache.resident_bytes / 1e6
    return f"[{'█' * fill}{'░' * (width - fill)}] {100 * held / total:.0f}% · {mb:,.1f} MB"
