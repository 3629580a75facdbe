"""Memory-budgeted mixture-of-experts expert cache with ahead-of-time loading (docs/moe.md).

store = ExpertStore.export(model, "experts/")          # once: experts to disk
cache = offload_experts(model, "experts/", "25%", policy="lru", link=Link(16, 0.01))
Prefetcher(cache); PreGating().attach(cache)            # optional: predicted experts in the background
PrefetchPlanner().attach(cache)                         # optional: load only the predictions that pay
                                                        # (any predictor by name: serve.attach_predictor)
... decode as usual ...; cache.stats.summary()
"""

from .baselines import LookaheadPredictor, NoPrediction, Oracle, PreGating, ShuffledControl
from .blocks import moe_blocks, router
from .cache import ExpertCache, parse_budget, resolve_slots
from .link import Link
from .offload import CachedSwitchGLU, offload_experts
from .planner import PlannerConfig, PrefetchPlanner
from .policies import LFU, LRU, make_policy
from .predictors import PREDICTORS, Predictor, PredictorEntry, PredictorInputs, build_predictor, get_predictor
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
    "LookaheadPredictor",
    "NoPrediction",
    "Oracle",
    "PREDICTORS",
    "PlannerConfig",
    "PreGating",
    "Predictor",
    "PredictorEntry",
    "PredictorInputs",
    "PrefetchPlanner",
    "Prefetcher",
    "ShuffledControl",
    "build_predictor",
    "get_predictor",
    "make_policy",
    "moe_blocks",
    "offload_experts",
    "parse_budget",
    "resolve_slots",
    "router",
]
