"""Serve a loaded MoE model within an expert memory budget: what `m2r2-chat --memory-budget` does.

The experts are exported once into m2r2's cache folder (keyed by the model's folder), then
offloaded to a budgeted cache with a background loader and a predictor: next-layer
pre-gating by default, or M2R2's fast stream when adapters for the model are given.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from ..errors import M2R2Error
from ..registry import LoadedModel, cache_home
from .blocks import moe_blocks
from .cache import ExpertCache
from .link import Link
from .offload import offload_experts
from .predictors import PreGating
from .prefetch import Prefetcher
from .store import ExpertStore

PREDICTORS = ("pregating", "m2r2", "none")


def store_folder(lm: LoadedModel) -> Path:
    key = hashlib.sha256(str(lm.path.resolve()).encode()).hexdigest()[:12]
    return cache_home() / "experts" / f"{lm.path.name}-{key}"


def serve_with_budget(lm: LoadedModel, budget: str, *, predictor: str = "pregating", adapters=None,
                      link_gbps: float | None = None) -> ExpertCache:
    """Offload ``lm``'s experts to a cache of ``budget`` ("25%", "2GB", 0.25); returns the cache."""
    if not moe_blocks(lm.model):
        raise M2R2Error(f"--memory-budget applies to mixture-of-experts models (e.g. --model olmoe); "
                        f"{lm.name} has no experts")
    if predictor not in PREDICTORS:
        raise M2R2Error(f"unknown expert predictor {predictor!r}; choose from {', '.join(PREDICTORS)}")
    folder = store_folder(lm)
    if not (folder / "experts.json").exists():
        print(f"exporting {lm.name}'s experts to {folder} (once)", file=sys.stderr)
        ExpertStore.export(lm.model, folder)
    cache = offload_experts(lm.model, folder, budget, link=Link(link_gbps) if link_gbps else None)
    if predictor != "none":
        Prefetcher(cache)
        if predictor == "pregating":
            PreGating().attach(cache)
        else:
            from ..adapters import load_adapters
            from .fast_predictor import FastStreamPredictor

            if adapters is None:
                raise M2R2Error("--expert-predictor m2r2 needs --adapters trained on this model")
            FastStreamPredictor(load_adapters(lm, adapters)).attach(cache)
    return cache


def budget_line(cache: ExpertCache, width: int = 20) -> str:
    """'[█████░░░…] 25% · 1.2 MB' : the share of all experts held in memory."""
    total = sum(cache.num_experts(l) for l in cache.layers)
    held = sum(cache.slots_per_layer.values())
    fill = round(width * held / total)
    mb = cache.resident_bytes / 1e6
    return f"[{'█' * fill}{'░' * (width - fill)}] {100 * held / total:.0f}% · {mb:,.1f} MB"
