"""A second question set for m2r2-bench that is not Spec-Bench: prompts written from the package corpora with
templates of their own (none of the training data's, tools/corpora.py), kept to measure what was never tuned on.

    python -m m2r2_tools.heldout -o bench/data/heldout.jsonl

Six kinds of work, five prompts each, in Spec-Bench's format (``question_id``, ``category``, ``turns``): questions
about a pasted passage, summaries, code, arithmetic and word problems, rewriting, open writing. Some have a second
turn, as chats do. Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from m2r2_mlx.atomic import atomic_write_text
from m2r2_mlx.errors import run_cli

from .corpora import add_corpus_arguments, corpus_paths
from .corpus_sources import Corpora

PROG = "python -m m2r2_tools.heldout"
PER_KIND = 5


def _long_passage(corpora: Corpora, rng: random.Random) -> tuple[str, str]:
    """(source, about 180 words): two consecutive chunks of one text, as a user pastes a few paragraphs."""
    kind = rng.randrange(3)
    if kind == 0:
        items = corpora.sotu_passages
        i = rng.randrange(len(items) - 1)
        who = items[i][0]
        return f"a State of the Union address by {who}", f"{items[i][1]} {items[i + 1][1]}"
    if kind == 1:
        items = corpora.moby_dick_passages
        i = rng.randrange(len(items) - 1)
        return "Moby-Dick", f"{items[i]} {items[i + 1]}"
    book, text = rng.choice([p for p in corpora.austen_passages if len(p[1].split()) >= 90])
    return f"Jane Austen's {book}", text


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def passage_qa(corpora: Corpora, rng: random.Random, i: int) -> list[str]:
    src, text = _long_passage(corpora, rng)
    asks = [
        "List three facts this excerpt states, each followed by the words it comes from.",
        "Who or what is at the centre of this excerpt, and how does the writer feel about it? Quote one phrase "
        "that shows it.",
        "What question does this excerpt leave unanswered? Explain in a few sentences, citing the text.",
        "Does this excerpt argue for something? If so, state the claim and the reasons given for it.",
    ]
    ask = asks[i % len(asks)]
    return [f'Here is an excerpt from {src}:\n\n"{text}"\n\n{ask}']


def summary(corpora: Corpora, rng: random.Random, i: int) -> list[str]:
    if i % 3 == 2:
        text = rng.choice([p for p in corpora.python_prose if 60 <= len(p.split()) <= 220])
        return [
            f"I'm new to Python. Sum up what this part of the documentation says, in three bullet points:\n\n{text}"
        ]
    src, text = _long_passage(corpora, rng)
    how = ["in three bullet points", "in one short paragraph", "in two sentences, then one key quote"][i % 3]
    return [f"Summarize this passage from {src} {how}.\n\n{text}"]


def code(corpora: Corpora, rng: random.Random, i: int) -> list[str]:
    kind = i % 3
    if kind == 0:
        stub = rng.choice(corpora.humaneval_prompts)
        return [
            f"Fill in the body of this function and explain the idea in two sentences.\n\n```python\n{stub}```",
            "Now write three assert statements that test it, including an edge case.",
        ]
    if kind == 1:
        signature, what = rng.choice(corpora.python_functions)
        return [f"Show me a small runnable example of {signature} ({what}) and mention one common mistake with it."]
    stub = rng.choice(corpora.humaneval_prompts)
    return [f"Walk through what this function should return for two example inputs of your choice:\n\n{stub}"]


def math(corpora: Corpora, rng: random.Random, i: int) -> list[str]:
    a, b, c = rng.randint(12, 95), rng.randint(3, 19), rng.randint(120, 980)
    problems = [
        f"A recipe for 4 people needs {c} g of flour and {b * 10} ml of milk. How much of each is needed for "
        f"{b} people? Show each step.",
        f"A train leaves at 9:{a % 60:02d} and arrives at {13 + b % 5}:{(a * 7) % 60:02d} the same day. How long "
        "is the trip in hours and minutes?",
        f"What is {a}% of {c * 10}, and what do you get when you add {b * 11} to it? Explain each step.",
        f"Solve for x: {b}x + {a} = {c} - {b + 2}x. Check the solution by substituting it back.",
        f"The average of five numbers is {a}. Four of them are {a - b}, {a + 2 * b}, {a - 3}, and {a + 7}. What "
        "is the fifth number?",
        f"A shop sells notebooks at {b} dollars each, with every {_ordinal(b % 4 + 3)} notebook free. How much do "
        f"{a} notebooks cost?",
    ]
    turns = [problems[i % len(problems)]]
    if i % 2:
        turns.append("Check your answer a different way.")
    return turns


def rewrite(corpora: Corpora, rng: random.Random, i: int) -> list[str]:
    kind = i % 4
    if kind == 0:
        play, passage = rng.choice(corpora.shakespeare_passages)
        return [
            f"Rewrite these lines from {play} in plain modern English, keeping who says what:\n\n{passage}",
            "Now make it half as long.",
        ]
    if kind == 1:
        book, text = rng.choice(corpora.austen_passages)
        return [f"Rewrite this paragraph from {book} as if it were written today, in a casual tone:\n\n{text}"]
    if kind == 2:
        who, text = rng.choice(corpora.sotu_passages)
        return [
            f"Edit this paragraph (from {who}) to be clearer and shorter without losing any facts:\n\n{text}",
            "Now turn it into a short list of its points.",
        ]
    text = rng.choice([p for p in corpora.python_prose if 40 <= len(p.split()) <= 150])
    return [f"Explain this to a ten-year-old, rewriting it in simple words:\n\n{text}"]


def writing(corpora: Corpora, rng: random.Random, i: int) -> list[str]:
    kind = i % 4
    if kind == 0:
        return [
            f"Write a short graduation speech built around this saying:\n\n{rng.choice(corpora.fortunes)}",
            "Give it a title and a one-line summary.",
        ]
    if kind == 1:
        (a, book), (b, play) = rng.choice(corpora.austen_characters), rng.choice(corpora.shakespeare_speakers)
        return [f"Write a short scene in which {a} from {book} meets {b} from {play} at a train station."]
    if kind == 2:
        first = rng.choice(corpora.moby_dick_passages).split(". ")[0].strip()
        return [f'Continue this story for about 150 words: "{first}."']
    term, _ = rng.choice(corpora.python_glossary)
    return [f"Write a funny product announcement for an imaginary gadget named after the Python term '{term}'."]


KINDS = {
    "passage_qa": passage_qa,
    "summary": summary,
    "code": code,
    "math": math,
    "rewrite": rewrite,
    "writing": writing,
}


def build(corpora: Corpora, seed: int = 2026, per_kind: int = PER_KIND) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for category, make in KINDS.items():
        for i in range(per_kind):  # each kind's templates in turn, so that a set covers all of them
            out.append({"question_id": 1000 + len(out), "category": category, "turns": make(corpora, rng, i)})
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("-o", "--out", type=Path, required=True, help="the JSONL file to write")
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--per-kind", type=int, default=PER_KIND)
    add_corpus_arguments(p)
    return p


def _main() -> int:
    args = build_parser().parse_args()
    corpora = Corpora(corpus_paths(args.fortunes, args.python_docs, args.npm_root))
    questions = build(corpora, args.seed, args.per_kind)
    atomic_write_text(args.out, "".join(json.dumps(q) + "\n" for q in questions))
    print(f"wrote {len(questions)} questions to {args.out}")
    return 0


def main() -> None:
    sys.exit(run_cli(PROG, _main))


if __name__ == "__main__":
    main()
