"""m2r2-train-torch: train M2R2 adapters in PyTorch, on one GPU or many (or on the CPU), and write them as an MLX
adapters folder.

    m2r2-train-torch --model smollm2 --prompts prompts.jsonl -o out/                 # one device
    torchrun --nproc-per-node 8 -m m2r2_torch.train --model smollm2 --data rows.npy -o out/

The recipe is m2r2-train's (m2r2_mlx/training/train.py, docs/training.md): per batch, the frozen base runs once
without gradients (slow stream, teacher distribution, keys/values), then the fast stream runs each gate interval over
whole sequences and only the adapters get gradients. Loss per gate: temperature-scaled KL(teacher || gate) over the
union of the teacher's top-k tokens, plus ``align`` * (1 - cos(h_fast at the gate, h_final)); the data formats
(--text, --prompts, --data rows and loss masks) and m2r2_config.json are the MLX trainer's.

Several processes (torchrun) split each global batch of --batch-size rows between them and average gradients
(DistributedDataParallel; nccl on GPUs, gloo on CPU). The vocabulary subset and the token count are agreed across
processes, so N processes compute the same update as one process with the whole batch. On a GPU the passes run under
bf16 autocast; on the CPU in float32.

OUTPUT/ is an MLX adapters folder (m2r2-chat --adapters OUTPUT), converted from the PyTorch checkpoint in
OUTPUT/torch/ by m2r2-convert's own code; beside them the data cache (data.npy), the answer log and checkpoint/
(--resume continues from it exactly: the same batches, learning rates and optimizer state as an uninterrupted run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from m2r2_mlx.atomic import atomic_folder, refuse_existing
from m2r2_mlx.core.config import ADAPTERS_FILE, CONFIG_FILE, M2R2Config, even_gates
from m2r2_mlx.core.draft_vocab import rank_tokens, save_draft_vocab
from m2r2_mlx.core.integrity import record_hashes
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.training.data import DATA_CACHE, DISTILL_LOG, load_rows, mask_path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm.auto import tqdm

from .base import load_base
from .fast_stream import M2R2Torch
from .generate import generate_batch
from .modules import M2R2Adapters

CHECKPOINT = "checkpoint"  # OUTPUT/checkpoint: adapters, optimizer and step, for --resume
TORCH_DIR = "torch"  # OUTPUT/torch: the PyTorch checkpoint (adapters.pt + m2r2_config.json), m2r2-convert's input
TORCH_WEIGHTS = "adapters.pt"
KEEP = (DATA_CACHE, mask_path(DATA_CACHE).name, DISTILL_LOG, CHECKPOINT, TORCH_DIR)  # survive the MLX folder's write


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="m2r2-train-torch",
        description="Train M2R2 accelerator adapters in PyTorch "
        "(one device, or several under torchrun) and write them as an MLX adapters folder.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="base model: alias, repo id, folder or .gguf (default: embedded "
        "smollm2; without mlx-lm installed, a folder, .gguf or repo id)",
    )
    p.add_argument(
        "--base-name",
        help="the name the adapters record for their base (e.g. smollm2 when --model is "
        "that model's imported folder on a machine without mlx-lm's aliases)",
    )
    p.add_argument("-o", "--output", required=True, help="output folder (an MLX adapters folder when done)")
    p.add_argument("--text", nargs="*", default=[], help="plain text files")
    p.add_argument(
        "--prompts",
        help="jsonl of prompts; the base answers them first (self-distillation, batched "
        "with transformers' generate, greedy; the answer log resumes an interrupted run)",
    )
    p.add_argument("--answer-tokens", type=int, default=160, help="most tokens per self-distilled answer")
    p.add_argument("--generate-batch", type=int, default=256, help="prompts per generation pass (default 256)")
    p.add_argument("--data", metavar="ROWS.npy", help="train on token rows (an earlier run's data.npy)")
    p.add_argument("--gates", help="comma-separated exit layers, e.g. 6,12,18,24 (default: every --every layers)")
    p.add_argument("--every", type=int, default=6, help="gate spacing when --gates is not given (default 6)")
    p.add_argument(
        "--rank",
        type=parse_ranks,
        default=None,
        help="adapter bottleneck rank, or one per gate interval (e.g. 256,64,64,64) (default 64)",
    )
    p.add_argument(
        "--context-feature",
        action="store_true",
        help="the first interval also reads the previous position's final state (new adapters only)",
    )
    p.add_argument("--train-gates", help="comma-separated gates whose interval's adapters train (default: all)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4, help="rows per step, over all processes together")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument(
        "--distill-temp",
        "--temperature",
        dest="distill_temp",
        type=float,
        default=1.0,
        help="distillation temperature (default 1.0)",
    )
    p.add_argument(
        "--distill-top-k",
        "--top-k",
        dest="distill_top_k",
        type=int,
        default=16,
        help="distil over the union of the teacher's top-k tokens (default 16)",
    )
    p.add_argument("--align", type=float, default=1.0, help="weight of the cosine alignment term")
    p.add_argument(
        "--loss-on",
        choices=("all", "answers"),
        default="all",
        help="score every position (default) or only those predicting answer or text tokens",
    )
    p.add_argument("--eval-rows", type=int, default=16, help="held-out rows for the final evaluation")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument(
        "--resume", action="store_true", help="continue from OUTPUT/checkpoint (--stage data: continue the answer log)"
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="stop training after this long, checkpointed, for a later --resume (a machine lent for minutes at a time)",
    )
    p.add_argument("--init", metavar="ADAPTERS", help="warm start from this adapters folder (its gates and rank)")
    p.add_argument("--force", action="store_true", help="replace an existing OUTPUT folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stage",
        choices=("data", "adapters"),
        default="adapters",
        help="'data': only build OUTPUT/data.npy (self-distilling --prompts) for a later --data",
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    p.add_argument("--upload-repo", metavar="OWNER/NAME", help="upload the adapters folder to this Hub model repo")
    return p


def parse_ranks(text: str) -> int | list[int]:
    try:
        ranks = [int(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rank or a comma-separated list of ranks") from None
    return ranks[0] if len(ranks) == 1 else ranks


# ---- processes ---------------------------------------------------------------------------------------------------


def setup_processes(device: str | None) -> tuple[int, int, torch.device]:
    """(rank, world size, device). Under torchrun (WORLD_SIZE set), joins the process group: nccl on GPUs, gloo on
    the CPU; self-distillation on rank 0 can take long, hence the generous timeout on the others' wait."""
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


