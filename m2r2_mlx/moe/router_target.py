"""M2R2 adapters trained on an MoE to predict its routing: a target that needs no LM head.

The expert predictors (fast_predictor.py, fused_predictor.py) feed the fast stream's exit state at gate g_j to the
routers of the layers above it. Adapters distilled towards the final layer's tokens (m2r2-train) make that state
approximate the final residual, which is not what those routers read. Here the target is the routing itself:
for each exit, the router distributions of the MoE layers it predicts, [g_j, g_(j+2)) (the next interval, which
the run-ahead predictor loads, and the one after, which the fused one loads from its first exits), taken from the
slow stream's own pass. The loss is KL(router's distribution || the same router on the exit state), both at a
temperature (below 1 it weighs the experts the router ranks first, the ones a top-k picks). The slow pass runs
once per batch outside the gradient; the fast stream is teacher-forced over whole rows (M2R2Model.fast_states), so
one step costs a frozen forward plus the fast stream's layers, and no 49k-row LM head.

``evaluate`` measures, on held-out rows, the recall of each layer's top-k at each distance (MoE layers between the
layer the prediction is made after and the one it names), beside pre-gating's (layer t's router on layer t-1's
router input) at distance 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from tqdm.auto import tqdm

from ..core.fast_stream import M2R2Model
from ..errors import M2R2Error
from .blocks import moe_blocks, top_k


@dataclass(frozen=True)
class RouterTargetConfig:
    steps: int = 120
    lr: float = 2e-3
    batch_size: int = 4
    temperature: float = 0.5  # of both distributions in the KL
    eval_every: int = 0  # 0: evaluate once, at the end
    seed: int = 0

    def check(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or not self.lr > 0 or not self.temperature > 0:
            raise M2R2Error("--steps must not be negative, --batch-size at least 1, --lr and --temperature positive")


class RouterRecorder(nn.Module):
    """A router that, while ``on``, keeps what it was given and what it said."""

    def __init__(self, gate: nn.Module):
        super().__init__()
        self.gate, self.on, self.seen = gate, False, []

    def __call__(self, x: mx.array) -> mx.array:
        out = self.gate(x)
        if self.on:
            self.seen.append((x, out))
        return out


def exit_targets(m2r2: M2R2Model, moe_layers: list[int]) -> dict[int, list[int]]:
    """gate index -> the MoE layers its exit predicts: [g_j, g_(j+2)), capped at the top."""
    gates = list(m2r2.config.gates) + [m2r2.parts.num_layers]
    out = {}
    for j, g in enumerate(m2r2.config.gates):
        end = gates[min(j + 2, len(gates) - 1)]
        targets = [t for t in moe_layers if g <= t < end]
        if targets:
            out[j] = targets
    return out


class RouterTarget:
    """Loss, training step and evaluation of the router target for ``m2r2`` over its MoE base."""

    def __init__(self, m2r2: M2R2Model, config: RouterTargetConfig = RouterTargetConfig()):
        config.check()
        self.m2r2, self.config = m2r2, config
        self.blocks = dict(moe_blocks(m2r2.base))
        if not self.blocks:
            raise M2R2Error("the router target needs a mixture-of-experts base model; this one has no experts")
        bad = [l for l, b in self.blocks.items() if not isinstance(b.gate, nn.Linear) or top_k(b) is None]
        if bad:
            raise M2R2Error(f"the router target needs a linear router with a top-k in every MoE layer (not {bad})")
        self.targets = exit_targets(m2r2, sorted(self.blocks))
        if not self.targets:
            raise M2R2Error(f"no MoE layer lies above the adapters' first gate {m2r2.config.gates[0]}")
        self.gate_indices = sorted(self.targets)

    def frozen_pass(self, ids: mx.array):
        """The slow stream's states at the gates, its keys and values, and each MoE layer's router (input, logits)."""
        recorders = {l: RouterRecorder(b.gate) for l, b in self.blocks.items()}
        for l, b in self.blocks.items():
            b.gate = recorders[l]
            recorders[l].on = True
        try:
            states, _, kv = self.m2r2.slow_pass(ids)
        finally:
            for l, b in self.blocks.items():
                b.gate = recorders[l].gate
        routed = {l: r.seen[0] for l, r in recorders.items()}
        states = {k: mx.stop_gradient(v) for k, v in states.items()}
        kv = [(mx.stop_gradient(k), mx.stop_gradient(v)) for k, v in kv]
        routed = {l: (mx.stop_gradient(x), mx.stop_gradient(z)) for l, (x, z) in routed.items()}
        mx.eval(states, kv, routed)
        return states, kv, routed

    def predicted_logits(self, exit_state: mx.array, layer: int) -> mx.array:
        """Layer ``layer``'s router on an exit state, as the predictors apply it."""
        norm = self.m2r2.parts.layers[layer].post_attention_layernorm
        return self.blocks[layer].gate(norm(exit_state))

    def loss(self, model: M2R2Model, states, kv, routed) -> mx.array:
        t = self.config.temperature
        total, n = 0.0, 0
        for j, exit_state in zip(self.gate_indices, model.fast_states(states, kv, self.gate_indices)):
            for layer in self.targets[j]:
                target = nn.log_softmax(routed[layer][1].reshape(exit_state.shape[:-1] + (-1,)) / t, axis=-1)
                pred = nn.log_softmax(self.predicted_logits(exit_state, layer) / t, axis=-1)
                total = total + (mx.exp(target) * (target - pred)).sum(-1).mean()
                n += 1
        return total / n

    def train(self, rows: np.ndarray, heldout: np.ndarray | None = None, progress: bool = True) -> list[dict]:
        """``config.steps`` AdamW steps over batches of ``rows`` (N, T); the log (loss per step, evaluations)."""
        c = self.config
        warmup = max(min(20, c.steps // 10), 1)
        schedule = optim.join_schedules(
            [optim.linear_schedule(c.lr * 0.01, c.lr, warmup), optim.cosine_decay(c.lr, max(c.steps - warmup, 1))],
            [warmup],
        )
        opt = optim.AdamW(learning_rate=schedule, weight_decay=0.0)
        step_fn = nn.value_and_grad(self.m2r2, self.loss)
        rng = np.random.default_rng(c.seed)
        log = []
        bar = tqdm(range(c.steps), desc="router target", unit="step", disable=not progress)
        for i in bar:
            batch = mx.array(rows[rng.choice(len(rows), min(c.batch_size, len(rows)), replace=False)])
            loss, grads = step_fn(self.m2r2, *self.frozen_pass(batch))
            opt.update(self.m2r2, grads)
            mx.eval(self.m2r2.parameters(), opt.state, loss)
            log.append({"step": i + 1, "loss": loss.item()})
            bar.set_postfix(loss=f"{log[-1]['loss']:.4f}")
            if heldout is not None and c.eval_every and (i + 1) % c.eval_every == 0:
                log[-1]["eval"] = self.evaluate(heldout)
        return log

    def eval_loss(self, rows: np.ndarray) -> float:
        return self.loss(self.m2r2, *self.frozen_pass(mx.array(rows))).item()

    def evaluate(self, rows: np.ndarray, batch: int = 4) -> dict:
        """Held-out recall of each MoE layer's top-k, per distance; pre-gating's at distance 1 beside it."""
        hits: dict[int, list[float]] = {}
        pregating, layers = [], sorted(self.blocks)
        for b in range(0, len(rows), batch):
            states, kv, routed = self.frozen_pass(mx.array(rows[b : b + batch]))
            true = {l: _topk(z, top_k(self.blocks[l])) for l, (_, z) in routed.items()}
            exits = self.m2r2.fast_states(states, kv, self.gate_indices)
            for j, exit_state in zip(self.gate_indices, exits):
                made_after = self.m2r2.config.gates[j] - 1
                for layer in self.targets[j]:
                    pick = _topk(self.predicted_logits(exit_state, layer), top_k(self.blocks[layer]))
                    hits.setdefault(layer - made_after, []).append(_overlap(pick, true[layer]))
            for prev, layer in zip(layers, layers[1:]):
                x = routed[prev][0]
                pregating.append(_overlap(_topk(self.blocks[layer].gate(x), top_k(self.blocks[layer])), true[layer]))
        by_distance = {d: float(np.mean(v)) for d, v in sorted(hits.items())}
        return {
            "recall_by_distance": by_distance,
            "recall_next_interval": float(np.mean([v for v in hits.values() for v in v])),
            "pregating_recall_next_layer": float(np.mean(pregating)) if pregating else None,
        }


def _topk(logits: mx.array, k: int) -> np.ndarray:
    z = np.array(logits.astype(mx.float32)).reshape(-1, logits.shape[-1])
    return np.argpartition(-z, k - 1, axis=-1)[:, :k]


def _overlap(pick: np.ndarray, true: np.ndarray) -> float:
    """The share of the true top-k the prediction names, averaged over tokens (= precision: both name k)."""
    return float(np.mean([len(set(p) & set(t)) / len(t) for p, t in zip(pick, true)]))
