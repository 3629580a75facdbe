"""Training speed on this machine: m2r2-train's step (MLX) beside m2r2-train-torch's (PyTorch, one process), on the
same base, adapters, rows, interval(s), batch and sequence length; tokens/s after warm-up steps, and their ratio.

    python -m experiments.train_speed --data build/data-v3/data.npy --steps 20            # every gate's interval
    python -m experiments.train_speed --data build/data-v3/data.npy --steps 20 --train-gates 6   # the first only

Both run their trainers' own step code (m2r2_mlx.training.trainer.Trainer.step under its default CPU kernels, and
m2r2_torch.step.step_loss + backward + AdamW), each in a process of its own with the machine's threads, one after
the other (neither framework's threads or caches linger in the other's measurement).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass

import m2r2_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core on Linux)
from m2r2_mlx.core.adapters import new_m2r2
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.models.blas import blas_info
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.training.cli import parse_layers
from m2r2_mlx.training.config import DistillLoss, train_gate_indices
from m2r2_mlx.training.cpu_kernels import fast_kernels
from m2r2_mlx.training.trainer import Trainer

import mlx.core as mx
import numpy as np
import torch
from tqdm.auto import tqdm

from m2r2_torch.base import load_base
from m2r2_torch.checkpoint import freeze_untrained
from m2r2_torch.fast_stream import M2R2Torch
from m2r2_torch.step import batch_rows, lr_at, step_loss


@dataclass(frozen=True)
class SpeedRun:
    model: str | None
    rank: int
    lr: float
    batch_size: int
    steps: int
    warmup: int
    train_gates: list[int] | None


def time_steps(step, n_warmup: int, n_steps: int, desc: str) -> float:
    """Seconds per step over ``n_steps`` after ``n_warmup`` untimed ones; ``step(i)`` runs step i to completion."""
    for i in range(n_warmup):
        step(i)
    t0 = time.perf_counter()
    for i in tqdm(range(n_warmup, n_warmup + n_steps), desc=desc, unit="step"):
        step(i)
    return (time.perf_counter() - t0) / n_steps


def mlx_seconds(run: SpeedRun, rows, gates) -> float:
    lm = load_model(run.model)
    lm.model.freeze()
    m2r2 = new_m2r2(lm, gates=gates, rank=run.rank)
    total = run.warmup + run.steps
    trainer = Trainer(m2r2, lr=run.lr, steps=total, gate_indices=train_gate_indices(m2r2.config, run.train_gates))

    def step(i):
        with fast_kernels(lm.model, True):  # m2r2-train's default on the CPU
            trainer.step(mx.array(rows[batch_rows(0, i, len(rows), run.batch_size)]))

    return time_steps(step, run.warmup, run.steps, "m2r2-train (MLX)")


def torch_seconds(run: SpeedRun, rows, gates) -> float:
    lm = load_base(run.model, "cpu", tokenizer=False)
    model = M2R2Torch(lm.model, lm.m2r2_config(gates, adapter_rank=run.rank))
    gate_indices = train_gate_indices(model.config, run.train_gates)
    freeze_untrained(model, gate_indices)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=run.lr, weight_decay=0.0)
    total = run.warmup + run.steps

    def step(i):
        ids = torch.from_numpy(rows[batch_rows(0, i, len(rows), run.batch_size)].astype(np.int64))
        for group in opt.param_groups:
            group["lr"] = lr_at(i, run.lr, total)
        loss, _ = step_loss(model, model, ids, None, DistillLoss(), gate_indices, 1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return time_steps(step, run.warmup, run.steps, "m2r2-train-torch (PyTorch)")


def side_seconds(side: str) -> float:
    """Seconds per step of one trainer, measured in a fresh process (this command with --side)."""
    r = subprocess.run(
        [sys.executable, "-m", "experiments.train_speed", *sys.argv[1:], "--side", side],
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    lines = [line for line in r.stdout.splitlines() if line.startswith("SECONDS_PER_STEP ")]
    if r.returncode or not lines:
        raise M2R2Error(f"the {side} trainer's run failed (exit {r.returncode}); its messages are above")
    return float(lines[-1].split()[1])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.train_speed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="token rows (an m2r2-train data.npy)")
    ap.add_argument("--model", default=None, help="base model (default: the embedded smollm2)")
    ap.add_argument("--gates", default="6,12,18,24")
    ap.add_argument("--train-gates", type=parse_layers, help="train only these gates' intervals (default: all)")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256, help="the rows' first N tokens")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per trainer")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--side", choices=("mlx", "torch"), help=argparse.SUPPRESS)  # one trainer, in its own process
    return ap


def _main() -> int:
    args = build_parser().parse_args()
    rows = np.load(args.data)
    if rows.ndim != 2 or rows.shape[1] < args.seq_len:
        raise M2R2Error(f"{args.data} holds rows of shape {rows.shape}; need (N, >= {args.seq_len}) token ids")
    rows = np.ascontiguousarray(rows[:, : args.seq_len])
    gates = [int(g) for g in args.gates.split(",")]
    if args.side:
        run = SpeedRun(args.model, args.rank, args.lr, args.batch_size, args.steps, args.warmup, args.train_gates)
        seconds = (mlx_seconds if args.side == "mlx" else torch_seconds)(run, rows, gates)
        print(f"SECONDS_PER_STEP {seconds}")
        return 0
    print(blas_info().describe(), f"; torch {torch.__version__}, {torch.get_num_threads()} threads", file=sys.stderr)
    tokens = args.batch_size * args.seq_len
    mlx_s, torch_s = (side_seconds(side) for side in ("mlx", "torch"))
    training = ",".join(map(str, args.train_gates)) if args.train_gates else "all"
    what = f"gates {args.gates}, training {training}; {args.batch_size} x {args.seq_len} tokens"
    print(f"| trainer ({what}) | s/step | tokens/s |\n|---|---:|---:|")
    print(f"| m2r2-train (MLX) | {mlx_s:.2f} | {tokens / mlx_s:.0f} |")
    print(f"| m2r2-train-torch (PyTorch) | {torch_s:.2f} | {tokens / torch_s:.0f} |")
    print(f"PyTorch / MLX tokens/s: {mlx_s / torch_s:.2f}x ({args.steps} timed steps each after {args.warmup})")
    return 0


def main() -> None:
    sys.exit(run_cli("python -m experiments.train_speed", _main))


if __name__ == "__main__":
    main()
