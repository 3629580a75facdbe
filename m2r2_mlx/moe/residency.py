"""Which experts are resident, and where: fixed slots per MoE layer, written in place.

Each MoE layer gets ``S`` slots. A slot tensor per expert parameter has shape ``(S, *expert_shape)`` and never
changes shape: loading an expert writes into one slot in place, and the router's expert ids are remapped to slot
ids (``slot_map``) before the gathered matmul. So the model's compute graph is the same whatever is resident, and
the memory held is exactly the budget. A write is lazy: it runs with the next evaluation of the model's graph (the
gathered matmul reading the slot needs it), not in a sync of its own. Slots are touched only from the forward
pass's thread.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np

from .budget import resolve_slots
from .policies import EvictionPolicy, make_policy
from .store import ExpertStore

PolicyFactory = Callable[[int], EvictionPolicy]  # layer -> its eviction policy


class Residency:
    """Slot tensors, the expert in each slot, and each layer's eviction order (see the module docstring).
    ``policy``: a policy's name (policies.py), or a function giving each layer its own policy."""

    def __init__(self, store: ExpertStore, budget: float | int | str, policy: str | PolicyFactory = "lru"):
        self.store = store
        self.layers: list[int] = store.layers
        self.ordinals = {l: i for i, l in enumerate(self.layers)}
        self.slots_per_layer = resolve_slots(budget, store)
        self.budget = budget
        make = (lambda layer: make_policy(policy)) if isinstance(policy, str) else policy
        self.policies = {l: make(l) for l in self.layers}
        self.tensors: dict[int, dict[str, mx.array]] = {}  # layer -> parameter name -> (S, ...) tensor
        self._owner = {l: np.full(self.slots_per_layer[l], -1, np.int64) for l in self.layers}  # slot -> expert
        self._slot_of = {l: np.full(store.num_experts(l), -1, np.int32) for l in self.layers}  # expert -> slot
        self._maps: dict[int, mx.array] = {}
        self.written = 0  # experts written into slots since the warm fill (the writes run with the layer's compute)

    @property
    def policy_name(self) -> str:
        return self.policies[self.layers[0]].name

    @property
    def resident_bytes(self) -> int:
        return sum(self.slots_per_layer[l] * self.store.expert_bytes(l) for l in self.layers)

    @property
    def holds_every_expert(self) -> bool:
        """Whether every layer has a slot for each of its experts (nothing is ever loaded after the warm fill)."""
        return all(self.slots_per_layer[l] >= self.store.num_experts(l) for l in self.layers)

    def is_resident(self, layer: int, expert: int) -> bool:
        return bool(self._slot_of[layer][expert] >= 0)

    def resident(self, layer: int) -> list[int]:
        return sorted(int(e) for e in self._owner[layer] if e >= 0)

    def occupants(self, layer: int) -> list[int]:
        """The resident experts in slot order."""
        return [int(e) for e in self._owner[layer] if e >= 0]

    def resident_mask(self, layer: int) -> mx.array:
        """bool per expert: resident now (no MLX sync)."""
        return mx.array(self._slot_of[layer] >= 0)

    def slot_map(self, layer: int) -> mx.array:
        """expert id -> slot id (int32, one entry per expert; non-resident experts map to 0, never read)."""
        if layer not in self._maps:
            self._maps[layer] = mx.array(np.maximum(self._slot_of[layer], 0))
        return self._maps[layer]

    def free_slot(self, layer: int) -> int | None:
        free = np.flatnonzero(self._owner[layer] < 0)
        return int(free[0]) if free.size else None

    def evict(self, layer: int, expert: int) -> int:
        """Take ``expert`` out of its slot; returns the slot."""
        slot = int(self._slot_of[layer][expert])
        self._slot_of[layer][expert] = -1
        return slot

    def write(self, layer: int, expert: int, slot: int, arrays: dict[str, np.ndarray]) -> None:
        """Write ``expert``'s tensors into ``slot`` (in place: the slot tensor keeps its shape and its buffer)."""
        tensors = self.tensors[layer]
        for name, a in self.store.to_mlx(layer, arrays).items():
            tensors[name][slot] = a
        self._owner[layer][slot], self._slot_of[layer][expert] = expert, slot
        self.policies[layer].inserted(expert)
        self._maps.pop(layer, None)
        self.written += 1

    def warm_fill(self, read: Callable[[int, int], dict[str, np.ndarray]]) -> None:
        """Create each layer's slot tensors holding experts 0..S-1 (``read(layer, expert)``), uncounted. Built from
        the stacked experts rather than zeros plus writes, so the peak is the budget."""
        for l in self.layers:
            s = self.slots_per_layer[l]
            experts = [read(l, e) for e in range(s)]
            names = [p["name"] for p in self.store.params(l)]
            self.tensors[l] = self.store.to_mlx(l, {n: np.stack([x[n] for x in experts]) for n in names})
            mx.eval(list(self.tensors[l].values()))
            self._owner[l][:] = np.arange(s)
            self._slot_of[l][:s] = np.arange(s)
            for e in range(s):
                self.policies[l].inserted(e)
