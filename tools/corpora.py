"""Training data from corpora that packages ship (never from the Spec-Bench evaluation questions).

    python -m m2r2_tools.corpora -o data/          # writes data/prompts.jsonl and data/text.txt

The fast stream must learn what the base model says in chat, so most of the data is
the base model's own answers (self-distillation) to chat requests. The requests are
built from package corpora (corpus_sources) with instruction templates, spread over the kinds of
task a chat model meets (the same kinds Spec-Bench measures, none of its questions):
writing, roleplay, reasoning, math, coding, extraction, STEM, humanities,
translation, summarisation, factual QA, word problems and answering from a passage.
Math and logic problems are generated from templates with random numbers (problems).
Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections import Counter
from pathlib import Path

from m2r2_mlx.errors import M2R2Error, run_cli

from .corpus_sources import Corpora, CorpusPaths
from .problems import logic_puzzle, math_question, word_problem

PROG = "python -m m2r2_tools.corpora"
CATEGORIES = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
    "translation",
    "summarization",
    "qa",
    "math_reasoning",
    "rag",
)

ROLE_QUESTIONS = [
    "What do you care about most, and why?",
    "Describe an ordinary day in your life.",
    "What advice would you give to a young person today?",
    "What is your greatest fear?",
    "Tell me about someone you admire.",
    "How would you spend a sudden fortune?",
]
LANGUAGES = ["French", "German", "Spanish", "Italian", "Portuguese", "Chinese"]
FOLLOW_UPS = [
    "Can you make that shorter?",
    "Explain it again for a ten-year-old.",
    "Give one more example.",
    "Summarize your answer in one sentence.",
    "Now rewrite it in a more formal tone.",
    "What is the weakest point of your answer?",
    "Turn your answer into a bulleted list.",
]


def _passage(corpora: Corpora, rng: random.Random) -> tuple[str, str]:
    """(source description, passage) from a random prose corpus."""
    kind = rng.randrange(3)
    if kind == 0:
        book, text = rng.choice(corpora.austen_passages)
        return f"Jane Austen's {book}", text
    if kind == 1:
        return "Moby-Dick", rng.choice(corpora.moby_dick_passages)
    who, text = rng.choice(corpora.sotu_passages)
    return f"a State of the Union address by {who}", text


def _sentence(corpora: Corpora, rng: random.Random) -> str:
    text = _passage(corpora, rng)[1]
    sents = [s for s in re.split(r"(?<=[.!?])\s+", text) if 6 <= len(s.split()) <= 30]
    return rng.choice(sents) if sents else text.split(".")[0] + "."


def make_prompt(corpora: Corpora, category: str, rng: random.Random) -> str:
    """One chat request of the given kind, built from the corpora."""
    names = [n for n, _ in corpora.austen_characters] + [n for n, _ in corpora.shakespeare_speakers]
    if category == "writing":
        return rng.choice(
            [
                lambda: f"Write a short poem inspired by this quote:\n\n{rng.choice(corpora.fortunes)}",
                lambda: (
                    f"Write a short story (under 200 words) that begins with this line:\n\n{_sentence(corpora, rng)}"
                ),
                lambda: "Write an engaging blog post for beginners about {}.".format(
                    rng.choice(corpora.python_glossary)[0]
                ),
                lambda: "Write a persuasive letter to a newspaper about this issue:\n\n{}".format(
                    rng.choice(corpora.sotu_passages)[1]
                ),
                lambda: "Write a diary entry by {} from {} about an unexpected visitor.".format(
                    *rng.choice(corpora.austen_characters)
                ),
            ]
        )()
    if category == "roleplay":
        who, work = rng.choice(
            corpora.austen_characters
            + corpora.shakespeare_speakers
            + [("Captain Ahab", "Moby-Dick"), ("Ishmael", "Moby-Dick")]
        )
        return (
            f"Pretend to be {who} from {work} in this conversation, and speak as they would. "
            f"{rng.choice(ROLE_QUESTIONS)}"
        )
    if category == "reasoning":
        return logic_puzzle(rng, names)
    if category == "math":
        return math_question(rng)
    if category == "coding":
        return rng.choice(
            [
                lambda: (
                    f"Complete the following Python function:\n\n```python\n{rng.choice(corpora.humaneval_prompts)}```"
                ),
                lambda: "Write a Python function {} that does the following: {} Include a short example.".format(
                    *rng.choice(corpora.python_functions)
                ),
                lambda: "Explain what the Python function {} does and show how to use it.".format(
                    rng.choice(corpora.python_functions)[0]
                ),
            ]
        )()
    if category == "extraction":
        src, text = _passage(corpora, rng)
        return rng.choice(
            [
                f"Extract every person and place named in this passage from {src}, as two lists:\n\n{text}",
                f"List all the numbers and dates mentioned in the following text, with what each refers to:\n\n{text}",
                f'Read this passage and return a JSON object with the keys "topic", "tone" and "key_points":\n\n{text}',
            ]
        )
    if category == "stem":
        term, _ = rng.choice(corpora.python_glossary)
        other, _ = rng.choice(corpora.python_glossary)
        return rng.choice(
            [
                f"In programming, what is a {term}? Explain it with an example.",
                f"What is the difference between {term} and {other} in Python?",
                f"Why is the idea of {term} useful in computer science?",
            ]
        )
    if category == "humanities":
        who, text = rng.choice(corpora.sotu_passages)
        play, passage = rng.choice(corpora.shakespeare_passages)
        return rng.choice(
            [
                "Discuss the historical context and the main argument of this passage from a State of the Union "
                f"address by {who}:\n\n{text}",
                f"What themes does this passage from {play} explore? Discuss them briefly.\n\n{passage}",
                f"What does this saying reveal about human nature? Do you agree?\n\n{rng.choice(corpora.fortunes)}",
            ]
        )
    if category == "translation":
        return f"Translate English to {rng.choice(LANGUAGES)}: {_sentence(corpora, rng)}"
    if category == "summarization":
        return f"Summarize: {_passage(corpora, rng)[1]}"
    if category == "qa":
        return rng.choice(
            [
                lambda: "Which novel by Jane Austen features the character {}?".format(
                    rng.choice(corpora.austen_characters)[0]
                ),
                lambda: "In which play by Shakespeare does {} appear, and who is that character?".format(
                    rng.choice(corpora.shakespeare_speakers)[0]
                ),
                lambda: "What does the Python function {} return?".format(rng.choice(corpora.python_functions)[0]),
                lambda: "Who was president of the United States in {}?".format(
                    rng.choice(corpora.sotu_passages)[0].split("(")[-1].rstrip(")")
                ),
                lambda: "What is a {} in Python?".format(rng.choice(corpora.python_glossary)[0]),
            ]
        )()
    if category == "math_reasoning":
        return word_problem(rng, rng.choice(names))
    if category == "rag":
        src, text = _passage(corpora, rng)
        return rng.choice(
            [
                f"{text}\n\nBased on the passage above, what is the author's main point?",
                f"{text}\n\nUsing only the passage above, answer: who or what is it mainly about, and what happens?",
                f"Context: {text}\n\nQuestion: What can we infer about the speaker's attitude from this passage from "
                f"{src}?",
            ]
        )
    raise ValueError(f"unknown category {category!r}")


TEXT_SOURCES = {
    "shakespeare": lambda c: [x for _, x in c.shakespeare_passages],
    "fortunes": lambda c: c.fortunes,
    "austen": lambda c: [x for _, x in c.austen_passages],
    "moby-dick": lambda c: c.moby_dick_passages,
    "sotu": lambda c: [x for _, x in c.sotu_passages],
    "python-docs": lambda c: c.python_prose,
}


def build(
    corpora: Corpora,
    seed: int = 0,
    n_prompts: int = 2600,
    follow_up: float = 0.2,
    text_chars: int = 300_000,
    text_sources: tuple[str, ...] = tuple(TEXT_SOURCES),
) -> tuple[list[dict], str]:
    """Prompts spread evenly over CATEGORIES (a share with a second turn) and plain text drawn
    evenly from ``text_sources``."""
    rng = random.Random(seed)
    items = []
    for i in range(n_prompts):
        cat = CATEGORIES[i % len(CATEGORIES)]
        turns = [make_prompt(corpora, cat, rng)]
        if rng.random() < follow_up:
            turns.append(rng.choice(FOLLOW_UPS))
        items.append({"category": cat, "turns": turns})
    rng.shuffle(items)
    sources = [TEXT_SOURCES[name](corpora) for name in text_sources]
    text_parts, size = [], 0
    while size < text_chars:
        part = rng.choice(rng.choice(sources))
        text_parts.append(part)
        size += len(part)
    return items, "\n\n".join(text_parts)


def add_corpus_arguments(p: argparse.ArgumentParser) -> None:
    """Where the corpora that are not Python packages live (every tool that reads them takes these)."""
    default = CorpusPaths()
    p.add_argument(
        "--fortunes", type=Path, default=default.fortunes, help=f"fortunes folder (default {default.fortunes})"
    )
    p.add_argument(
        "--python-docs",
        type=Path,
        default=default.python_docs,
        help=f"the Python docs' reST sources (default {default.python_docs})",
    )
    p.add_argument(
        "--npm-root",
        type=Path,
        action="append",
        help="node_modules folder holding the @stdlib datasets; repeat for several "
        f"(default: {', '.join(map(str, default.npm_roots))}, then npm's global root)",
    )


def corpus_paths(fortunes: Path, python_docs: Path, npm_roots: list[Path] | None) -> CorpusPaths:
    """CorpusPaths from add_corpus_arguments' values (no --npm-root: the default roots)."""
    return CorpusPaths(fortunes, python_docs, tuple(npm_roots) if npm_roots else CorpusPaths().npm_roots)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Build M2R2 training data from package corpora.")
    p.add_argument("-o", "--output", required=True, help="folder for prompts.jsonl and text.txt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=2600, help="chat prompts, spread evenly over the task kinds")
    p.add_argument("--follow-up", type=float, default=0.2, help="share of prompts with a second user turn")
    p.add_argument("--text-chars", type=int, default=300_000, help="characters of plain text")
    p.add_argument(
        "--text-sources",
        default=",".join(TEXT_SOURCES),
        help=f"corpora the plain text comes from (default: all of {','.join(TEXT_SOURCES)})",
    )
    add_corpus_arguments(p)
    return p


def _main() -> int:
    args = build_parser().parse_args()
    names = tuple(n.strip() for n in args.text_sources.split(",") if n.strip())
    unknown = [n for n in names if n not in TEXT_SOURCES]
    if unknown or not names:
        raise M2R2Error(
            f"unknown text source(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(TEXT_SOURCES)}"
        )
    corpora = Corpora(corpus_paths(args.fortunes, args.python_docs, args.npm_root))
    items, text = build(corpora, args.seed, args.prompts, args.follow_up, args.text_chars, names)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompts.jsonl").write_text("".join(json.dumps(it) + "\n" for it in items))
    (out / "text.txt").write_text(text)
    counts = Counter(it["category"] for it in items)
    print(
        f"wrote {len(items)} prompts ({', '.join(f'{c} {n}' for c, n in counts.items())}) and {len(text):,} characters "
        f"of text to {out}"
    )
    return 0


def main() -> None:
    sys.exit(run_cli(PROG, _main))


if __name__ == "__main__":
    main()
