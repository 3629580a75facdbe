"""The training corpora builder (m2r2_tools.corpora) reads the corpora where it is told (--fortunes, --python-docs,
--npm-root), and a corpus that is not there is one line naming the flag that points at it."""

from pathlib import Path

from m2r2_mlx.errors import M2R2Error

import pytest

from m2r2_tools.corpora import build
from m2r2_tools.corpus_sources import INSTALL, Corpora, CorpusPaths

from .inprocess import run_main

SAYINGS = [f"Saying number {i}: a stitch in time saves nine, and so do the other {i} stitches." for i in range(5)]


def _fortunes(folder: Path) -> Path:
    folder.mkdir()
    (folder / "sayings.u8").write_text("\n%\n".join(SAYINGS))
    return folder


def test_the_corpora_are_read_where_the_paths_say(tmp_path):
    docs = tmp_path / "pydocs"
    (docs / "library").mkdir(parents=True)
    (docs / "library" / "m.rst.txt").write_text(
        ".. function:: clamp(x, low, high)\n\n   Return x limited to the range from low to high. More text.\n\n"
    )
    (docs / "glossary.rst.txt").write_text(
        "Glossary\n\n   iterator\n      An object representing a stream of data, one item at a time.\n\n"
    )
    moby = tmp_path / "npm" / "@stdlib" / "datasets-moby-dick" / "data"
    moby.mkdir(parents=True)
    (moby / "chapter_1.txt").write_text("CHAPTER 1\n" + "Call me Ishmael. " * 40)
    corpora = Corpora(CorpusPaths(_fortunes(tmp_path / "fortunes"), docs, (tmp_path / "npm",)))

    assert corpora.fortunes == SAYINGS
    assert corpora.python_functions == [("clamp(x, low, high)", "Return x limited to the range from low to high.")]
    assert corpora.python_glossary[0][0] == "iterator"
    assert corpora.moby_dick_passages[0].startswith("Call me Ishmael.")
    items, text = build(corpora, n_prompts=0, text_chars=200, text_sources=("fortunes",))
    assert items == [] and set(text.split("\n\n")) <= set(SAYINGS)


@pytest.mark.parametrize(
    "paths, read, flag",
    [
        (CorpusPaths(fortunes=Path("/nonexistent/fortunes")), "fortunes", "--fortunes"),
        (CorpusPaths(python_docs=Path("/nonexistent/docs")), "python_glossary", "--python-docs"),
        (CorpusPaths(npm_roots=(Path("/nonexistent/node_modules"),)), "sotu_passages", "--npm-root"),
    ],
)
def test_a_missing_corpus_names_its_flag(paths, read, flag, monkeypatch):
    monkeypatch.setenv("PATH", "")  # no npm: its global root is not searched
    with pytest.raises(M2R2Error, match=f"not found; install the corpora with: .*, or point {flag} at them"):
        getattr(Corpora(paths), read)


def test_command_line_takes_the_paths(tmp_path):
    cmd = ["--prompts", "0", "--text-chars", "100"]
    fortunes = _fortunes(tmp_path / "fortunes")
    r = run_main(
        "m2r2_tools.corpora",
        *cmd,
        "--text-sources",
        "fortunes",
        "--fortunes",
        str(fortunes),
        "-o",
        str(tmp_path / "out"),
    )
    assert r.returncode == 0, r.stderr
    assert set((tmp_path / "out" / "text.txt").read_text().split("\n\n")) <= set(SAYINGS)
    assert (tmp_path / "out" / "prompts.jsonl").read_text() == ""

    r = run_main(
        "m2r2_tools.corpora",
        *cmd,
        "--text-sources",
        "fortunes",
        "--fortunes",
        str(tmp_path / "none"),
        "-o",
        str(tmp_path / "x"),
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"python -m m2r2_tools.corpora: error: {tmp_path / 'none'} not found; install the corpora with: {INSTALL}, "
        "or point --fortunes at them"
    ]