# ---- adapters ----------------------------------------------------------------------------------------------------


def read_torch_adapters(folder: Path) -> dict[str, torch.Tensor]:
    """An adapters folder's weights as torch tensors (MLX writes safetensors that safetensors.torch reads)."""
    from safetensors.torch import load_file

    path = folder / ADAPTERS_FILE
    try:
        return load_file(str(path))
    except Exception as e:
        raise M2R2Error(f"{path} cannot be read ({type(e).__name__}); it is missing or truncated") from None


def load_module(lm, cfg: M2R2Config, state: dict[str, torch.Tensor], where) -> M2R2Adapters:
    module = M2R2Adapters.from_config(cfg, lm.model.model.layers)
    try:
        module.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    except RuntimeError as e:
        raise M2R2Error(f"the weights in {where} do not fit its m2r2_config.json ({str(e).splitlines()[0]})") from None
    return module


def build_adapters(args, lm) -> tuple[M2R2Adapters, M2R2Config]:
    """New adapters (--gates/--every, --rank, --context-feature), or those of --init, and their config."""
    if args.init:
        folder = Path(args.init)
        cfg = M2R2Config.load(folder)
        lm.check_adapters(cfg, folder)
        if args.rank and args.rank != cfg.adapter_rank:
            raise M2R2Error(
                f"--rank {args.rank} differs from the --init adapters' rank {cfg.adapter_rank}; drop "
                "--rank (widening warm starts is m2r2-train's --init --rank)"
            )
        if args.context_feature and not cfg.context_feature:
            raise M2R2Error("--context-feature adds a context feature to new adapters only; drop it with --init")
        cfg.extra = {}
        return load_module(lm, cfg, read_torch_adapters(folder), folder), cfg
    try:
        gates = [int(g) for g in args.gates.split(",")] if args.gates else even_gates(lm.num_layers, args.every)
    except ValueError:
        raise M2R2Error(
            f"--gates must be layer numbers separated by commas, e.g. 6,12,18 (got {args.gates!r})"
        ) from None
    cfg = lm.m2r2_config(gates, adapter_rank=args.rank or 64, context_feature=args.context_feature)
    return M2R2Adapters.from_config(cfg, lm.model.model.layers), cfg


