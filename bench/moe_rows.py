"""One row of `m2r2-bench --moe`: a method at a budget, decoded on the wall clock or a device clock (moe_bench.py
runs the rows and writes the report)."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import m2r2_mlx  # noqa: F401  (fast BLAS before mlx)
from m2r2_mlx.core.adapters import load_adapters
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.moe import CacheStats, ExpertStore, Oracle, offload_experts
from m2r2_mlx.moe.clock import Clock, WallClock
from m2r2_mlx.moe.lookahead import ensure_lookahead
from m2r2_mlx.moe.metering import metered
from m2r2_mlx.moe.predictors import PREDICTORS
from m2r2_mlx.moe.prefetch import DevicePrefetcher, Prefetcher
from m2r2_mlx.moe.serve import attach_predictor

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

if TYPE_CHECKING:
    from .moe_bench import MoEBenchConfig

# offline bounds from the true routes (recorded by the first cached row of the same prompts): they run last
BOUNDS = ("belady", "oracle")
ORACLE_LOOKAHEAD = 4  # MoE layers the true-routes prefetch runs ahead (into the next token's first layers)
DEVICE_KEYS = ("tokens_per_s", "stall_ms_per_token", "hit_rate", "loads_per_token", "mb_per_token", "decode_s")


@dataclass
class BenchRun:
    """What every row of one run shares: the config, the expert store, the prompts, the all-resident tokens each
    row is checked against (filled by the resident row) and each prompt's routes (recorded by the first cached
    row, replayed by the bound rows)."""

    config: MoEBenchConfig
    store: ExpertStore
    prompts: list[np.ndarray]
    reference: dict[int, list[int]] = field(default_factory=dict)
    traces: list[dict] = field(default_factory=list)


def greedy(model, prompt: np.ndarray, n: int, on_prefilled=None, clock: Clock = WallClock()) -> tuple[list[int], float]:
    """Greedy tokens and the decode time on ``clock`` (prefill excluded)."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt[None].astype(np.int32)), cache=cache)
    tok = int(mx.argmax(logits[0, -1]).item())
    if on_prefilled:
        on_prefilled()
    out, start = [tok], clock.now()
    for _ in range(n - 1):
        logits = model(mx.array([[tok]]), cache=cache)
        tok = int(mx.argmax(logits[0, -1]).item())
        if clock.modelled:
            clock.sync()  # the token read back
        out.append(tok)
    return out, clock.now() - start


def setup(run: BenchRun, method: str, budget: float, link, clock: Clock):
    """A freshly loaded model with this method's cache and predictor; returns (model, cache, predictor)."""
    config = run.config
    lm = load_model(config.model, tokenizer=False)  # token ids in, token ids out
    if method == "resident":
        return lm.model, None, None
    cache = offload_experts(lm.model, run.store, budget / 100, policy=config.policy, link=link, clock=clock)
    if method == "belady":
        return lm.model, cache, attach_predictor(cache, "none")
    if method == "oracle":
        oracle = Oracle(run.traces[0], lookahead=ORACLE_LOOKAHEAD)
        (DevicePrefetcher if clock.modelled else Prefetcher)(cache)
        return lm.model, cache, oracle.attach(cache)
    name = "none" if method == "lru" else method
    m2r2 = load_adapters(lm, config.adapters) if PREDICTORS[name].needs_adapters else None
    lookahead = ensure_lookahead(lm, Path(config.model)) if PREDICTORS[name].needs_lookahead else None
    return lm.model, cache, attach_predictor(cache, name, m2r2, config.m2r2_intervals, lookahead=lookahead)


def measure(run: BenchRun, method: str, budget: float, link, clock: str = "wall") -> dict:
    """One row: decode tokens/s and the cache's counters over the run's prompts, tokens checked against the
    resident row's. ``clock``: "wall" (``link`` throttles by sleeping) or "device" (the config's device profile,
    modelled)."""
    device = run.config.device if clock == "device" else None
    timer = device.clock() if device else WallClock()
    if device:
        link = device.device_link(timer, run.store.expert_weights(), run.store.expert_bytes())
    parts = setup(run, method, budget, link, timer)
    pricing = device.metering(run.store.expert_weights(), parts[0].args.hidden_size) if device else None
    with metered(timer, pricing) if device else nullcontext():
        return _decode(run, method, budget, parts, timer)


def _decode(run: BenchRun, method: str, budget: float, parts, timer: Clock) -> dict:
    model, cache, predictor = parts
    record = cache is not None and not run.traces
    if method == "oracle":  # the warm-up's text is not the trace's: its true routes are unknown
        predictor.trace = {}
    greedy(model, run.prompts[0][:8], 4)  # warm-up: compile paths, fill the cache's slots
    fast = predictor is not None and predictor.fast_layer_passes is not None
    p_i = 0

    def measure_from_here():  # after each prompt's prefill: count decode steps only
        if cache:
            cache.reset()
            if record:
                cache.trace = {}
            if method in BOUNDS:
                cache.set_future(run.traces[p_i])
            if method == "oracle":
                predictor.trace = run.traces[p_i]
        if fast:
            predictor.fast_layer_passes = 0

    stats, passes, tokens, seconds, same = CacheStats(), 0, 0, [], True
    for p_i, prompt in enumerate(run.prompts):
        out, dt = greedy(model, prompt, run.config.max_tokens, on_prefilled=measure_from_here, clock=timer)
        if record:
            run.traces.append(dict(cache.trace))
        if method == "resident":
            run.reference[p_i] = out
        same &= run.reference[p_i] == out
        seconds.append(dt)
        tokens += len(out) - 1
        if cache:
            stats.add(cache.stats)
        if fast:
            passes += predictor.fast_layer_passes
    row = {
        "method": method,
        "budget": budget,
        "tokens": tokens,
        "decode_s": sum(seconds),
        "tokens_per_s": tokens / sum(seconds),
        "same_as_resident": same,
    }
    if cache:
        row.update(
            hit_rate=stats.hit_rate,
            precision=stats.precision if stats.total("predicted") else None,
            recall=stats.recall if stats.total("used_when_predicted") else None,
            mb_per_token=stats.bytes_per_token / 1e6,
            loads_per_token=stats.loads_per_token,
            stall_ms_per_token=1e3 * stats.stall_per_token_s,
            slots=f"{min(cache.slots_per_layer.values())}/{cache.num_experts(cache.layers[0])}",
        )
        if fast:
            row["fast_layer_passes_per_token"] = passes / max(1, stats.tokens)
        if cache.planner is not None and cache.planner.governor is not None:
            row["governor"] = cache.planner.governor.summary()  # the predictor's measured cost and savings
        cache.close()
    return row


def measure_row(run: BenchRun, method: str, budget: float, link) -> dict:
    """One method at one budget on each of the config's clocks: the device clock's figures as ``device_*`` (and
    its counters where the wall clock does not run), the wall clock's under the plain names."""
    rows = {c: measure(run, method, budget, link, c) for c in run.config.clocks}
    row = dict(rows.get("wall") or {**rows["device"], "tokens_per_s": None, "stall_ms_per_token": None})
    if "device" in rows:
        row.update({f"device_{k}": rows["device"][k] for k in DEVICE_KEYS if k in rows["device"]})
        row["same_as_resident"] = all(r["same_as_resident"] for r in rows.values())
        for k in ("precision", "recall", "governor", "fast_layer_passes_per_token"):
            if k in rows["device"]:
                row[f"device_{k}"] = rows["device"][k]
    return row
