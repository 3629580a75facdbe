"""Serve a loaded MoE model within an expert memory budget: what `m2r2-chat --memory-budget` does.

The experts are exported once into m2r2's cache folder (keyed by the model's folder), then offloaded to a budgeted
cache that reads them from the disk (direct reads, loader.py) with a predictor loading ahead: next-layer
pre-gating by default, the lookahead maps where they are fitted, or M2R2's fast stream when adapters for the model
are given.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

from ..core.adapters import load_adapters
from ..errors import M2R2Error
from ..models.registry import LoadedModel, cache_home
from ..tracing import NO_TRACE, Tracer
from .blocks import moe_blocks
from .budget import resolve_slots
from .cache import ExpertCache, parse_budget
from .lookahead import LookaheadAdapters
from .offload import offload_experts
from .planner import PrefetchPlanner
from .predictors import PREDICTORS, Predictor, PredictorEntry, PredictorInputs, build_predictor, get_predictor
from .store import ExpertStore


@dataclass(frozen=True)
class ExpertBudget:
    """MoE models within a memory budget (``--memory-budget``) and who loads experts ahead of time
    (``--expert-predictor``): m2r2-chat's, m2r2-server's and m2r2-profile's."""

    budget: str
    predictor: str = "pregating"


def store_folder(lm: LoadedModel) -> Path:
    """Where this model's experts are exported: keyed by its folder and its weight files (name, size,
    mtime), so a rebuilt or re-downloaded model gets a fresh export instead of stale experts."""
    files = sorted(lm.path.resolve().glob("*.safetensors"))
    ident = [str(lm.path.resolve())] + [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    key = hashlib.sha256("\n".join(ident).encode()).hexdigest()[:12]
    return cache_home() / "experts" / f"{lm.path.name}-{key}"


def exported_store(lm: LoadedModel, folder: Path | None = None) -> ExpertStore:
    """``lm``'s expert store in ``folder`` (default ``store_folder``), exported there first if it is not (or is
    of an older format)."""
    folder = folder or store_folder(lm)
    if not ExpertStore.finished(folder):
        print(f"exporting {lm.name}'s experts to {folder} (once)", file=sys.stderr)
        # layer by layer, each released once written: a lazily loaded model never holds all its experts
        store = ExpertStore.export(lm.model, folder, force=True, release=True, reuse_finished=True)
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        print(f"exported {len(store.layers)} MoE layers' experts: {size / 1e9:.2f} GB", file=sys.stderr)
    return ExpertStore.open(folder)


def serve_with_budget(
    lm: LoadedModel, budget: str, *, predictor: str = "pregating", adapters=None, tracer: Tracer = NO_TRACE
) -> ExpertCache:
    """Offload ``lm``'s experts to a cache of ``budget`` ("25%", "2GB", 0.25) with the named predictor attached;
    returns the cache (its waits for loads run through ``tracer``, as "expert-stall")."""
    if not moe_blocks(lm.model):
        raise M2R2Error(
            f"--memory-budget applies to mixture-of-experts models (e.g. --model olmoe); {lm.name} has no experts"
        )
    entry = get_predictor(predictor)
    parse_budget(budget)  # bad input fails before the (possibly long) export
    m2r2 = None
    if entry.needs_adapters:
        if adapters is None:
            raise M2R2Error(f"--expert-predictor {predictor} needs --adapters trained on this model")
        m2r2 = load_adapters(lm, adapters)
    store = exported_store(lm)
    lookahead = LookaheadAdapters.load(lm.path) if entry.needs_lookahead else None
    cache, _ = offload_with_predictor(lm.model, store, budget, entry, PredictorInputs(m2r2, lookahead), tracer=tracer)
    return cache


def offload_with_predictor(
    model, store: ExpertStore, budget, entry: PredictorEntry, inputs: PredictorInputs = PredictorInputs(), **cache
) -> tuple[ExpertCache, Predictor]:
    """``model``'s experts served from ``store`` within ``budget`` (``offload_experts``, with ``cache``'s
    arguments) and ``entry``'s predictor attached, with a planner where the entry is planned. A budget that holds
    every expert loads nothing: predicting there only costs, so it gets no predictor."""
    if all(s >= store.num_experts(l) for l, s in resolve_slots(budget, store).items()):
        entry = PREDICTORS["none"]
    predictor = build_predictor(entry, inputs)  # what it needs is checked before anything is built
    planner = PrefetchPlanner() if entry.planned else None
    built = offload_experts(model, store, budget, planner=planner, **cache)
    return built, predictor.attach(built)


def budget_line(cache: ExpertCache, width: int = 20) -> str:
    """'[█████░░░…] 25% · 1.2 MB' : the share of all experts held in memory."""
    total = sum(cache.num_experts(l) for l in cache.layers)
    held = sum(cache.slots_per_layer.values())
    fill = round(width * held / total)
    mb = cache.resident_bytes / 1e6
    return f"[{'█' * fill}{'░' * (width - fill)}] {100 * held / total:.0f}% · {mb:,.1f} MB"