def train_gate_indices(cfg: M2R2Config, train_gates: str | None) -> list[int] | None:
    """Indices of the gates --train-gates names (None: all)."""
    if not train_gates:
        return None
    try:
        chosen = sorted({cfg.gates.index(int(g)) for g in train_gates.split(",")})
    except ValueError:
        raise M2R2Error(f"--train-gates {train_gates} must name gates of the adapters, which are {cfg.gates}") from None
    if cfg.adapter_form != "parallel_bottleneck":
        raise M2R2Error("--train-gates needs bottleneck adapters (a LoRA delta serves every interval of its layer)")
    return chosen


def freeze_untrained(model: M2R2Torch, gate_indices: list[int] | None) -> None:
    """ARLA is never trained here (m2r2-train --stage arla does that); with --train-gates, neither are the other
    intervals' adapters (nor, outside the first interval, the context feature)."""
    m2r2 = model.m2r2
    if m2r2.arla is not None:
        m2r2.arla.requires_grad_(False)
    if gate_indices is None:
        return
    for j, (start, stop) in enumerate(model.config.intervals()):
        if j not in gate_indices:
            for i in range(start, stop):
                m2r2.adapters[i].requires_grad_(False)
            if j == 0 and m2r2.context is not None:
                m2r2.context.requires_grad_(False)


# ---- one step ----------------------------------------------------------------------------------------------------


