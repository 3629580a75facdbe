"""The ablation report's comparison against prompt lookup: a paired ratio with a resampled interval."""

from experiments.speculative_ablation import against


def records(times: list[float], tokens: int = 97) -> list[dict]:
    return [{"turns": [{"new_tokens": tokens, "decode_time": t}]} for t in times]


def test_a_uniform_speedup_has_a_point_interval():
    runs = {"a": records([1.0, 2.0, 3.0]), "b": records([2.0, 4.0, 6.0])}
    assert against(runs, "a", "b") == "2.000 [2.000, 2.000]"


def test_the_interval_spans_the_questions_spread():
    runs = {"a": records([1.0, 1.0, 1.0, 1.0, 1.0, 1.0]), "b": records([0.8, 1.3, 0.9, 1.2, 1.0, 1.1])}
    point, interval = against(runs, "a", "b").split(" ", 1)
    lo, hi = (float(x) for x in interval.strip("[]").split(", "))
    assert float(point) == 1.05 and lo < 1.0 < hi and hi - lo < 0.4
