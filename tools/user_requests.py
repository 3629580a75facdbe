"""Training requests shaped like what chat users send: a pasted passage with a question, a summary or a rewrite
request; code to write or explain; arithmetic and word problems; follow-up turns. Built from the package corpora
with templates of their own (neither tools/corpora.py's nor the held-out set's, tools/heldout.py), and
decontaminated against every evaluation question file named: a conversation sharing a run of ``--overlap`` words
with one of them, or pasting a passage that one of them pastes, is dropped.

    python -m m2r2_tools.user_requests -n 4000 --decontaminate bench/data/question.jsonl bench/data/heldout.jsonl \\
        -o data/smollm2-gpu3/prompts.jsonl.gz

Writes the conversations (``category``, ``turns``; gzipped when the name ends in .gz) and prints a table of the
kinds. Deterministic for a given seed and corpora.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from collections import Counter
from pathlib import Path

from m2r2_mlx.atomic import atomic_write_bytes
from m2r2_mlx.errors import run_cli
from m2r2_mlx.training.magpie import evaluation_ngrams, ngrams, normal_form

from .corpora import add_corpus_arguments, corpus_paths
from .corpus_sources import Corpora
from .problems import logic_puzzle, math_question, word_problem

PROG = "python -m m2r2_tools.user_requests"
NAMES = ["Maya", "Tom", "Priya", "Jonas", "Aiko", "Luis", "Grace", "Omar", "Nina", "Felix"]


def _pasted(corpora: Corpora, rng: random.Random) -> tuple[str, str]:
    """(what it is, text): one to three consecutive chunks of a book, a speech, a play or the Python docs."""
    kind = rng.randrange(5)
    run = rng.choice([1, 1, 2, 3])
    if kind == 0:
        items = corpora.sotu_passages
        i = rng.randrange(len(items) - run)
        return f"a speech by {items[i][0]}", " ".join(t for _, t in items[i : i + run])
    if kind == 1:
        items = corpora.moby_dick_passages
        i = rng.randrange(len(items) - run)
        return "Moby-Dick", " ".join(items[i : i + run])
    if kind == 2:
        book, text = rng.choice(corpora.austen_passages)
        return book, text
    if kind == 3:
        play, text = rng.choice(corpora.shakespeare_passages)
        return play, text
    return "the Python documentation", rng.choice([p for p in corpora.python_prose if len(p.split()) >= 40])


def _with_text(ask: str, text: str, rng: random.Random) -> str:
    """The request before or after the pasted text, as users write either."""
    return rng.choice([f"{ask}\n\n{text}", f"{text}\n\n{ask}", f'{ask}\n\n"""\n{text}\n"""'])


def _about_passage(asks: list[str]):
    """A kind that pastes a passage and asks one of ``asks`` about it (``{what}``: where the passage is from)."""

    def make(corpora: Corpora, rng: random.Random) -> list[str]:
        what, text = _pasted(corpora, rng)
        return [_with_text(rng.choice(asks).format(what=what), text, rng)]

    return make


passage_question = _about_passage(
    [
        "What is this passage mainly about?",
        "This is from {what}. What is the speaker trying to convince the listener of?",
        "Based only on this text, what do we learn about the people in it?",
        "What does the last sentence mean here?",
        "Which words in this passage tell you about its tone? Give examples.",
        "Is anything in this text surprising or hard to believe? Why?",
        "Pick the most important sentence in this text and explain your choice.",
        "I'm reading {what}. What happens in this part?",
        "What would be a good question to ask a student about this passage, and what is its answer?",
    ]
)
passage_summary = _about_passage(
    [
        "tl;dr?",
        "Can you give me the gist of this?",
        "Summarize this for me.",
        "Summarize this bit of {what} in a few lines.",
        "Write a headline and a three-sentence summary of this.",
        "What are the key points here? Keep it brief.",
        "Sum this up for someone who has no time to read it.",
    ]
)
passage_rewrite = _about_passage(
    [
        "Rewrite this in modern, everyday English.",
        "Make this easier to read.",
        "Turn this into a short list of bullet points.",
        "Rewrite this as a short social media post.",
        "Can you make this sound more formal?",
        "Paraphrase this so it says the same thing in different words.",
        "Shorten this to about half its length.",
        "Rewrite this passage from {what} as a dialogue between two people.",
    ]
)


def code_write(corpora: Corpora, rng: random.Random) -> list[str]:
    stub = rng.choice(corpora.humaneval_prompts)
    ask = rng.choice(
        [
            "Complete this Python function:",
            "Implement this:",
            "Write the code for this function. Keep it simple.",
            "Can you finish this function for me?",
            "Write a Python solution for the function below.",
        ]
    )
    return [f"{ask}\n\n```python\n{stub}```"]


def code_explain(corpora: Corpora, rng: random.Random) -> list[str]:
    kind = rng.randrange(3)
    if kind == 0:
        stub = rng.choice(corpora.humaneval_prompts)
        return [f"What is this function supposed to do? Explain it in plain words.\n\n{stub}"]
    if kind == 1:
        signature, what = rng.choice(corpora.python_functions)
        ask = rng.choice(["How do I use", "Explain", "When would I use", "Give me an example of"])
        return [f"{ask} {signature} in Python? ({what})"]
    term, _ = rng.choice(corpora.python_glossary)
    return [rng.choice([f"What is a {term} in Python?", f"Explain '{term}' with a short code example."])]


def arithmetic(corpora: Corpora, rng: random.Random) -> list[str]:
    a, b, c = rng.randint(11, 999), rng.randint(3, 99), rng.randint(2, 12)
    return [
        rng.choice(
            [
                f"What is {a} * {b}?",
                f"Calculate {a} + {b} * {c}.",
                f"What's {b}% of {a * 10}?",
                f"How much is {a} divided by {c}, to two decimal places?",
                f"Compute ({a} - {b}) / {c} and show the steps.",
                f"Convert {a} minutes to hours and minutes.",
                f"What is {c}/{b + c} + 1/{c} as a fraction?",
                f"If I earn ${a * 10} a month and spend {b}% of it on rent, how much is left?",
                math_question(rng),
            ]
        )
    ]


def reasoning_problem(corpora: Corpora, rng: random.Random) -> list[str]:
    if rng.random() < 0.7:
        return [word_problem(rng, rng.choice(NAMES))]
    return [logic_puzzle(rng, NAMES)]


KINDS = {
    "passage_question": (passage_question, 0.20),
    "passage_summary": (passage_summary, 0.13),
    "passage_rewrite": (passage_rewrite, 0.12),
    "code_write": (code_write, 0.15),
    "code_explain": (code_explain, 0.10),
    "arithmetic": (arithmetic, 0.15),
    "word_problem": (reasoning_problem, 0.15),
}
FOLLOW_UPS = {
    "passage": [
        "Why do you think so?",
        "Can you quote the part that shows it?",
        "Shorter, please.",
        "And in one word?",
    ],
    "code": [
        "Can you add a few test cases?",
        "What is its time complexity?",
        "Now do it without a loop.",
        "Explain the code line by line.",
    ],
    "math": ["Can you check that answer another way?", "What if the numbers were doubled?", "Explain it more simply."],
}


def _follow_up(category: str, rng: random.Random) -> str:
    group = "passage" if category.startswith("passage") else "code" if category.startswith("code") else "math"
    return rng.choice(FOLLOW_UPS[group])


def build(
    corpora: Corpora, n: int, seed: int = 0, follow_up: float = 0.3, banned: Banned | None = None
) -> tuple[list[dict], Counter]:
    """``n`` conversations over KINDS by their shares (a share of them with a follow-up turn); the drop counts."""
    rng = random.Random(seed)
    banned = banned or Banned()
    out, seen, dropped = [], set(), Counter()
    quota = {k: round(n * share) for k, (_, share) in KINDS.items()}
    quota[next(iter(KINDS))] += n - sum(quota.values())
    for category, (make, _) in KINDS.items():
        tries = 0
        while quota[category] and tries < 20 * n:
            tries += 1
            turns = make(corpora, rng)
            key = normal_form(turns[0])
            why = "duplicate" if key in seen else banned.reason(turns[0])
            if why:
                dropped[why] += 1
                continue
            seen.add(key)
            if rng.random() < follow_up:
                turns.append(_follow_up(category, rng))
            out.append({"category": category, "turns": turns})
            quota[category] -= 1
    random.Random(seed + 1).shuffle(out)
    return out, dropped


class Banned:
    """What evaluation questions hold: their ``overlap``-word runs."""

    def __init__(self, paths: list[Path] = (), overlap: int = 8):
        self.overlap = overlap
        self.runs = set().union(*(evaluation_ngrams(p, overlap) for p in paths)) if paths else set()

    def reason(self, request: str) -> str | None:
        return "evaluation overlap" if self.runs and ngrams(request, self.overlap) & self.runs else None


def kinds_table(conversations: list[dict]) -> str:
    by = Counter(c["category"] for c in conversations)
    multi = Counter(c["category"] for c in conversations if len(c["turns"]) > 1)
    words = Counter()
    for c in conversations:
        words[c["category"]] += len(c["turns"][0].split())
    rows = ["| kind | conversations | with a follow-up turn | words in the first turn (mean) |", "|---|---|---|---|"]
    for k in KINDS:
        rows.append(f"| {k} | {by[k]} | {multi[k]} | {words[k] / max(by[k], 1):.0f} |")
    rows.append(
        f"| all | {len(conversations)} | {sum(multi.values())} | {sum(words.values()) / len(conversations):.0f} |"
    )
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("-o", "--out", type=Path, required=True, help="the JSONL file to write (.gz: gzipped)")
    p.add_argument("-n", type=int, default=4000, help="conversations (default 4000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--follow-up", type=float, default=0.3, help="share with a second user turn (default 0.3)")
    p.add_argument("--decontaminate", type=Path, nargs="*", default=[], help="evaluation question files to keep out")
    p.add_argument("--overlap", type=int, default=8, help="words in a run that counts as overlap (default 8)")
    add_corpus_arguments(p)
    return p


def _main() -> int:
    args = build_parser().parse_args()
    corpora = Corpora(corpus_paths(args.fortunes, args.python_docs, args.npm_root))
    conversations, dropped = build(corpora, args.n, args.seed, args.follow_up, Banned(args.decontaminate, args.overlap))
    data = "".join(json.dumps(c) + "\n" for c in conversations).encode()
    atomic_write_bytes(args.out, gzip.compress(data, mtime=0) if args.out.suffix == ".gz" else data)
    print(kinds_table(conversations))
    print(f"wrote {len(conversations)} conversations to {args.out}; dropped: {dict(dropped) or 'none'}")
    return 0


def main() -> None:
    sys.exit(run_cli(PROG, _main))


if __name__ == "__main__":
    main()
