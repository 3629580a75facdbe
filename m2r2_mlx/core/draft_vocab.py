"""The draft LM head's vocabulary: the tokens a model emits most, counted on its own text.

A 135M model spends a fifth of a decode step in its 49k-row LM head; a drafter that
scores only the few thousand tokens carrying almost all of the mass costs far less,
and verification stays exact whatever the drafter misses. Stored beside the adapters
as ``draft_vocab.json`` (ids, most frequent first, with the mass they cover).

    python -m m2r2_mlx.core.draft_vocab ADAPTERS --data OUT/data.npy    # count, then write ADAPTERS/draft_vocab.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from ..atomic import atomic_write_text
from ..errors import M2R2Error, run_cli
from .config import CONFIG_FILE
from .integrity import record_hashes

FILE = "draft_vocab.json"
PROG = "python -m m2r2_mlx.core.draft_vocab"


def rank_tokens(rows: np.ndarray, vocab_size: int) -> tuple[list[int], list[float]]:
    """Token ids seen in ``rows``, most frequent first, and the cumulative share of all tokens they cover."""
    counts = np.bincount(np.asarray(rows).ravel(), minlength=vocab_size)
    order = np.argsort(-counts, kind="stable")
    order = order[counts[order] > 0]
    cover = np.cumsum(counts[order]) / counts.sum()
    return order.tolist(), cover.tolist()


def save_draft_vocab(folder: str | Path, tokens: Sequence[int], cover: Sequence[float], source: str) -> Path:
    marks = {n: round(cover[min(n, len(cover)) - 1], 4) for n in (1024, 2048, 4096, 8192, 16384)}
    blob = {"source": source, "coverage": marks, "tokens": list(tokens)}
    path = atomic_write_text(Path(folder) / FILE, json.dumps(blob))
    if (Path(folder) / CONFIG_FILE).is_file():  # an adapters folder already: its record gains this file
        record_hashes(folder)
    return path


def load_draft_vocab(folder: str | Path, size: int, otherwise: str = "drop --draft-vocab") -> list[int]:
    """The ``size`` most frequent token ids; ``otherwise`` completes the error's fix when the file is missing."""
    path = Path(folder) / FILE
    if not path.is_file():
        raise M2R2Error(f"{folder} has no {FILE}; build it with python -m m2r2_mlx.core.draft_vocab, or {otherwise}")
    tokens = json.loads(path.read_text())["tokens"]
    return tokens[:size]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Write ADAPTERS/draft_vocab.json.")
    p.add_argument("adapters", help="adapters folder to write draft_vocab.json into")
    p.add_argument("--data", required=True, help="token rows (.npy, as m2r2-train caches them in OUT/data.npy)")
    return p


def _main() -> int:
    args = build_parser().parse_args()
    if not Path(args.data).is_file():
        raise M2R2Error(f"{args.data} not found; point --data at a data.npy written by m2r2-train")
    rows = np.load(args.data)
    tokens, cover = rank_tokens(rows, int(rows.max()) + 1)  # tokens never seen are never ranked
    out = save_draft_vocab(args.adapters, tokens, cover, source=f"{Path(args.data).name}: {rows.size} tokens")
    print(f"wrote {out}: {len(tokens)} distinct tokens; top 4096 cover {100 * cover[min(4096, len(cover)) - 1]:.1f}%")
    return 0


def main() -> None:
    sys.exit(run_cli(PROG, _main))


if __name__ == "__main__":
    main()
