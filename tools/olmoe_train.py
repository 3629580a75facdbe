"""Training the tiny OLMoE in PyTorch (an MLX model of this size trains at ~300 tokens/s on a 2-core CPU, far too slow
to learn routing; a GPU, or Apple's MPS, does it in minutes). Writes bf16 shards that tiny_olmoe's export step turns
into a float32 MLX folder."""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from m2r2_mlx.atomic import atomic_folder
from m2r2_mlx.errors import M2R2Error

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .olmoe_model import TinyOlmoe, moe_losses


@dataclass(frozen=True)
class OlmoeTraining:
    device: str = "cuda"
    steps: int = 1000  # 33M tokens, ~7 epochs: the lowest held-out loss of 600/1000/2000
    batch: int = 64
    seq: int = 512
    lr: float = 2e-3
    seed: int = 0
    max_minutes: float = 7.0  # stop early at this wall time; the learning rate decays to it
    shard_mb: float = 15.0  # the output travels in pieces of at most this size


def _batch(ids: torch.Tensor, n: int, seq: int, generator: torch.Generator, device: str):
    starts = torch.randint(0, ids.numel() - seq - 1, (n,), generator=generator)
    x = torch.stack([ids[s : s + seq + 1] for s in starts]).to(device)
    return x[:, :-1], x[:, 1:]


def save_shards(state: dict[str, torch.Tensor], folder: Path, shard_mb: float) -> None:
    """``state`` as model-NN.safetensors files of at most ``shard_mb`` each (bf16: two bytes a value)."""
    shard, size, index = {}, 0, 0
    for name, t in state.items():
        shard[name] = t
        size += t.numel() * 2
        if size > shard_mb * 1e6:
            save_file(shard, str(folder / f"model-{index:02d}.safetensors"))
            shard, size, index = {}, 0, index + 1
    if shard:
        save_file(shard, str(folder / f"model-{index:02d}.safetensors"))


def train(data: Path, out: Path, run: OlmoeTraining, config: dict) -> dict:
    """Train on ``data``'s train.npy (the data step's token ids), score on its eval.npy, and write OUT: bf16 shards,
    config.json and training.json (the returned summary: steps, tokens, minutes, losses)."""
    torch.manual_seed(run.seed)
    train_ids = torch.from_numpy(np.load(data / "train.npy").astype(np.int64))
    eval_ids = torch.from_numpy(np.load(data / "eval.npy").astype(np.int64))
    model = TinyOlmoe(config).to(run.device)
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, run.steps // 20)

    def lr_at(
        step: int,
    ) -> float:  # warmup, then cosine to zero by the step budget or the time budget, whichever is nearer
        done = max(step / run.steps, (time.time() - start) / 60 / run.max_minutes)
        return run.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))

    gen = torch.Generator().manual_seed(run.seed)
    start = time.time()
    if run.device.startswith("cuda") and not torch.cuda.is_available():
        raise M2R2Error("--device cuda: this PyTorch sees no CUDA GPU; use --device mps on a Mac, or cpu (slow)")
    amp = dict(device_type="cuda", dtype=torch.bfloat16) if run.device.startswith("cuda") else None
    E, k = config["num_experts"], config["num_experts_per_tok"]

    def losses(x, y):
        with torch.autocast(**amp) if amp else contextlib.nullcontext():
            logits, routers = model(x)
        ce = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        balance, z = moe_losses(routers, E, k)
        return ce, balance, z

    log = []
    bar = tqdm(range(run.steps), desc="training tiny OLMoE", unit="step")
    for step in bar:
        ce, balance, z = losses(*_batch(train_ids, run.batch, run.seq, gen, run.device))
        loss = ce + 0.01 * balance + 0.001 * z
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        if step % 50 == 0 or step == run.steps - 1:
            bar.set_postfix(
                ce=f"{ce.item():.3f}",
                balance=f"{balance.item():.3f}",
                tok_s=f"{(step + 1) * run.batch * run.seq / (time.time() - start):,.0f}",
            )
            log.append({"step": step, "ce": ce.item(), "balance": balance.item(), "z": z.item()})
        if (time.time() - start) / 60 > run.max_minutes:
            bar.write(f"time budget of {run.max_minutes} min reached at step {step + 1}")
            break
    model.eval()
    g = torch.Generator().manual_seed(run.seed + 1)
    with torch.no_grad():
        evals = [losses(*_batch(eval_ids, run.batch, run.seq, g, run.device))[0].item() for _ in range(8)]
    summary = {
        "steps": step + 1,
        "tokens": (step + 1) * run.batch * run.seq,
        "minutes": (time.time() - start) / 60,
        "train_ce": log[-1]["ce"],
        "eval_ce": float(np.mean(evals)),
        "log": log,
    }
    # bf16 shards (exported to float32 later)
    state = {n: p.detach().to("cpu", torch.bfloat16).contiguous() for n, p in model.state_dict().items()}
    with atomic_folder(out) as tmp:
        save_shards(state, tmp, run.shard_mb)
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        (tmp / "training.json").write_text(json.dumps(summary, indent=1))
    return summary
