"""m2r2-train-torch: train M2R2 adapters in PyTorch, on one GPU or many (or on the CPU), and write them as an MLX
adapters folder.

    m2r2-train-torch --model smollm2 --prompts prompts.jsonl -o out/                 # one device
    torchrun --nproc-per-node 8 -m m2r2_torch.train --model smollm2 --data rows.npy -o out/

The recipe is m2r2-train's (m2r2_mlx/training/train.py, docs/training.md), and so are its configuration and command
line (m2r2_mlx/training/config.py, cli.py): per batch, the frozen base runs once without gradients (slow stream,
teacher distribution, keys/values), then the fast stream runs each gate interval over whole sequences and only the
adapters get gradients (step.py). The data formats (--text, --prompts, --data rows and loss masks) and
m2r2_config.json are the MLX trainer's.

Several processes (torchrun) split each global batch of --batch-size rows between them and average gradients
(distributed.py). The vocabulary subset and the token count are agreed across processes, so N processes compute the
same update as one process with the whole batch. On a GPU the passes run under bf16 autocast; on the CPU in float32.

OUTPUT/ is an MLX adapters folder (m2r2-chat --adapters OUTPUT), converted from the PyTorch checkpoint in
OUTPUT/torch/ by m2r2-convert's own code (checkpoint.py); beside them the data cache (data.npy), the answer log and
checkpoint/ (--resume continues from it exactly: the same batches, learning rates and optimizer state as an
uninterrupted run).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from m2r2_mlx.atomic import refuse_existing
from m2r2_mlx.core.config import CONFIG_FILE, AdapterMetrics
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.training.cli import train_parser
from m2r2_mlx.training.config import TrainConfig, from_flags, train_gate_indices
from m2r2_mlx.training.data import DATA_CACHE, RowSplit, load_rows, split_rows
from m2r2_mlx.training.report import agreement_table

import numpy as np
import torch
from tqdm.auto import tqdm

from .base import load_base
from .checkpoint import (
    CHECKPOINT,
    TORCH_DIR,
    build_adapters,
    freeze_untrained,
    load_checkpoint,
    save_checkpoint,
    write_outputs,
)
from .distributed import all_sum, barrier, end_processes, setup_processes
from .evaluate import heldout_agreement
from .fast_stream import M2R2Torch
from .generate import generate_batch
from .step import batch_rows, lr_at, step_loss

PROG = "m2r2-train-torch"
STAGES = ("data", "adapters")  # ARLA is m2r2-train's (--stage arla)


@dataclass(frozen=True)
class TorchTrainOptions:
    """m2r2-train-torch's own settings, beside TrainConfig: where and for how long it runs."""

    device: str | None = None  # cuda or cpu (None: cuda when there is one)
    base_name: str | None = None  # the name the adapters record for their base (None: the model's own)
    generate_batch: int = 256  # prompts per self-distillation pass
    max_minutes: float | None = None  # stop training after this long, checkpointed, for a later --resume


def build_parser() -> argparse.ArgumentParser:
    p = train_parser(
        PROG,
        "Train M2R2 accelerator adapters in PyTorch (one device, or several under torchrun) and write them as an "
        "MLX adapters folder. Without mlx-lm installed, --model is a folder, .gguf or repo id.",
    )
    d = TorchTrainOptions()
    p.add_argument(
        "--stage",
        choices=STAGES,
        default="adapters",
        help="'data': only build OUTPUT/data.npy (self-distilling --prompts) for a later --data",
    )
    p.add_argument(
        "--base-name",
        help="the name the adapters record for their base (e.g. smollm2 when --model is "
        "that model's imported folder on a machine without mlx-lm's aliases)",
    )
    p.add_argument(
        "--generate-batch",
        type=int,
        default=d.generate_batch,
        help=f"prompts per generation pass (transformers' generate, greedy; default {d.generate_batch})",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        help="stop training after this long, checkpointed, for a later --resume (a machine lent for minutes at a time)",
    )
    p.add_argument("--device", help="cuda or cpu (default: cuda when there is one)")
    return p


