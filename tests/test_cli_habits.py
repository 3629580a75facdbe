"""Habits users bring from mlx-lm and llama.cpp: a prompt from stdin (-p -), and m2r2-bench's questions shipped
in the package with results written under the working folder, not into docs/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from m2r2_bench.questions import CATEGORIES, SPECBENCH
from m2r2_bench.specbench import build_parser

from .inprocess import run_main


@pytest.mark.slow
def test_prompt_from_stdin():
    r = run_main("m2r2_tui.chat", "-p", "-", "-m", "12", stdin="What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "smollm2 | speculative" in r.stderr


def test_bench_questions_ship_in_the_package_and_results_stay_local():
    args = build_parser().parse_args([])
    assert args.questions == SPECBENCH and SPECBENCH.is_relative_to(Path(__file__).resolve().parents[1] / "bench")
    assert args.out == Path("m2r2-bench-results")
    rows = [json.loads(line) for line in SPECBENCH.read_text().splitlines()]
    assert len(rows) == 480 and {r["category"] for r in rows} == set(CATEGORIES)
