"""The one registry of MoE expert predictors: every entry builds a ``Predictor`` that attaches to a cache, leaves the
tokens as they were and detaches cleanly; a wrong name, or a missing input, is one line."""

from m2r2_mlx.core.adapters import new_m2r2
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.moe import ExpertStore, moe_blocks
from m2r2_mlx.moe.lookahead import LookaheadAdapters
from m2r2_mlx.moe.predictors import PREDICTORS, Predictor, PredictorInputs, build_predictor, get_predictor
from m2r2_mlx.moe.serve import offload_with_predictor, serve_with_budget

import pytest

from m2r2_bench.moe_bench import LABELS, MOE_METHODS
from m2r2_bench.moe_controls import CONTROLS
from m2r2_bench.moe_rows import ROWS, greedy
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


@pytest.mark.parametrize("name", list(ROWS))
def test_every_entry_builds_a_predictor_that_leaves_the_tokens_and_detaches(store, reference, name):
    """The product's entries and the bench's controls alike, attached as serving and the bench do."""
    entry = ROWS[name]
    assert entry.name == name and entry.label and entry.help
    lm = tiny_model("olmoe")
    before = _shape(lm.model)
    m2r2 = _m2r2(lm) if entry.needs_adapters else None
    layers = [l for l, _ in moe_blocks(lm.model)]
    lookahead = LookaheadAdapters(layers, 64, 8, lead=2) if entry.needs_lookahead else None
    inputs = PredictorInputs(m2r2=m2r2, lookahead=lookahead)
    assert isinstance(build_predictor(entry, inputs), Predictor)  # unattached
    cache, predictor = offload_with_predictor(lm.model, store, 0.5, entry, inputs)
    try:
        assert isinstance(predictor, Predictor) and predictor.cache is cache
        assert (cache.planner is not None) == entry.planned
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
    cache, predictor = offload_with_predictor(lm.model, store, 1.0, PREDICTORS["pregating-planned"])
    try:
        assert cache.planner is None and type(predictor).__name__ == "NoPrediction"
        assert greedy(lm.model, PROMPT, 5, on_prefilled=cache.reset)[0] == reference
        assert cache.stats.total("predicted") == 0 and cache.stats.misses == 0
    finally:
        cache.close()


def test_an_unknown_predictor_is_one_line_naming_the_registry():
    with pytest.raises(M2R2Error) as e:
        get_predictor("psychic")
    message = str(e.value)
    assert "\n" not in message and "'psychic'" in message
    assert message.endswith(", ".join(PREDICTORS))


def test_missing_inputs_are_one_line():
    for name, entry in PREDICTORS.items():
        if entry.needs_adapters or entry.needs_lookahead:
            with pytest.raises(M2R2Error, match=name) as e:
                build_predictor(entry)
            assert "\n" not in str(e.value)
    with pytest.raises(M2R2Error, match="needs --adapters"):
        serve_with_budget(tiny_model("olmoe"), "25%", predictor="fast")  # before anything is exported


def test_fused_rows_refuse_lora_adapters():
    lm = tiny_model("olmoe")
    lora = new_m2r2(lm, gates=[2, 4], rank=4, lora_targets=["q_proj", "v_proj"])
    with pytest.raises(M2R2Error, match="bottleneck adapters"):
        build_predictor(PREDICTORS["fast-fused"], PredictorInputs(m2r2=lora))


def test_the_product_registry_holds_what_a_user_runs_and_the_bench_adds_its_controls():
    assert set(PREDICTORS) == {"none", "pregating", "pregating-planned", "lookahead", "fast", "fast-fused"}
    assert not set(CONTROLS) & set(PREDICTORS)
    assert MOE_METHODS == ("resident", "lru", *[n for n in ROWS if n != "none"], "belady", "oracle")
    assert set(LABELS) == set(MOE_METHODS)
