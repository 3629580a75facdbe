"""Memory-budgeted mixture-of-experts expert cache with ahead-of-time loading (docs/moe.md).

store = ExpertStore.export(model, "experts/")          # once: experts to disk
cache = offload_experts(model, "experts/", "25%", policy="lru", link=Link(16, 0.01))
Prefetcher(cache); PreGating().attach(cache)            # optional: predicted experts in the background
... decode as usual ...; cache.stats.summary()
"""

from .blocks import moe_blocks, router
from .cache import ExpertCache, parse_budget, resolve_slots
from .link import Link
from .offload import CachedSwitchGLU, offload_experts
from .policies import LFU, LRU, make_policy
from .predictors import Oracle, Predictor, PreGating, ShuffledControl
from .prefetch import Prefetcher
from .stats import CacheStats, LayerStats
from .store import ExpertStore

__all__ = [
    "CacheStats",
    "CachedSwitchGLU",
    "ExpertCache",
    "ExpertStore",
    "LFU",
    "LRU",
    "LayerStats",
    "Link",
    "Oracle",
    "PreGating",
    "Predictor",
    "Prefetcher",
    "ShuffledControl",
    "make_policy",
    "moe_blocks",
    "offload_experts",
    "parse_budget",
    "resolve_slots",
    "router",
]
