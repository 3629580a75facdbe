"""m2r2-bench end to end on two tiny questions: every method runs, lossless ones match plain, files land."""

import json

import pytest

from .inprocess import run_main

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write one sentence about the sea.", "Now about the sky."]},
    {"question_id": 2, "category": "qa", "turns": ["What is the capital of France?"]},
    {"question_id": 3, "category": "rag", "turns": ["Unused: not selected."]},
]


def bench(tmp_path, *args):
    """m2r2-bench's main() in this process, on QUESTIONS written into ``tmp_path``."""
    q = tmp_path / "question.jsonl"
    q.write_text("\n".join(json.dumps(x) for x in QUESTIONS) + "\n")
    return run_main("m2r2_bench.specbench", "--questions", q, *args)


@pytest.mark.slow
def test_bench_runs_every_method_and_writes_its_files(tmp_path):
    out = tmp_path / "out"
    r = bench(
        tmp_path,
        "--categories",
        "writing,qa",
        "--max-tokens",
        "12",
        "--methods",
        "plain,mlx-lm,speculative,layerskip,lookup",
        "--draft-model",
        "smollm2",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    methods = ["plain", "mlx-lm", "speculative", "layerskip", "lookup", "mlx-lm-spec"]
    for m in methods:
        rows = [json.loads(line) for line in (out / f"{m}.jsonl").read_text().splitlines()]
        assert [x["question_id"] for x in rows] == [1, 2]
        assert [len(x["choices"][0]["turns"]) for x in rows] == [2, 1]  # both turns of a two-turn question
    table = (out / "results.md").read_text()
    assert (out / "results.png").stat().st_size > 10_000
    overall = [line for line in table.splitlines() if line.startswith("| overall")]
    assert len(overall) == len(methods)
    assert all(line.rstrip(" |").endswith("2/2") for line in overall)  # every method's answers equal plain greedy's
    assert sum(line.startswith("| mt_bench") for line in table.splitlines()) == len(methods)  # writing, not qa


@pytest.mark.slow
def test_bench_samples_when_asked(tmp_path):
    """--temperature: every method samples (mlx-lm through its own sampler), seeded per question; answers are not
    compared with plain's, and the table says so."""
    out = tmp_path / "out"
    r = bench(
        tmp_path,
        "--categories",
        "qa",
        "--max-tokens",
        "16",
        "--methods",
        "plain,mlx-lm,speculative",
        "--temperature",
        "1.0",
        "--top-p",
        "0.95",
        "--seed",
        "3",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    table = (out / "results.md").read_text()
    assert "sampled (temperature 1.0, top-p 0.95)" in table
    overall = [line for line in table.splitlines() if line.startswith("| overall")]
    assert len(overall) == 3 and all(line.rstrip(" |").endswith("- (sampled)") for line in overall)
    greedy = bench(
        tmp_path,
        "--categories",
        "qa",
        "--max-tokens",
        "16",
        "--methods",
        "plain",
        "--out",
        str(tmp_path / "greedy"),
    )
    assert greedy.returncode == 0
    answer = lambda folder: json.loads((folder / "plain.jsonl").read_text())["choices"][0]["turns"]  # noqa: E731
    assert answer(out) != answer(tmp_path / "greedy")  # 16 tokens at temperature 1: not the greedy answer


def test_mt_bench_rows_sum_only_mt_bench_categories():
    from m2r2_bench.report import groups, summarise

    def answer(cat, tokens, seconds):
        turn = {"new_tokens": tokens + 1, "decode_time": seconds, "accept_lengths": [1] * tokens, "peak_memory_gb": 0.5}
        return {"category": cat, "turns": [turn], "same_as_plain": True}

    records = {"plain": [answer("writing", 10, 1.0), answer("math", 30, 2.0), answer("qa", 100, 1.0)]}
    assert groups(["writing", "math", "qa"]) == ["writing", "math", "qa", "mt_bench", "overall"]
    assert groups(["writing", "math"]) == ["writing", "math", "overall"]  # all of them MT-Bench: no extra row
    summary = summarise(records, ["plain"], ["writing", "math", "qa"])
    assert summary["mt_bench", "plain"]["tok_s"] == 40 / 3.0 and summary["mt_bench", "plain"]["same"] == "2/2"
    assert summary["overall", "plain"]["tok_s"] == 140 / 4.0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--categories", "poetry"], "unknown categories"),
        (["--methods", "plain,warp"], "unknown methods"),
        (["--methods", "mlx-lm-spec"], "needs --draft-model"),
        (["--questions", "/no/such.jsonl"], "not found"),
        (["--temp", "-1"], "--temp must be 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
    ],
)
def test_bench_bad_input_is_one_line(tmp_path, args, message):
    r = bench(tmp_path, *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_tools_refuses_an_unknown_method_while_parsing(tmp_path):
    r = run_main("m2r2_bench.specbench", "--tools", "--methods", "plain,m2r2", "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "unknown methods ['m2r2']" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_tools_evaluates_one_request_through_the_servers_path(tmp_path):
    """m2r2-bench --tools on its first request: under tool_choice required the answer is a valid call, and the
    speculative method's tokens are plain decoding's."""
    out = tmp_path / "out"
    r = run_main(
        "m2r2_bench.specbench",
        "--tools",
        "--limit",
        "1",
        "--methods",
        "speculative",
        "--max-tokens",
        "48",
        "--out",
        out,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    table = (out / "results.md").read_text()
    assert "| required | all | 1 | 1 | 1/1 |" in table, table
    assert "| speculative |" in table and table.split("| speculative |")[1].split("\n")[0].endswith("| 1/1 |"), table
