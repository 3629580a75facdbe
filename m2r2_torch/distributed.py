"""Processes for m2r2-train-torch: one, or several under torchrun (WORLD_SIZE set), which split each global batch and
average gradients (DistributedDataParallel; nccl on GPUs, gloo on the CPU)."""

from __future__ import annotations

import datetime
import os

from m2r2_mlx.errors import M2R2Error

import torch
import torch.distributed as dist


def setup_processes(device: str | None) -> tuple[int, int, torch.device]:
    """(rank, world size, device). Under torchrun, joins the process group; self-distillation on rank 0 can take
    long, hence the generous timeout on the others' wait."""
    cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise M2R2Error("--device cuda asked for, but PyTorch sees no GPU here; drop --device or pass --device cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=6))
    return rank, world, torch.device(f"cuda:{local}" if cuda else "cpu")


def all_sum(x: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(x)
    return x


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def end_processes() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
