"""The held-out question set (bench/data/heldout.jsonl): not Spec-Bench, all six kinds of work, and m2r2-bench
reads it as it reads Spec-Bench."""

import json
from pathlib import Path

from m2r2_bench.questions import SPECBENCH, file_categories, select_questions

HELDOUT = Path(__file__).resolve().parents[1] / "bench" / "data" / "heldout.jsonl"


def test_the_heldout_set_covers_six_kinds_and_shares_nothing_with_specbench():
    questions = select_questions(HELDOUT, "all", None)
    assert len(questions) >= 24
    assert set(file_categories(questions)) == {"passage_qa", "summary", "code", "math", "rewrite", "writing"}
    specbench = {t.strip() for line in SPECBENCH.read_text().splitlines() for t in json.loads(line)["turns"]}
    first_turns = [q["turns"][0] for q in questions]
    assert not specbench & set(first_turns)
    assert len(set(first_turns)) == len(first_turns)
    assert len(select_questions(HELDOUT, "code,math", 2)) == 4
