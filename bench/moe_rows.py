"""One row of `m2r2-bench --moe`: a method at a budget, decoded on the wall clock (this machine, experts read from
its disk) or a device clock (modelled); moe_bench.py runs the rows and writes the report."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import m2r2_mlx  # noqa: F401  (fast BLAS before mlx)
from m2r2_mlx.core.adapters import load_adapters
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.moe import CacheStats, ExpertStore, IOConfig, offload_experts
from m2r2_mlx.moe.clock import Clock, WallClock
from m2r2_mlx.moe.lookahead import LookaheadAdapters
from m2r2_mlx.moe.metering import metered
from m2r2_mlx.moe.predictors import PREDICTORS, PredictorInputs
from m2r2_mlx.moe.profiles import DeviceProfile
from m2r2_mlx.moe.serve import offload_with_predictor

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from .moe_controls import CONTROLS, FutureRoutes, Oracle

if TYPE_CHECKING:
    from .moe_bench import MoEBenchConfig

ROWS = {**PREDICTORS, **CONTROLS}  # the predictor rows: the product's and the controls
# offline bounds from the true routes (recorded by the first cached row of the same prompts): they run last
BOUNDS = ("belady", "oracle")
ORACLE_LOOKAHEAD = 4  # MoE layers the true-routes prefetch runs ahead (into the next token's first layers)


@dataclass
class BenchRun:
    """What every row of one run shares: the config, the expert store, the prompts, the device profile (None: the
    wall clock), the all-resident tokens each row is checked against (filled by the resident row) and each prompt's
    routes (recorded by the first cached row, replayed by the bound rows)."""

    config: MoEBenchConfig
    store: ExpertStore
    prompts: list[np.ndarray]
    device: DeviceProfile | None = None
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
        clock.sync()  # the token read back
        out.append(tok)
    return out, clock.now() - start


def setup(run: BenchRun, method: str, budget: float, clock: Clock):
    """A freshly loaded model with this method's cache and predictor; returns (model, cache, predictor, future)."""
    config, store = run.config, run.store
    lm = load_model(config.model, tokenizer=False)  # token ids in, token ids out
    if method == "resident":
        return lm.model, None, None, None
    args = dict(clock=clock, io=IOConfig(config.io))
    if run.device is not None:
        args["device_scale"] = run.device.device_scale(store.expert_weights(), store.expert_bytes())
    if method in BOUNDS:
        future = FutureRoutes()
        if method == "belady":
            cache, predictor = offload_with_predictor(
                lm.model, store, budget / 100, ROWS["none"], policy=future.policy, **args
            )
        else:
            cache = offload_experts(lm.model, store, budget / 100, policy=future.policy, **args)
            predictor = Oracle(run.traces[0], lookahead=ORACLE_LOOKAHEAD).attach(cache)
        future.follow(cache)
        return lm.model, cache, predictor, future
    entry = ROWS["none" if method == "lru" else method]
    inputs = PredictorInputs(
        m2r2=load_adapters(lm, config.adapters) if entry.needs_adapters else None,
        lookahead=LookaheadAdapters.load(Path(config.model)) if entry.needs_lookahead else None,
    )
    cache, predictor = offload_with_predictor(
        lm.model, store, budget / 100, entry, inputs, policy=config.policy, **args
    )
    return lm.model, cache, predictor, None


def measure(run: BenchRun, method: str, budget: float) -> dict:
    """One row: decode tokens/s and the cache's counters over the run's prompts, tokens checked against the
    resident row's, on the run's clock (the device profile's where it has one)."""
    device = run.device
    clock = device.clock() if device else WallClock()
    model, cache, predictor, future = setup(run, method, budget, clock)
    try:
        pricing = device.metering(run.store.expert_weights(), model.args.hidden_size) if device else None
        own = predictor.own_modules() if predictor is not None else []
        with metered(clock, pricing, model, *own) if device else nullcontext():
            return _decode(run, method, budget, (model, cache, predictor, future), clock)
    finally:
        if cache is not None:
            cache.close()


def _decode(run: BenchRun, method: str, budget: float, parts, clock: Clock) -> dict:
    model, cache, predictor, future = parts
    record = cache is not None and not run.traces
    if method == "oracle":  # the warm-up's text is not the trace's: its true routes are unknown
        predictor.trace = {}
    if future is not None:
        future.set({})
    greedy(model, run.prompts[0][:8], 4)  # warm-up: compile paths, fill the cache's slots
    fast = predictor is not None and predictor.fast_layer_passes is not None
    p_i, reads = 0, [0, 0.0]  # bytes read and the reads' busy seconds, decode steps only
    marks = []

    def measure_from_here():  # after each prompt's prefill: count decode steps only
        if cache:
            cache.reset()
            marks.append((cache.loader.bytes, cache.loader.busy_s))
            if record:
                cache.trace = {}
            if future is not None:
                future.set(run.traces[p_i])
            if method == "oracle":
                predictor.trace = run.traces[p_i]
        if fast:
            predictor.fast_layer_passes = 0

    stats, passes, tokens, seconds, same = CacheStats(), 0, 0, [], True
    for p_i, prompt in enumerate(run.prompts):
        out, dt = greedy(model, prompt, run.config.max_tokens, on_prefilled=measure_from_here, clock=clock)
        if record:
            run.traces.append(dict(cache.trace))
        if method == "resident":
            run.reference[p_i] = out
        same &= run.reference[p_i] == out
        seconds.append(dt)
        tokens += len(out) - 1
        if cache:
            stats.add(cache.stats)
            reads[0] += cache.loader.bytes - marks[-1][0]
            reads[1] += cache.loader.busy_s - marks[-1][1]
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
            read_gbps=reads[0] / reads[1] / 1e9 if reads[1] else None,
            loads_per_token=stats.loads_per_token,
            stall_ms_per_token=1e3 * stats.stall_per_token_s,
            cancelled_per_token=stats.prefetch_dropped / max(1, stats.tokens),
            slots=f"{min(cache.slots_per_layer.values())}/{cache.num_experts(cache.layers[0])}",
        )
        if fast:
            row["fast_layer_passes_per_token"] = passes / max(1, stats.tokens)
        if cache.planner is not None and cache.planner.governor is not None:
            row["governor"] = cache.planner.governor.summary()  # the predictor's measured cost and savings
    return row
