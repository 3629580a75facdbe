"""The memory-budgeted expert cache: fixed slots per MoE layer, filled and evicted on demand.

Each MoE layer gets ``S`` slots. A slot tensor per expert parameter has shape
``(S, *expert_shape)`` and never changes shape: loading an expert writes into one slot in
place, and the router's expert ids are remapped to slot ids (``slot_map``) before the
gathered matmul. So the model's compute graph is the same whatever is resident, and the
memory held is exactly the budget.

Threading: MLX arrays are only touched from the forward (compute) thread. A background
``Prefetcher`` only reads bytes from the store (and waits on the link); its finished numpy
buffers are copied into slots by the compute thread at the next ``ensure``.
"""

from __future__ import annotations

from bisect import bisect_left
from contextlib import contextmanager
from functools import partial
from typing import Callable, Iterable, Iterator

import mlx.core as mx
import numpy as np

from .budget import human, parse_budget, resolve_slots
from .clock import Clock, WallClock
from .link import Link
from .policies import Belady, make_policy
from .stats import CacheStats
from .store import ExpertStore

Listener = Callable[[int, mx.array], None]
__all__ = ["ExpertCache", "parse_budget", "resolve_slots"]


class ExpertCache:
    """Experts of every MoE layer in fixed slots within a byte budget; see the module docstring."""

    def __init__(
        self,
        store: ExpertStore,
        budget: float | int | str = 1.0,
        *,
        policy: str = "lru",
        link: Link | None = None,
        clock: Clock | None = None,
    ):
        self.store = store
        self.link = link or Link()
        self.clock = clock or WallClock()  # what every time-dependent decision reads (clock.py)
        self.policy_name = policy
        self.layers: list[int] = store.layers
        self._ordinal = {l: i for i, l in enumerate(self.layers)}
        self.slots_per_layer = resolve_slots(budget, store)
        self.budget = budget
        self.policies = {l: make_policy(policy) for l in self.layers}
        # the true future (set_future): layer -> expert -> the steps it is used at
        self._uses: dict[int, dict[int, list[int]]] | None = None
        self.slots: dict[int, dict[str, mx.array]] = {}  # layer -> parameter name -> (S, ...) tensor
        self._owner = {l: np.full(self.slots_per_layer[l], -1, np.int64) for l in self.layers}  # slot -> expert
        self._slot_of = {l: np.full(store.num_experts(l), -1, np.int32) for l in self.layers}  # expert -> slot
        self._maps: dict[int, mx.array] = {}
        self._dirty: set[int] = set()
        self._unused_prefetch: dict[int, set[int]] = {l: set() for l in self.layers}
        self._evicted_ahead: dict[int, set[int]] = {l: set() for l in self.layers}  # evicted by a prefetch, not back
        self._protected: tuple[int | None, set[int]] = (None, set())
        self._predictions: dict[tuple[int, int], set[int]] = {}
        self.routers: dict[int, Callable[[mx.array], mx.array]] = {}  # filled by offload_experts
        self.scorers: dict[int, Callable[[mx.array], mx.array]] = {}  # x -> router probabilities (blocks.py)
        self.listeners: list[Listener] = []
        self.prefetcher = None  # a Prefetcher registers itself here
        self.planner = None  # a PrefetchPlanner (planner.py) decides which predictions load, and what they evict
        self.tokens_now = 0  # tokens in the forward pass now
        self.stats = CacheStats()
        self.trace: dict[tuple[int, int], list[int]] | None = None  # set to {} to record experts used per (step, layer)
        self.step = -1
        self.position = (-1, -1)  # (step, MoE layer ordinal) the forward pass has reached
        self._side = False
        self.resident_only = False  # set while a predictor's pass routes among resident experts only
        self.fused_rows = 0  # set while the last batch rows are a fast stream fused into the slow pass
        self._warm_fill()

    # -- state -----------------------------------------------------------------------------

    def num_experts(self, layer: int) -> int:
        return self.store.num_experts(layer)

    def top_k(self, layer: int) -> int | None:
        return self.store.top_k(layer)

    @property
    def resident_bytes(self) -> int:
        return sum(self.slots_per_layer[l] * self.store.expert_bytes(l) for l in self.layers)

    def is_resident(self, layer: int, expert: int) -> bool:
        return bool(self._slot_of[layer][expert] >= 0)

    def resident(self, layer: int) -> list[int]:
        return sorted(int(e) for e in self._owner[layer] if e >= 0)

    def resident_mask(self, layer: int) -> mx.array:
        """bool per expert: resident now (read on the compute thread; no MLX sync)."""
        return mx.array(self._slot_of[layer] >= 0)

    def slot_map(self, layer: int) -> mx.array:
        """expert id -> slot id (int32, one entry per expert; non-resident experts map to 0, never read)."""
        if layer not in self._maps:
            self._maps[layer] = mx.array(np.maximum(self._slot_of[layer], 0))
        return self._maps[layer]

    def ordinal(self, layer: int) -> int:
        """The position of ``layer`` among the MoE layers (0 for the first)."""
        return self._ordinal[layer]

    @property
    def predictions(self) -> dict[tuple[int, int], set[int]]:
        """(step, layer) -> experts predicted for it and not yet scored."""
        return self._predictions

    def in_flight(self, layer: int, expert: int) -> bool:
        """Whether the background loader holds a load of ``expert`` into ``layer`` (queued, reading or arrived)."""
        return self.prefetcher is not None and self.prefetcher.holds(layer, expert)

    def pending_loads(self, layer: int) -> int:
        """Loads into ``layer`` the background loader holds, not yet in a slot."""
        return 0 if self.prefetcher is None else self.prefetcher.count(layer)

    def next_layers(self, layer: int, n: int = 1) -> list[int]:
        """The ``n`` MoE layers after ``layer``."""
        i = self._ordinal[layer]
        return self.layers[i + 1 : i + 1 + n]

    def is_stale(self, step: int, layer: int) -> bool:
        """Whether the forward pass has already gone past ``layer`` at ``step`` (safe from any thread)."""
        return (step, self._ordinal[layer]) < self.position

    @property
    def holds_every_expert(self) -> bool:
        """Whether every layer has a slot for each of its experts (nothing is ever loaded after the warm fill)."""
        return all(self.slots_per_layer[l] >= self.num_experts(l) for l in self.layers)

    def describe(self) -> str:
        s = sorted(set(self.slots_per_layer.values()))
        e = sorted({self.num_experts(l) for l in self.layers})
        return (
            f"experts: budget {self.budget!r}, {'/'.join(map(str, s))} of {'/'.join(map(str, e))} per layer "
            f"({human(self.resident_bytes)}), {self.policy_name}, {self.link!r}"
        )

    # -- the forward pass ------------------------------------------------------------------

    def begin_layer(self, layer: int, x: mx.array, experts: Iterable[int]) -> list[list[int]]:
        """Before a layer computes its experts: count the step, run listeners, score predictions.

        ``x`` is the MoE block's input, (tokens, D). Returns the experts split into rounds of at
        most S (one round unless a long prompt needs more distinct experts than the layer has slots).
        """
        needed = sorted({int(e) for e in experts})
        if self._side:
            return self._rounds(layer, needed)
        if layer == self.layers[0]:
            self.step += 1
            self.stats.steps += 1
            self.stats.tokens += x.shape[0]
            self._predictions = {k: v for k, v in self._predictions.items() if k[0] >= self.step}
        self.position = (self.step, self._ordinal[layer])
        self.tokens_now = x.shape[0]
        if self.planner is not None:
            self.planner.observe(self.step, layer, needed, x.shape[0])
        for listener in list(self.listeners):
            listener(layer, x)
        predicted = self._predictions.pop((self.step, layer), None)
        if predicted is not None:
            st = self.stats.layer(layer)
            st.predicted += len(predicted)
            st.predicted_used += len(predicted.intersection(needed))
            st.used_when_predicted += len(needed)
        if self.trace is not None:
            self.trace[(self.step, layer)] = needed
        return self._rounds(layer, needed)

    def _rounds(self, layer: int, needed: list[int]) -> list[list[int]]:
        s = self.slots_per_layer[layer]
        if len(needed) <= s:
            return [needed]
        needed.sort(key=lambda e: not self.is_resident(layer, e))  # resident experts first: fewer loads
        return [needed[i : i + s] for i in range(0, len(needed), s)]

    def ensure(self, layer: int, experts: Iterable[int]) -> None:
        """Make ``experts`` (at most S of them) resident in ``layer``; never evicts one of them."""
        needed = list(dict.fromkeys(int(e) for e in experts))
        if len(needed) > self.slots_per_layer[layer]:
            raise ValueError(
                f"{len(needed)} experts asked for at once, layer {layer} has {self.slots_per_layer[layer]} slots"
            )
        start = self.clock.now()
        st = self.stats.layer(layer)
        self._protected = (layer, set(needed))
        try:
            if self.prefetcher is not None:
                missing = [e for e in needed if not self.is_resident(layer, e)]
                arrived, late, dropped = self.prefetcher.collect(layer, missing)
                st.late_prefetches += late
                self.stats.prefetch_dropped += dropped
                for l, e, arrays in arrived:
                    self._land(l, e, arrays)
            for e in needed:
                if self._side:  # the fast stream pulling experts in ahead: a prefetch, not a use
                    if not self.is_resident(layer, e):
                        self._land(layer, e, self.fetch(layer, e))
                    continue
                if self.is_resident(layer, e):
                    st.hits += 1
                    if e in self._unused_prefetch[layer]:
                        self._unused_prefetch[layer].discard(e)
                        st.prefetch_hits += 1
                else:
                    st.misses += 1
                    st.evicted_ahead_missed += e in self._evicted_ahead[layer]
                    st.bytes_on_demand += self.store.expert_bytes(layer)
                    self._install(layer, e, self.fetch(layer, e))
                self.policies[layer].used(e)
        finally:
            self._protected = (None, set())
        if self._dirty:
            self._flush()
            self.stats.stall_s += self.clock.now() - start

    @contextmanager
    def side_pass(self) -> Iterator[None]:
        """Forward passes that are not the model's own step (the M2R2 fast stream running ahead).

        Their experts load like prefetches (a later use by the real pass is a prefetch hit);
        they count no step, hit or miss, run no listeners and score no predictions.
        """
        self._side, before = True, self._side
        try:
            yield
        finally:
            self._side = before

    # -- predictions and prefetching -------------------------------------------------------

    def prefetch(self, layer: int, experts: Iterable[int], step: int | None = None, scores=None) -> None:
        """Predict that ``layer`` will use ``experts`` at ``step`` (default: the current one) and bring them in.

        The prediction is scored against the experts really used (precision/recall). Loads go
        to the background ``Prefetcher`` if one is attached, else happen now (and stall).
        At most S experts per request are loaded (more could not all stay resident). With a
        ``planner``, only those it expects to pay; ``scores``: the predictor's probability of every
        expert of the layer (indexed by expert id), where it has them.
        """
        step = self.step if step is None else step
        experts = list(dict.fromkeys(int(e) for e in experts))
        self._predictions.setdefault((step, layer), set()).update(experts)
        if self.planner is not None:
            experts = self.planner.select(layer, experts, step, scores)
        wanted = [e for e in experts if not self.is_resident(layer, e)][: self.slots_per_layer[layer]]
        if not wanted:
            return
        if self.prefetcher is not None:
            self.prefetcher.submit(step, layer, wanted)
            return
        start = self.clock.now()
        for e in wanted:
            self._land(layer, e, self.fetch(layer, e))
        self._flush()
        self.stats.stall_s += self.clock.now() - start

    def fetch(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """Read one expert over the link (verified bytes, numpy). Safe from any thread: no MLX here."""
        with self.link.transfer(self.store.expert_bytes(layer)):
            return self.store.read(layer, expert)

    def host_sync(self) -> None:
        """The forward pass read the router's choice back to the host (decide loads): a round trip on a device."""
        if self.clock.modelled:
            self.clock.sync()

    def add_listener(self, listener: Listener) -> None:
        """``listener(layer, x)`` runs before each MoE layer computes its experts (x: (tokens, D))."""
        self.listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        self.listeners.remove(listener)

    # -- the true future (offline bounds) ----------------------------------------------------

    def set_future(self, routes: dict[tuple[int, int], list[int]]) -> None:
        """The routes this decode will take ((step, layer) -> experts, a recorded identical run's ``trace``), and
        every layer evicting by Belady's rule on them (policies.Belady): the on-demand optimum, for measurements."""
        uses: dict[int, dict[int, list[int]]] = {l: {} for l in self.layers}
        for (step, layer), experts in sorted(routes.items()):
            for e in experts:
                uses[layer].setdefault(e, []).append(step)
        self._uses = uses
        for l in self.layers:
            if not isinstance(self.policies[l], Belady):
                self.policies[l] = Belady(partial(self.next_use, l))
                for e in self.resident(l):
                    self.policies[l].inserted(e)
        self.policy_name = "belady"

    def next_use(self, layer: int, expert: int) -> float:
        """The first step at which ``layer`` uses ``expert`` after the forward pass's position (inf: never)."""
        step, here = self.position
        first = step if self._ordinal[layer] > here else step + 1  # a later layer of this step, or the next step
        steps = self._uses[layer].get(expert, ())
        i = bisect_left(steps, first)
        return steps[i] if i < len(steps) else float("inf")

    # -- bookkeeping -----------------------------------------------------------------------

    def reset(self) -> None:
        """Start a new measurement: zero the stats and the step count (resident experts stay)."""
        self.stats.reset()
        self.step, self.position = -1, (-1, -1)
        self._predictions.clear()
        for unused in self._unused_prefetch.values():
            unused.clear()
        if self.trace is not None:
            self.trace = {}

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()

    def _warm_fill(self) -> None:
        """Create each layer's slot tensors holding experts 0..S-1, uncounted and without the link.

        Built from the stacked experts rather than zeros plus writes, so the peak is the budget.
        """
        for l in self.layers:
            s = self.slots_per_layer[l]
            experts = [self.store.read(l, e) for e in range(s)]
            names = [p["name"] for p in self.store.params(l)]
            self.slots[l] = self.store.to_mlx(l, {n: np.stack([x[n] for x in experts]) for n in names})
            mx.eval(list(self.slots[l].values()))
            self._owner[l][:] = np.arange(s)
            self._slot_of[l][:s] = np.arange(s)
            for e in range(s):
                self.policies[l].inserted(e)

    def _land(self, layer: int, expert: int, arrays: dict[str, np.ndarray]) -> None:
        """A prefetched expert arrived: count it, install it unless it is already there."""
        st = self.stats.layer(layer)
        st.prefetch_loads += 1
        st.prefetch_bytes += self.store.expert_bytes(layer)
        if self.is_resident(layer, expert) or not self._install(layer, expert, arrays, prefetched=True):
            st.prefetch_wasted += 1

    def _install(self, layer: int, expert: int, arrays: dict[str, np.ndarray], prefetched: bool = False) -> bool:
        """Write an expert into a free slot, or the policy's victim's; False if every slot is protected."""
        owner, slot_of = self._owner[layer], self._slot_of[layer]
        free = np.flatnonzero(owner < 0)
        if free.size:
            slot = int(free[0])
        else:
            protected = self._protected[1] if self._protected[0] == layer else set()
            candidates = [int(e) for e in owner if e not in protected]
            if self.planner is not None and candidates:
                victim = self.planner.victim(layer, candidates, demand=not prefetched)
            else:
                victim = self.policies[layer].victim(candidates) if candidates else None
            if victim is None:
                return False
            slot = int(slot_of[victim])
            slot_of[victim] = -1
            if prefetched:
                self._evicted_ahead[layer].add(victim)
            if victim in self._unused_prefetch[layer]:
                self._unused_prefetch[layer].discard(victim)
                self.stats.layer(layer).prefetch_wasted += 1
        if self.clock.modelled:
            self.link.land(self.store.expert_bytes(layer))
        slots = self.slots[layer]
        for name, a in self.store.to_mlx(layer, arrays).items():
            slots[name][slot] = a  # in place: the slot tensor keeps its shape and its buffer
        owner[slot], slot_of[expert] = expert, slot
        self._evicted_ahead[layer].discard(expert)
        self.policies[layer].inserted(expert)
        if prefetched:
            self._unused_prefetch[layer].add(expert)
        self._dirty.add(layer)
        return True

    def _flush(self) -> None:
        """Run the pending slot writes now (so their cost lands in stall time) and refresh the maps."""
        mx.eval([a for l in self._dirty for a in self.slots[l].values()])
        for l in self._dirty:
            self._maps.pop(l, None)
        self._dirty.clear()