def lr_at(step: int, lr: float, steps: int, warmup: int = 20) -> float:
    """m2r2-train's schedule: linear warmup from lr/100, then cosine decay to lr/20."""
    warmup = min(warmup, max(steps // 10, 1))
    if step < warmup:
        return lr * 0.01 + (lr - lr * 0.01) * step / warmup
    decay = max(steps - warmup, 1)
    return lr * 0.05 + (lr - lr * 0.05) * 0.5 * (1 + math.cos(math.pi * min(step - warmup, decay) / decay))


def batch_rows(seed: int, step: int, n_rows: int, batch_size: int) -> np.ndarray:
    """The global batch of ``step``: a function of the seed and the step alone, so a resumed run draws what an
    uninterrupted one would."""
    return np.random.default_rng([seed, step]).integers(0, n_rows, batch_size)


def flat_scored(h: torch.Tensor, scored: torch.Tensor | None) -> torch.Tensor:
    """States (B, T, D) as (n, D): all positions, or those at the flat indices ``scored``."""
    flat = h.reshape(-1, h.shape[-1])
    return flat if scored is None else flat[scored]


def step_loss(model: M2R2Torch, ddp, ids: torch.Tensor, scored: torch.Tensor | None, args, gate_indices, world: int):
    """(loss to differentiate, per-gate mean KL as floats). Frozen slow pass and teacher, then the fast stream.

    Under several processes the teacher's vocabulary subset is the union over all of them, and the loss is this
    process's token sum over the global token count times the world size: DDP's gradient average is then exactly
    the one-process gradient of the global batch's token mean."""
    parts, temp = model.parts, args.distill_temp
    with torch.no_grad():
        states, final, kv = model.slow_pass(ids)
        final = flat_scored(final, scored).float()
        logits = parts.head(final).float()
        in_subset = torch.zeros(logits.shape[-1], dtype=torch.int32, device=ids.device)
        in_subset[logits.topk(args.distill_top_k, dim=-1).indices.flatten()] = 1
        rows = all_sum(in_subset, world).nonzero().flatten()
        teacher = F.log_softmax(logits[:, rows] / temp, dim=-1)
        n_global = all_sum(torch.tensor(float(final.shape[0]), device=ids.device), world)
    total, kls = 0.0, []
    for fast in ddp(states, kv, gate_indices):
        fast = flat_scored(fast, scored).float()
        student = F.log_softmax(parts.head_rows(fast, rows).float() / temp, dim=-1)
        kl = (teacher.exp() * (teacher - student)).sum(-1) * temp**2
        cos = 1 - F.cosine_similarity(fast, final, dim=-1, eps=1e-6)
        total = total + (kl + args.align * cos).sum() * world / n_global
        kls.append(kl.detach().sum() / n_global)
    return total, [float(all_sum(k, world)) for k in kls]


# ---- checkpoints -------------------------------------------------------------------------------------------------


def save_checkpoint(module: M2R2Adapters, cfg: M2R2Config, opt, step: int, out: Path) -> None:
    with atomic_folder(out / CHECKPOINT) as tmp:
        torch.save(module.state_dict(), tmp / TORCH_WEIGHTS)
        torch.save(opt.state_dict(), tmp / "optimizer.pt")
        cfg.save(tmp)
        (tmp / "state.json").write_text(json.dumps({"step": step}))


def load_checkpoint(lm, out: Path) -> tuple[M2R2Adapters, M2R2Config, dict, int]:
    ck = out / CHECKPOINT
    cfg = M2R2Config.load(ck)
    lm.check_adapters(cfg, ck)
    module = load_module(lm, cfg, torch.load(ck / TORCH_WEIGHTS, weights_only=True, map_location="cpu"), ck)
    opt_state = torch.load(ck / "optimizer.pt", weights_only=True, map_location="cpu")
    return module, cfg, opt_state, json.loads((ck / "state.json").read_text())["step"]


# ---- evaluation --------------------------------------------------------------------------------------------------


@torch.no_grad()
def heldout_agreement(
    model: M2R2Torch, rows: np.ndarray, mask: np.ndarray | None, device, autocast, batch_size: int = 4
) -> dict:
    """Top-1 agreement with the full model at every gate, naive exit vs the fast stream (the MLX trainer's
    evaluate.gate_agreement, same keys)."""
    parts, gates = model.parts, model.config.gates
    hits = {k: np.zeros(len(gates)) for k in ("naive", "m2r2", "naive_scored", "m2r2_scored")}
    total = scored = 0
    for i in range(0, len(rows), batch_size):
        ids = torch.from_numpy(rows[i : i + batch_size].astype(np.int64)).to(device)
        with autocast:
            states, final, kv = model.slow_pass(ids)
            target = parts.head(final).argmax(-1)
            naive = torch.stack([parts.head(states[g]).argmax(-1) == target for g in gates]).cpu().numpy()
            fast = torch.stack([parts.head(h).argmax(-1) == target for h in model.fast_states(states, kv)])
        fast = fast.cpu().numpy()
        hits["naive"] += naive.sum((1, 2))
        hits["m2r2"] += fast.sum((1, 2))
        total += naive[0].size
        if mask is not None:
            m = mask[i : i + batch_size]
            hits["naive_scored"] += naive[:, m].sum(1)
            hits["m2r2_scored"] += fast[:, m].sum(1)
            scored += int(m.sum())
    out = {
        "gates": list(gates),
        "naive": (hits["naive"] / total).tolist(),
        "m2r2": (hits["m2r2"] / total).tolist(),
        "tokens": total,
    }
    if mask is not None:
        out["scored"] = {
            "naive": (hits["naive_scored"] / max(scored, 1)).tolist(),
            "m2r2": (hits["m2r2_scored"] / max(scored, 1)).tolist(),
            "tokens": scored,
        }
    return out


def agreement_table(metrics: dict) -> str:
    lines = []
    scored = metrics.get("scored")
    for j, g in enumerate(metrics["gates"]):
        line = (
            f"gate L{g}: naive exit {100 * metrics['naive'][j]:.1f}%  m2r2 {100 * metrics['m2r2'][j]:.1f}%  "
            f"(top-1 agreement with the full model, {metrics['tokens']} held-out tokens)"
        )
        if scored:
            line += (
                f"; answers and text only: {100 * scored['naive'][j]:.1f}% / {100 * scored['m2r2'][j]:.1f}% "
                f"({scored['tokens']})"
            )
        lines.append(line)
    return "\n".join(lines)


# ---- outputs -----------------------------------------------------------------------------------------------------


def write_outputs(module: M2R2Adapters, cfg: M2R2Config, out: Path, rows: np.ndarray, lm) -> str:
    """OUTPUT/torch/ (adapters.pt and m2r2_config.json: the PyTorch checkpoint), then OUTPUT/ itself as an MLX
    adapters folder converted from it by m2r2-convert's code, with draft_vocab.json counted on the rows. Without
    mlx (a GPU machine), the conversion is left to m2r2-convert: the message says how."""
    with atomic_folder(out / TORCH_DIR) as tmp:
        torch.save({k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}, tmp / TORCH_WEIGHTS)
        cfg.save(tmp)
        record_hashes(tmp)
    tokens, cover = rank_tokens(rows, int(lm.config["vocab_size"]))
    try:
        from m2r2_mlx.models.registry import load_model

        from m2r2_convert.checkpoint import plan_conversion, write_conversion
        from m2r2_convert.sources import read_checkpoint
    except ImportError as e:  # no mlx here
        save_draft_vocab(out / TORCH_DIR, tokens, cover, source=f"m2r2-train-torch rows: {rows.size} tokens")
        return (
            f"wrote {out / TORCH_DIR} ({e.name} is not installed here, so no MLX folder); convert it where mlx is: "
            f"m2r2-convert {out / TORCH_DIR} --base {lm.name} -o ADAPTERS"
        )
    conversion = plan_conversion(read_checkpoint(out / TORCH_DIR), load_model(str(lm.path), tokenizer=False))
    conversion.config.base_model = cfg.base_model  # the name it was trained under (an alias), not the folder
    write_conversion(conversion, out, force=True, keep=KEEP)
    save_draft_vocab(out, tokens, cover, source=f"m2r2-train-torch rows: {rows.size} tokens")
    return f"wrote {out} (try: m2r2-chat --model {cfg.base_model} --adapters {out} --mode speculative)"


# ---- the run -----------------------------------------------------------------------------------------------------


def check_output(args, out: Path) -> None:
    if args.resume and args.stage != "data" and not (out / CHECKPOINT / "state.json").is_file():
        raise M2R2Error(f"--resume: {out / CHECKPOINT} holds no checkpoint; start without --resume")
    if out.exists() and not args.resume:
        refuse_existing(out, args.force)


def train(args) -> Path:
    out = Path(args.output)
    if args.batch_size < 1 or args.seq_len < 2 or args.steps < 0:
        raise M2R2Error("--batch-size must be at least 1, --seq-len at least 2 and --steps not negative")
    rank, world, device = setup_processes(args.device)
    main_process = rank == 0
    log = (lambda *a: print(*a, file=sys.stderr)) if main_process else (lambda *a: None)
    if args.batch_size % world:
        raise M2R2Error(f"--batch-size {args.batch_size} does not split over {world} processes; make it a multiple")
    check_output(args, out)
    barrier(world)  # every process has looked before rank 0 clears the folder
    if main_process and args.force and not args.resume:
        shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(args.seed)
    lm = load_base(args.model, device, tokenizer=not args.data)  # token rows given: no tokenizer needed
    lm.name = args.base_name or lm.name

    # data: rank 0 builds the rows (self-distilling --prompts), the others read its cache
    generate = lambda prompts, n: generate_batch(lm, prompts, n, batch_size=args.generate_batch, seed=args.seed)
    if main_process:
        out.mkdir(parents=True, exist_ok=True)
        rows, mask = load_rows(args, lm, out, generate=generate)
    barrier(world)
    if not main_process:
        rows, mask = load_rows(args, lm, out)
    if args.stage == "data":
        log(f"{out / DATA_CACHE}: {len(rows)} rows of {rows.shape[1]} tokens")
        return out
    if args.loss_on == "answers" and mask is None:
        raise M2R2Error(
            f"--loss-on answers needs the rows' loss mask {mask_path(args.data or out / DATA_CACHE)}; "
            "rebuild the rows with --stage data"
        )
    n_eval = min(args.eval_rows, max(1, len(rows) // 10))
    eval_rows, train_rows = rows[:n_eval], rows[n_eval:]
    eval_mask, train_mask = (None, None) if mask is None else (mask[:n_eval], mask[n_eval:])
    if len(train_rows) < args.batch_size:
        raise M2R2Error(f"{len(train_rows)} training rows of {args.seq_len} tokens is fewer than one batch; add data")

    start, opt_state = 0, None
    if args.resume:
        module, cfg, opt_state, start = load_checkpoint(lm, out)
    else:
        module, cfg = build_adapters(args, lm)
    model = M2R2Torch(lm.model, cfg, module).to(device)
    gate_indices = train_gate_indices(cfg, args.train_gates)
    freeze_untrained(model, gate_indices)
    trainable = [p for p in model.parameters() if p.requires_grad]
    ddp = model
    if world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    per_process = args.batch_size // world
    bar = tqdm(
        range(start, args.steps),
        initial=start,
        total=args.steps,
        desc="training adapters",
        unit="step",
        disable=not main_process,
    )
    tokens, t0 = 0, time.perf_counter()
    stopped = None
    for step in bar:
        batch = batch_rows(args.seed, step, len(train_rows), args.batch_size)[rank * per_process :][:per_process]
        ids = torch.from_numpy(train_rows[batch].astype(np.int64)).to(device)
        scored = None
        if args.loss_on == "answers":
            scored = torch.from_numpy(np.flatnonzero(train_mask[batch])).to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.lr, args.steps)
        with autocast:
            loss, kls = step_loss(model, ddp, ids, scored, args, gate_indices, world)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        tokens += args.batch_size * args.seq_len
        bar.set_postfix(kl="/".join(f"{k:.2f}" for k in kls), tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
        if main_process and (step + 1) % args.checkpoint_every == 0 and step + 1 < args.steps:
            save_checkpoint(module, cfg, opt, step + 1, out)
        if args.max_minutes and step + 1 < args.steps:  # rank 0's clock decides for every process
            late = torch.tensor(float(time.perf_counter() - t0 > 60 * args.max_minutes and main_process), device=device)
            if all_sum(late, world).item():
                stopped = step + 1
                break
    bar.close()
    seconds = time.perf_counter() - t0
    if stopped is not None:
        if main_process:
            save_checkpoint(module, cfg, opt, stopped, out)
            log(
                f"stopped after {args.max_minutes:g} minutes at step {stopped} of {args.steps}, {tokens / seconds:.0f} "
                f"tokens/s; continue with the same command and --resume"
            )
        barrier(world)
        return out

    if main_process:
        log("held-out evaluation…")
        model.eval()
        metrics = heldout_agreement(model, eval_rows, eval_mask, device, autocast)
        cfg.extra = {
            "heldout_agreement": metrics,
            "train_rows": int(len(train_rows)),
            "recipe": {k: v for k, v in vars(args).items() if k not in ("resume", "force", "output", "upload_repo")},
            "trainer": f"m2r2-train-torch, {world} process(es) on {device.type}",
            "seconds": round(seconds, 1),
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
        }
        log(write_outputs(module, cfg, out, rows, lm))
        print(agreement_table(metrics))
        log(f"{tokens} tokens in {seconds:.1f} s: {tokens / max(seconds, 1e-9):.0f} tokens/s")
        if args.upload_repo:
            if not (out / CONFIG_FILE).is_file():
                raise M2R2Error(
                    f"--upload-repo uploads the MLX adapters folder, which was not written here (no "
                    f"mlx); convert {out / TORCH_DIR} with m2r2-convert where MLX runs, then upload that "
                    f"folder with `huggingface-cli upload {args.upload_repo} DIR`"
                )
            from m2r2_mlx.core.hub import upload_adapters  # needs mlx-lm: present, since the MLX folder was written

            log(f"uploaded to {upload_adapters(out, args.upload_repo)}")
    barrier(world)
    return out


def _main() -> int:
    args = build_parser().parse_args()
    try:
        train(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main() -> None:
    sys.exit(run_cli("m2r2-train-torch", _main))


if __name__ == "__main__":
    main()
