"""TrainConfig: what both trainers, m2r2-train (MLX) and m2r2-train-torch (PyTorch), are asked to do.

The command line that fills it is training/cli.py's; each trainer adds its own few settings (its options dataclass)
on top. This module imports neither mlx nor torch: the PyTorch trainer reads it where mlx is not installed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Sequence, TypeVar

from ..core.config import M2R2Config
from ..errors import M2R2Error

STAGES = ("data", "adapters", "arla", "both")  # what a run builds; m2r2-train-torch builds the first two
LOSS_ON = ("all", "answers")
# where a run writes, whether it starts over and where it uploads: not part of the recipe the adapters record
NOT_RECIPE = ("output", "resume", "force", "upload_repo")


@dataclass(frozen=True)
class DistillLoss:
    """The loss at each gate: temperature-scaled KL(teacher || gate) over the union of the teacher's top-k tokens,
    plus align * (1 - cos(h_fast at the gate, h_final))."""

    temperature: float = 1.0
    top_k: int = 16
    align: float = 1.0


@dataclass(frozen=True)
class TrainConfig:
    """A training run's settings; each field is the flag of the same name (seq_len: --seq-len)."""

    output: str  # the adapters folder to write (with the data cache and checkpoints beside)
    model: str | None = None  # base model: alias, repo id, folder or .gguf (None: the embedded smollm2)
    # data: token rows of an earlier run, or plain text files and prompts whose answers the base writes first
    data: str | None = None
    text: tuple[str, ...] = ()
    prompts: str | None = None
    answer_tokens: int = 160  # most tokens per self-distilled answer
    seq_len: int = 256
    # the adapters: gates (None: every `every` layers), bottleneck rank (one, or one per interval; None: 64, or
    # the --init adapters' own), the first interval's context feature, the gates whose interval trains (None: all)
    gates: tuple[int, ...] | None = None
    every: int = 6
    rank: int | tuple[int, ...] | None = None
    context_feature: bool = False
    train_gates: tuple[int, ...] | None = None
    init: str | None = None  # warm start from this adapters folder
    # the optimisation: batches of rows, AdamW with warmup and cosine decay
    batch_size: int = 4
    steps: int = 300
    lr: float = 2e-3
    # the loss: KL(teacher || gate) at distill_temp over the union of the teacher's top-k tokens, plus align *
    # (1 - cos); on every position, or (loss_on "answers") only those predicting answer or plain-text tokens
    distill_temp: float = 1.0
    distill_top_k: int = 16
    align: float = 1.0
    loss_on: str = "all"
    eval_rows: int = 16  # held-out rows for the final evaluation
    checkpoint_every: int = 50
    seed: int = 0
    stage: str = "adapters"  # one of STAGES
    resume: bool = False  # continue from OUTPUT/checkpoint
    force: bool = False  # replace an existing OUTPUT
    upload_repo: str | None = None  # after training, upload the adapters folder to this Hub repo

    def check(self, stages: tuple[str, ...] = STAGES) -> None:
        """Refuse settings no run can follow (``stages``: those the trainer builds), in one line."""
        if self.batch_size < 1 or self.seq_len < 2 or self.steps < 0:
            raise M2R2Error("--batch-size must be at least 1, --seq-len at least 2 and --steps not negative")
        if self.stage not in stages:
            raise M2R2Error(f"--stage {self.stage} is not one of {', '.join(stages)}")
        if self.loss_on not in LOSS_ON:
            raise M2R2Error(f"--loss-on {self.loss_on} is not one of {', '.join(LOSS_ON)}")

    @property
    def loss(self) -> DistillLoss:
        return DistillLoss(self.distill_temp, self.distill_top_k, self.align)

    @property
    def adapter_rank(self) -> int | list[int] | None:
        """``rank`` as M2R2Config.adapter_rank spells it."""
        return list(self.rank) if isinstance(self.rank, tuple) else self.rank

    def recipe(self, *extra) -> dict:
        """The settings the adapters record (m2r2_config.json's extra["recipe"]), with those of ``extra``
        (a trainer's options dataclasses)."""
        out = {k: v for k, v in asdict(self).items() if k not in NOT_RECIPE}
        for options in extra:
            out.update(asdict(options))
        return out


def train_gate_indices(cfg: M2R2Config, train_gates: Sequence[int] | None) -> list[int] | None:
    """Indices into ``cfg.gates`` of the gates whose intervals train (None: all of them)."""
    if not train_gates:
        return None
    try:
        chosen = sorted({cfg.gates.index(g) for g in train_gates})
    except ValueError:
        named = ",".join(map(str, train_gates))
        raise M2R2Error(f"--train-gates {named} must name gates of the adapters, which are {cfg.gates}") from None
    if cfg.adapter_form != "parallel_bottleneck":
        raise M2R2Error("--train-gates needs bottleneck adapters (a LoRA delta serves every interval of its layer)")
    return chosen


Config = TypeVar("Config")


def from_flags(cls: type[Config], flags: Mapping[str, Any]) -> Config:
    """The dataclass ``cls`` from parsed command-line values (vars of the parse): those naming its fields, lists
    as tuples; the others are left for another dataclass."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in flags.items() if k in names})
