"""m2r2-train's optimisation step (Trainer) and its checkpoints.

The slow stream runs once per batch outside the gradient (it is frozen); only the fast stream's layers are
differentiated, and only the adapters get gradients (training/losses.py: the loss at each gate).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from ..atomic import atomic_folder
from ..core.adapters import save_adapters
from .config import DistillLoss
from .losses import gate_loss, teacher_targets

CHECKPOINT = "checkpoint"


def scored_positions(h: mx.array, scored: mx.array | None) -> mx.array:
    """The states (B, T, D) at the flat position indices ``scored`` as (n, D); all of them, unchanged, for None."""
    return h if scored is None else h.reshape(-1, h.shape[-1])[scored]


class Trainer:
    """One optimisation step at a time: frozen slow pass, then gradients through the fast stream only."""

    def __init__(
        self,
        m2r2,
        lr: float,
        steps: int,
        loss: DistillLoss = DistillLoss(),
        warmup: int = 20,
        gate_indices: list[int] | None = None,
    ):
        self.m2r2, self.objective = m2r2, loss
        self.gate_indices = gate_indices  # None: every gate's interval trains
        if gate_indices is not None:  # the other intervals' adapters neither run nor take optimizer state
            for j, (start, stop) in enumerate(m2r2.config.intervals()):
                if j not in gate_indices:
                    for i in range(start, stop):
                        m2r2.adapters[i].freeze()
                    if j == 0 and getattr(m2r2, "context", None) is not None:
                        m2r2.context.freeze()
        warmup = min(warmup, max(steps // 10, 1))
        schedule = optim.join_schedules(
            [optim.linear_schedule(lr * 0.01, lr, warmup), optim.cosine_decay(lr, max(steps - warmup, 1), lr * 0.05)],
            [warmup],
        )
        self.opt = optim.AdamW(learning_rate=schedule, weight_decay=0.0)
        self.value_and_grad = nn.value_and_grad(m2r2, self.loss)

    def loss(self, model, states, kv, final, rows, teacher, scored):
        total, kls = 0.0, []
        for fast in model.fast_states(states, kv, self.gate_indices):
            loss, kl = gate_loss(
                model.parts,
                scored_positions(fast, scored),
                final,
                rows,
                teacher,
                self.objective.temperature,
                self.objective.align,
            )
            total = total + loss
            kls.append(kl)
        return total, mx.stack(kls)

    def frozen_pass(self, ids: mx.array, scored: mx.array | None = None):
        """The slow stream and the teacher distribution: computed once per batch, no gradient. ``scored``: the
        flat indices of the (B, T) positions the loss scores (None: all); the teacher's head runs on those only."""
        states, final, kv = self.m2r2.slow_pass(ids)
        states = {k: mx.stop_gradient(v) for k, v in states.items()}
        kv = [(mx.stop_gradient(k), mx.stop_gradient(v)) for k, v in kv]
        final = mx.stop_gradient(scored_positions(final, scored))
        rows, teacher = teacher_targets(self.m2r2.parts, final, self.objective.temperature, self.objective.top_k)
        mx.eval(states, kv, final, teacher)
        return states, kv, final, rows, teacher, scored

    def step(self, ids: mx.array, scored: mx.array | None = None) -> tuple[float, list[float]]:
        (loss, kls), grads = self.value_and_grad(self.m2r2, *self.frozen_pass(ids, scored))
        self.opt.update(self.m2r2, grads)
        mx.eval(self.m2r2.parameters(), self.opt.state, loss, kls)
        return loss.item(), kls.tolist()

    def eval_loss(self, ids: mx.array, scored: mx.array | None = None) -> float:
        loss, _ = self.loss(self.m2r2, *self.frozen_pass(ids, scored))
        return loss.item()

    def restore(self, path: Path) -> None:
        self.opt.init(self.m2r2.trainable_parameters())
        self.opt.state = tree_unflatten(list(mx.load(str(path)).items()))


def save_checkpoint(m2r2, opt, step: int, out: Path) -> None:
    with atomic_folder(out / CHECKPOINT) as tmp:
        save_adapters(m2r2, tmp / "adapters")
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
        (tmp / "state.json").write_text(json.dumps({"step": step}))
