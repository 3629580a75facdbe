"""The one registry of MoE expert predictors: every entry builds a ``Predictor`` that attaches to a cache, leaves the
tokens as they were and detaches cleanly; a wrong name, or a missing input, is one line."""

from m2r2_mlx.core.adapters import new_m2r2
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.moe import ExpertStore, moe_blocks, offload_experts
from m2r2_mlx.moe.lookahead import LookaheadAdapters
from m2r2_mlx.moe.predictors import PREDICTORS, Predictor, PredictorInputs, build_predictor, get_predictor
from m2r2_mlx.moe.serve import attach_predictor, serve_with_budget

import pytest

from m2r2_bench.moe_bench import LABELS, METHODS
from m2r2_bench.moe_rows import greedy
from tests.test_moe_ahead_of_time import PROMPT, _m2r2
from tests.tiny import tiny_model


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return ExpertStore.export(tiny_model("olmoe").model, tmp_path_factory.mktemp("store") / "experts")


@pytest.fixture(scope="module")
def reference():
    return greedy(tiny_model("olmoe").model, PROMPT, 5)[0]


def _shape(model) -> list[str]:
    """The model's layer and router types: what attaching a predictor may wrap and detaching must restore."""
    return [type(layer).__name__ for layer in model.layers] + [type(b.gate).__name__ for _, b in moe_blocks(model)]


@pytest.mark.parametrize("name", list(PREDICTORS))
def test_every_entry_builds_a_predictor_that_leaves_the_tokens_and_detaches(store, reference, name):
    entry = PREDICTORS[name]
    assert entry.name == name and entry.label and entry.help
    lm = tiny_model("olmoe")
    cache = offload_experts(lm.model, store, 0.5)
    before = _shape(lm.model)
    m2r2 = _m2r2(lm) if entry.needs_adapters else None
    layers = [l for l, _ in moe_blocks(lm.model)]
    lookahead = LookaheadAdapters(layers, 64, 8, lead=2) if entry.needs_lookahead else None
    inputs = PredictorInputs(m2r2=m2r2, trace={}, lookahead=lookahead)
    assert isinstance(build_predictor(name, inputs), Predictor)  # unattached
    trace = None
    if entry.needs_trace:  # a run recorded first, then replayed
        cache.trace = {}
        greedy(lm.model, PROMPT, 5, on_prefilled=cache.reset)
        trace = dict(cache.trace)
    predictor = attach_predictor(cache, name, m2r2, trace=trace, lookahead=lookahead)  # as serving and the bench do
    try:
        assert isinstance(predictor, Predictor) and predictor.cache is cache
        assert (cache.prefetcher is not None) == entry.loads_ahead
        tokens, _ = greedy(lm.model, PROMPT, 5, on_prefilled=cache.reset)
        assert tokens == reference
        assert (cache.stats.total("predicted") > 0) == (name != "none")
        assert (predictor.fast_layer_passes is not None) == entry.needs_adapters  # only M2R2's run a fast stream
        predictor.detach()
        assert _shape(lm.model) == before and predictor.cache is None
    finally:
        cache.close()


def test_a_cache_holding_every_expert_runs_no_predictor(store, reference):
    """Nothing can be loaded at 100%: a predictor would only cost (0.96-0.98x LRU on the pcie-gpu device clock)."""
    lm = tiny_model("olmoe")
    cache = offload_experts(lm.model, store, 1.0)
    try:
        attach_predictor(cache, "pregating")
        assert cache.prefetcher is None and cache.planner is None
        assert greedy(lm.model, PROMPT, 5, on_prefilled=cache.reset)[0] == reference
        assert cache.stats.total("predicted") == 0 and cache.stats.misses == 0
    finally:
        cache.close()


@pytest.mark.parametrize("call", [get_predictor, build_predictor, lambda n: attach_predictor(None, n)])
def test_an_unknown_predictor_is_one_line_naming_the_registry(call):
    with pytest.raises(M2R2Error) as e:
        call("psychic")
    message = str(e.value)
    assert "\n" not in message and "'psychic'" in message
    assert message.endswith(", ".join(PREDICTORS))


def test_missing_inputs_are_one_line():
    for name, entry in PREDICTORS.items():
        if entry.needs_adapters or entry.needs_trace:
            with pytest.raises(M2R2Error, match=name) as e:
                build_predictor(name)
            assert "\n" not in str(e.value)
    with pytest.raises(M2R2Error, match="replays a recorded run"):
        serve_with_budget(tiny_model("olmoe"), "25%", predictor="oracle")  # before anything is exported


def test_fused_rows_refuse_lora_adapters():
    lm = tiny_model("olmoe")
    lora = new_m2r2(lm, gates=[2, 4], rank=4, lora_targets=["q_proj", "v_proj"])
    with pytest.raises(M2R2Error, match="bottleneck adapters"):
        build_predictor("m2r2-fused", PredictorInputs(m2r2=lora))


def test_the_bench_runs_every_predictor_that_needs_no_recorded_run():
    runnable = [n for n, e in PREDICTORS.items() if n != "none" and not e.needs_trace]
    assert METHODS == ("resident", "lru", *runnable, "belady", "oracle")  # the bounds replay the LRU row's routes
    assert set(LABELS) == set(METHODS)
