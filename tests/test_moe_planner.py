"""The prefetch planner (m2r2_mlx/moe/planner.py) on a tiny random OLMoE: a prediction that carries nothing loads
nothing (the cache is on-demand LRU, counter for counter); true routes load ahead and hide most of LRU's loads;
prefetches never evict the current token's experts nor what predictions name; tokens never change."""

from m2r2_mlx.moe import ExpertStore, PlannerConfig, PrefetchPlanner, offload_experts

import numpy as np
import pytest

from m2r2_bench.moe_controls import Oracle, ShuffledControl
from m2r2_bench.moe_rows import greedy
from tests.tiny import tiny_model

PROMPT = np.array([3, 17, 42, 8, 99, 23, 5, 61, 12, 7])
N = 24


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return ExpertStore.export(tiny_model("olmoe").model, tmp_path_factory.mktemp("store") / "experts")


@pytest.fixture(scope="module")
def reference():
    return greedy(tiny_model("olmoe").model, PROMPT, N)[0]


def run(store, budget, predictor=None, planned=False, record=False, governed=True):
    """(tokens, the cache's stats, the planner, the trace) of one greedy run."""
    lm = tiny_model("olmoe")
    planner = PrefetchPlanner(PlannerConfig(governed=governed)) if planned else None
    cache = offload_experts(lm.model, store, budget, planner=planner)
    if predictor is not None:
        predictor.attach(cache)
    if record:
        cache.trace = {}
    tokens, _ = greedy(lm.model, PROMPT, N, on_prefilled=cache.reset)
    cache.close()
    return tokens, cache.stats, planner, cache.trace


@pytest.mark.parametrize("budget", [0.5, 0.25])
def test_random_predictions_load_next_to_nothing_and_leave_lru_as_it_was(store, reference, budget):
    tokens, lru, _, _ = run(store, budget)
    planned_tokens, s, planner, _ = run(store, budget, ShuffledControl(seed=0), planned=True)
    assert tokens == planned_tokens == reference
    assert s.total("predicted") > 0 and planner.decisions["considered"] > 0
    # the hit rate is read at its mean: a guess or two may load before their misses are scored, then none (however
    # many windows the governor runs the predictor in: that follows the wall clock's timings)
    assert s.total("prefetch_loads") == planner.decisions["loaded"] <= N // 8, planner.decisions
    # counter for counter where nothing loaded; a loaded guess evicts one expert, which can cost a miss later
    assert s.hits + s.misses == lru.hits + lru.misses
    assert abs(s.misses - lru.misses) <= 2 * planner.decisions["loaded"], (s.misses, lru.misses, planner.decisions)
    assert s.bytes_moved <= lru.bytes_moved + planner.decisions["loaded"] * store.expert_bytes()
    _, raw, _, _ = run(store, budget, ShuffledControl(seed=0))  # unplanned, the same guesses cost bytes
    assert raw.bytes_moved > lru.bytes_moved
    # and once they are seen not to pay, most layers are not even predicted (the predictor's own work saved)
    assert s.total("predicted") < 0.75 * raw.total("predicted")


@pytest.mark.parametrize("budget", [0.5, 0.25])
def test_true_routes_load_ahead_and_hide_most_of_lrus_loads(store, reference, budget):
    _, lru, _, trace = run(store, budget, record=True)
    # the predictor always running: the planner's choices alone (the governor: tests/test_moe_moefied.py)
    tokens, s, planner, _ = run(store, budget, Oracle(trace), planned=True, governed=False)
    assert tokens == reference
    assert planner.decisions["loaded"] > 0 and s.total("prefetch_wasted") == 0
    # loads move ahead of the pass instead of stalling it, and no more of them than LRU makes; the first layer has
    # no layer below to be predicted from, and the first few predictions calibrate the planner
    assert s.misses + s.total("prefetch_loads") <= lru.misses
    assert s.hit_rate > lru.hit_rate
    ahead = lambda stats: sum(st.misses for layer, st in stats.layers.items() if layer != 0)  # noqa: E731
    assert ahead(s) <= (0.2 if budget == 0.25 else 0.7) * ahead(lru)


def test_a_prefetch_spares_named_and_current_experts(store):
    lm = tiny_model("olmoe")
    planner = PrefetchPlanner()
    cache = offload_experts(lm.model, store, 0.25, planner=planner)  # 2 slots per layer, experts 0 and 1 resident
    greedy(lm.model, PROMPT, 3, on_prefilled=cache.reset)
    layer, resident = cache.layers[1], cache.resident(cache.layers[1])
    # the current token used both resident experts of this layer: a prefetch finds nothing to evict
    planner._used_now[layer] = (cache.step, set(resident))
    assert planner.victim(layer, resident, demand=False) is None
    assert planner.victim(layer, resident, demand=True) in resident  # a load on demand always gets a slot
    planner._used_now[layer] = (cache.step - 1, set(resident))  # the previous token's: evictable
    cache.predictions[(cache.step + 1, layer)] = {resident[0]}  # ... unless a prediction names it
    assert planner.victim(layer, resident, demand=False) == resident[1]
    cache.close()


@pytest.mark.parametrize("reused, loads", [(False, True), (True, False)])
def test_a_sure_prefetch_loads_unless_its_victim_is_used_at_the_same_visit(store, reused, loads):
    """A load on demand evicts only what the visit does not use, so a prefetch whose victim the same visit uses
    swaps one miss for another, right guess or not: a prediction that is always right loads over a victim that is
    never used then, and not over one that always is."""
    lm = tiny_model("olmoe")
    planner = PrefetchPlanner(PlannerConfig(governed=False))
    cache = offload_experts(lm.model, store, 0.25, planner=planner)  # 2 slots per layer
    greedy(lm.model, PROMPT, 3, on_prefilled=cache.reset)
    planner._util = 0.0  # an idle link: a wasted transfer costs nothing, only the victim's reuse counts
    layer = cache.layers[1]
    outside = next(e for e in range(cache.num_experts(layer)) if not cache.is_resident(layer, e))
    planner._used_now[layer] = (cache.step - 1, set())  # nothing the current token used: every resident evictable
    ahead = cache.ordinal(layer) - cache.position[1] + len(cache.layers)
    for _ in range(200):
        planner.hits.observe(planner._hit_keys(layer, ahead, 0, None), True)
        for rank in range(2):
            planner.reuse.observe(planner._reuse_keys(layer, rank, False), reused)
    assert (planner.select(layer, [outside], cache.step + 1, None) == [outside]) is loads
    cache.close()
