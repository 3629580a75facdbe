"""An adapters folder trained on an MoE with the router target (router_target.py), from text files or token ids:
what ``python -m m2r2_mlx.moe adapters`` and the benchmark model's build write.

The folder is an ordinary M2R2 adapters folder (``--adapters`` reads it; the expert predictors use it); its
``m2r2_config.json`` records the recipe and the held-out recall per distance, before and after training.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..atomic import refuse_existing
from ..core.adapters import load_adapters, new_m2r2, save_adapters
from ..core.config import even_gates
from ..errors import M2R2Error
from ..training.data import pack_rows, read_text_files
from .router_target import RouterTarget, RouterTargetConfig


@dataclass(frozen=True)
class RouterAdaptersSpec:
    out: Path  # the adapters folder to write
    text: tuple[str, ...] = ()  # plain text files to train on
    ids: Path | None = None  # or token ids (.npy), e.g. a model folder's heldout.npy
    heldout: Path | None = None  # token ids (.npy) to evaluate on (default: the last rows of the data)
    init: Path | None = None  # warm start from this adapters folder (its gates and ranks)
    gates: tuple[int, ...] | None = None  # new adapters: gates (default: every ``every`` layers)
    every: int = 6
    rank: int = 32
    seq_len: int = 128
    tokens: int = 65536  # most training tokens read
    eval_rows: int = 8
    train: RouterTargetConfig = field(default_factory=RouterTargetConfig)
    force: bool = False

    def check(self) -> None:
        refuse_existing(self.out, self.force)
        if bool(self.text) == (self.ids is not None):
            raise M2R2Error("give the training data as --text files or as --ids token ids (one of them)")
        for path in [Path(p) for p in self.text] + [p for p in (self.ids, self.heldout, self.init) if p is not None]:
            if not path.exists():
                raise M2R2Error(f"{path} not found; check the path")
        if self.seq_len < 8 or self.rank < 1 or self.eval_rows < 1 or self.every < 1:
            raise M2R2Error("--seq-len must be at least 8, --rank, --every and --eval-rows at least 1")
        self.train.check()


def _rows(ids: np.ndarray, seq_len: int) -> np.ndarray:
    n = ids.size // seq_len
    return ids[: n * seq_len].astype(np.int32).reshape(n, seq_len)


def training_rows(lm, spec: RouterAdaptersSpec) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, held-out rows), (N, seq_len) token ids each."""
    if spec.text:
        if lm.tokenizer is None:
            raise M2R2Error(f"{lm.name} has no tokenizer to read --text with; pass --ids token ids instead")
        tokens = [lm.tokenizer.encode(t) for t in read_text_files(list(spec.text))]
        rows = pack_rows(tokens, spec.seq_len)[: max(1, spec.tokens // spec.seq_len)]
    else:
        rows = _rows(np.load(spec.ids).reshape(-1)[: spec.tokens], spec.seq_len)
    if spec.heldout is not None:
        heldout = _rows(np.load(spec.heldout).reshape(-1), spec.seq_len)[: spec.eval_rows]
    else:
        heldout, rows = rows[-spec.eval_rows :], rows[: -spec.eval_rows]
    if len(rows) < 1 or len(heldout) < 1:
        raise M2R2Error(
            f"the data holds too few tokens for rows of {spec.seq_len} (training and held-out); give more text"
        )
    return rows, heldout


def train_router_adapters(lm, spec: RouterAdaptersSpec, progress: bool = True) -> dict:
    """Train adapters for the MoE ``lm`` on the router target and write them to ``spec.out``; returns the record
    (also in the folder's m2r2_config.json, under extra["router_target"])."""
    spec.check()
    start = time.perf_counter()
    rows, heldout = training_rows(lm, spec)
    if spec.init is not None:
        m2r2 = load_adapters(lm, spec.init)
    else:
        gates = list(spec.gates) if spec.gates else even_gates(len(lm.model.layers), spec.every)
        m2r2 = new_m2r2(lm, gates=gates, rank=spec.rank)
    target = RouterTarget(m2r2, spec.train)
    before = target.evaluate(heldout)
    loss_before = target.eval_loss(heldout[: spec.train.batch_size])
    log = target.train(rows, heldout, progress=progress)
    record = {
        "recipe": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(spec).items() if k != "force"},
        "train_rows": int(len(rows)),
        "heldout_rows": int(len(heldout)),
        "heldout_loss": [loss_before, target.eval_loss(heldout[: spec.train.batch_size])],
        "before": before,
        "after": target.evaluate(heldout),
        "loss": [entry["loss"] for entry in log],
        "train_s": time.perf_counter() - start,
    }
    m2r2.config.extra = {**m2r2.config.extra, "router_target": record}
    save_adapters(m2r2, spec.out, overwrite=True, carry_from=spec.init)  # spec.check refused an unforced overwrite
    return record