def parse_configs(argv: list[str] | None = None) -> tuple[TrainConfig, TorchTrainOptions]:
    flags = vars(build_parser().parse_args(argv))
    return from_flags(TrainConfig, flags), from_flags(TorchTrainOptions, flags)


def train(config: TrainConfig, options: TorchTrainOptions = TorchTrainOptions()) -> Path:
    """Run ``config`` in this process (one of several under torchrun); returns OUTPUT."""
    config.check(STAGES)
    return TorchTraining(config, options).run()


class TorchTraining:
    """This process's part of an m2r2-train-torch run: rank 0 builds the data, writes checkpoints and outputs."""

    def __init__(self, config: TrainConfig, options: TorchTrainOptions):
        self.config, self.options, self.out = config, options, Path(config.output)
        self.rank, self.world, self.device = setup_processes(options.device)
        self.main = self.rank == 0
        cuda = self.device.type == "cuda"
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()

    def log(self, *parts) -> None:
        if self.main:
            print(*parts, file=sys.stderr)

    def run(self) -> Path:
        config, out = self.config, self.out
        if config.batch_size % self.world:
            raise M2R2Error(
                f"--batch-size {config.batch_size} does not split over {self.world} processes; make it a multiple"
            )
        if config.resume and config.stage != "data" and not (out / CHECKPOINT / "state.json").is_file():
            raise M2R2Error(f"--resume: {out / CHECKPOINT} holds no checkpoint; start without --resume")
        if out.exists() and not config.resume:
            refuse_existing(out, config.force)
        barrier(self.world)  # every process has looked before rank 0 clears the folder
        if self.main and config.force and not config.resume:
            shutil.rmtree(out, ignore_errors=True)
        torch.manual_seed(config.seed)
        lm = load_base(config.model, self.device, tokenizer=not config.data)  # token rows given: no tokenizer needed
        lm.name = self.options.base_name or lm.name
        rows, mask = self.rows(lm)
        if config.stage == "data":
            self.log(f"{out / DATA_CACHE}: {len(rows)} rows of {rows.shape[1]} tokens")
            return out
        split = split_rows(config, rows, mask, out)
        start, opt_state = 0, None
        if config.resume:
            module, cfg, opt_state, start = load_checkpoint(lm, out)
        else:
            module, cfg = build_adapters(config, lm)
        model = M2R2Torch(lm.model, cfg, module).to(self.device)
        gate_indices = train_gate_indices(cfg, config.train_gates)
        freeze_untrained(model, gate_indices)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr, weight_decay=0.0)
        if opt_state is not None:
            opt.load_state_dict(opt_state)
        t0 = time.perf_counter()
        stopped, tokens = self.fit(model, opt, split, start, gate_indices)
        seconds = time.perf_counter() - t0
        if stopped is not None:
            if self.main:
                save_checkpoint(model.m2r2, cfg, opt, stopped, out)
            self.log(
                f"stopped after {self.options.max_minutes:g} minutes at step {stopped} of {config.steps}, "
                f"{tokens / seconds:.0f} tokens/s; continue with the same command and --resume"
            )
        elif self.main:
            self.finish(model, split, rows, lm, tokens, seconds)
        barrier(self.world)
        return out

    def rows(self, lm) -> tuple[np.ndarray, np.ndarray | None]:
        """The token rows and their loss mask: rank 0 builds them (self-distilling --prompts), the others read its
        cache."""
        options = self.options
        generate = lambda prompts, n: generate_batch(
            lm, prompts, n, batch_size=options.generate_batch, seed=self.config.seed
        )
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
            rows, mask = load_rows(self.config, lm, self.out, generate=generate)
        barrier(self.world)
        if not self.main:
            rows, mask = load_rows(self.config, lm, self.out)
        return rows, mask

    def fit(self, model: M2R2Torch, opt, split: RowSplit, start: int, gate_indices) -> tuple[int | None, int]:
        """Steps ``start`` to ``config.steps``, checkpointing on the way; (the step it stopped at when
        --max-minutes ran out, else None; the tokens it trained on)."""
        config, world, device = self.config, self.world, self.device
        ddp = model
        if world > 1:
            ddp = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None
            )
        per_process = config.batch_size // world
        bar = tqdm(
            range(start, config.steps),
            initial=start,
            total=config.steps,
            desc="training adapters",
            unit="step",
            disable=not self.main,
        )
        tokens, t0 = 0, time.perf_counter()
        for step in bar:
            batch = batch_rows(config.seed, step, len(split.train), config.batch_size)
            batch = batch[self.rank * per_process :][:per_process]
            ids = torch.from_numpy(split.train[batch].astype(np.int64)).to(device)
            scored = None
            if config.loss_on == "answers":
                scored = torch.from_numpy(np.flatnonzero(split.train_mask[batch])).to(device)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, config.lr, config.steps)
            with self.autocast:
                loss, kls = step_loss(model, ddp, ids, scored, config.loss, gate_indices, world)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tokens += config.batch_size * config.seq_len
            bar.set_postfix(kl="/".join(f"{k:.2f}" for k in kls), tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
            if self.main and (step + 1) % config.checkpoint_every == 0 and step + 1 < config.steps:
                save_checkpoint(model.m2r2, model.config, opt, step + 1, self.out)
            if step + 1 < config.steps and self.out_of_time(t0):
                bar.close()
                return step + 1, tokens
        bar.close()
        return None, tokens

    def out_of_time(self, t0: float) -> bool:
        """Whether --max-minutes has run out: rank 0's clock decides for every process."""
        if not self.options.max_minutes:
            return False
        late = float(time.perf_counter() - t0 > 60 * self.options.max_minutes and self.main)
        return bool(all_sum(torch.tensor(late, device=self.device), self.world).item())

    def finish(self, model: M2R2Torch, split: RowSplit, rows: np.ndarray, lm, tokens: int, seconds: float) -> None:
        """Rank 0: the held-out evaluation, the outputs (checkpoint.write_outputs) and the upload."""
        config, cfg, out = self.config, model.config, self.out
        self.log("held-out evaluation…")
        model.eval()
        agreement = heldout_agreement(model, split.heldout, split.heldout_mask, self.device, self.autocast)
        cfg.metrics = AdapterMetrics(heldout_agreement=agreement)
        cfg.extra = {
            "train_rows": int(len(split.train)),
            "recipe": config.recipe(self.options),
            "trainer": f"{PROG}, {self.world} process(es) on {self.device.type}",
            "seconds": round(seconds, 1),
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
        }
        self.log(write_outputs(model.m2r2, cfg, out, rows, lm))
        print(agreement_table(agreement))
        self.log(f"{tokens} tokens in {seconds:.1f} s: {tokens / max(seconds, 1e-9):.0f} tokens/s")
        if config.upload_repo:
            if not (out / CONFIG_FILE).is_file():
                raise M2R2Error(
                    f"--upload-repo uploads the MLX adapters folder, which was not written here (no "
                    f"mlx); convert {out / TORCH_DIR} with m2r2-convert where MLX runs, then upload that "
                    f"folder with `huggingface-cli upload {config.upload_repo} DIR`"
                )
            from m2r2_mlx.core.hub import upload_adapters  # needs mlx-lm: present, since the MLX folder was written

            self.log(f"uploaded to {upload_adapters(out, config.upload_repo)}")


def _main() -> int:
    config, options = parse_configs()
    try:
        train(config, options)
    finally:
        end_processes()
    return 0


def main() -> None:
    sys.exit(run_cli(PROG, _main))


if __name__ == "__main__":
    main()
