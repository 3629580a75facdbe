"""Memory-budgeted mixture-of-experts expert cache with ahead-of-time loading (docs/moe.md).

store = ExpertStore.export(model, "experts/")                      # once: experts to disk
cache = offload_experts(model, "experts/", "25%", planner=PrefetchPlanner())   # reads from the disk, direct
PreGating().attach(cache)                                           # optional: predicted experts read ahead
... decode as usual ...; cache.stats.summary(); cache.close()
(any predictor by name, with its planner: serve.offload_with_predictor, serve.serve_with_budget)
"""

from .baselines import LookaheadPredictor, NoPrediction, PreGating
from .blocks import moe_blocks, router
from .cache import ExpertCache, IOConfig, parse_budget, resolve_slots
from .offload import CachedSwitchGLU, offload_experts
from .planner import PlannerConfig, PrefetchPlanner
from .policies import LFU, LRU, make_policy
from .predictors import PREDICTORS, Predictor, PredictorEntry, PredictorInputs, build_predictor, get_predictor
from .stats import CacheStats, LayerStats
from .store import ExpertStore

__all__ = [
    "CacheStats",
    "CachedSwitchGLU",
    "ExpertCache",
    "ExpertStore",
    "IOConfig",
    "LFU",
    "LRU",
    "LayerStats",
    "LookaheadPredictor",
    "NoPrediction",
    "PREDICTORS",
    "PlannerConfig",
    "PreGating",
    "Predictor",
    "PredictorEntry",
    "PredictorInputs",
    "PrefetchPlanner",
    "build_predictor",
    "get_predictor",
    "make_policy",
    "moe_blocks",
    "offload_experts",
    "parse_budget",
    "resolve_slots",
    "router",
]
