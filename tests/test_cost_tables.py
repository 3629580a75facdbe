"""Never slower than plain, on any device's costs: the speculative engine's planner learns from a clock that replays a
device's cost table (experiments/cost_tables.py: this CPU's, an H200's, an Apple GPU's), and its modelled time on
held-out questions stays within 2% of the best single method's on the same table (plain decoding's on the H200,
where a verification costs 2.3 plain steps), while a planner that always drafts falls behind there. Every answer
equals plain decoding's."""

from __future__ import annotations

from pathlib import Path

from m2r2_mlx.decoding.prompt_cache import PromptCache

import pytest

from experiments.cost_tables import TABLES, CostTable, ModelledClock, priced
from experiments.planner_costs import run, speedups
from m2r2_bench.questions import select_questions

HELDOUT = Path(__file__).resolve().parents[1] / "bench" / "data" / "heldout.jsonl"


def test_a_table_prices_forwards_and_draft_steps():
    table = CostTable("t", "test", 0.01, {4: 1.3, 8: 1.5}, 0.25)
    assert table.forward_s(1) == pytest.approx(0.01) and table.forward_s(4) == pytest.approx(0.013)
    assert table.forward_s(6) == pytest.approx(0.014) and table.forward_s(20) == pytest.approx(0.015)
    log = [("forward", 1), ("forward", 4), ("draft", 2)]
    assert priced(log, table) == pytest.approx(0.01 + 0.013 + 2 * 0.0025)


def test_the_clock_charges_the_work_it_sees_and_not_the_prefill(lm):
    clock = ModelledClock(TABLES["h200"])
    cache = PromptCache(lm.model, tracer=clock)
    clock.start_answer()
    cache.forward([1, 2, 3, 4, 5, 6, 7])  # the prefill: free
    cache.forward([8])
    cache.forward([9, 10, 11, 12])
    clock.call("draft", lambda: 2)
    assert clock.log == [("forward", 1), ("forward", 4), ("draft", 2)]
    assert clock.now() == pytest.approx(priced(clock.log, TABLES["h200"])) == pytest.approx(clock.decode_s)


@pytest.mark.slow
def test_the_engine_is_never_slower_than_the_best_single_method_on_any_devices_costs(lm):
    questions = select_questions(HELDOUT, "all", limit=1)  # 6 questions, one per kind of work
    names = ["plain", "lookup", "fast", "speculative", "always"]
    results = run(lm, questions, names, list(TABLES.values()), max_tokens=32)
    for name, result in results.items():
        s = speedups(result)
        best = max(s["plain"], s["lookup"], s["fast"])
        assert s["speculative"] >= 0.98 * best, (name, s)
        assert all(r["same"] for r in result.values()), name
    h200 = speedups(results["h200"])
    assert h200["speculative"] >= 0.98  # plain decoding is the best single method there ...
    assert h200["always"] < 0.98 * max(h200["plain"], h200["lookup"], h200["fast"])  # ... always drafting is not
