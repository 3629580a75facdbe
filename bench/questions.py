"""Spec-Bench's questions: which ones a run takes, and in what order."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

from m2r2_mlx.errors import M2R2Error

SPECBENCH = Path(__file__).resolve().parent / "data" / "question.jsonl"  # Spec-Bench's 480 (data/README.md)
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
CATEGORIES = MT_BENCH + ("translation", "summarization", "qa", "math_reasoning", "rag")
ORDERS = ("given", "reverse", "shuffled")


def select_questions(path: Path, categories: str, limit: int | None) -> list[dict]:
    """The questions of ``path`` (Spec-Bench's format: one JSON object per line with ``question_id``, ``category``
    and ``turns``) in ``categories`` ("all", "mt_bench" or a comma-separated list of the file's categories), at
    most ``limit`` per category."""
    if not path.is_file():
        raise M2R2Error(f"Spec-Bench questions not found at {path}; pass --questions path/to/question.jsonl")
    questions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    known = file_categories(questions)
    wanted = {"all": known, "mt_bench": MT_BENCH}.get(categories) or tuple(c.strip() for c in categories.split(","))
    unknown = [c for c in wanted if c not in known]
    if unknown:
        raise M2R2Error(f"unknown categories {unknown}; choose from {', '.join(known)}, mt_bench or all")
    if limit is not None and limit < 1:
        raise M2R2Error(f"at least 1 question per category is needed (got {limit}); raise --limit or --per-category")
    taken: Counter = Counter()
    out = []
    for q in questions:
        if q["category"] in wanted and (limit is None or taken[q["category"]] < limit):
            taken[q["category"]] += 1
            out.append(q)
    return out


def file_categories(questions: list[dict]) -> tuple[str, ...]:
    """The categories ``questions`` hold: Spec-Bench's in its order, then any others in the order first seen."""
    seen = dict.fromkeys(q["category"] for q in questions)
    return tuple(c for c in CATEGORIES if c in seen) + tuple(c for c in seen if c not in CATEGORIES)


def ordered(questions: list[dict], order: str = "given", seed: int = 0) -> list[dict]:
    """The questions in the order a run asks them: as the file has them, reversed, or shuffled with ``seed``. A
    long-lived engine learns across answers, so what it measures may depend on the order."""
    if order not in ORDERS:
        raise M2R2Error(f"unknown question order {order!r}; choose one of: {', '.join(ORDERS)}")
    if order == "reverse":
        return questions[::-1]
    if order == "shuffled":
        out = list(questions)
        random.Random(seed).shuffle(out)
        return out
    return list(questions)
