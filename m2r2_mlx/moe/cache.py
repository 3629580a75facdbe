"""The memory-budgeted expert cache: what the forward pass and the predictors talk to.

It is made of parts, each with one job, handed to it or built by it: the slots and which expert sits in each
(``Residency``, residency.py), the accounting (``Ledger``, stats.py), the queue of reads that brings experts in
(``DiskLoader`` on the wall clock, ``DeviceLoader`` on a device's, loader.py) and, optionally, the planner that
decides which predictions load and what they evict (``PrefetchPlanner``, planner.py). Before each MoE layer computes,
``begin_layer`` counts the step, runs the predictors listening and scores their predictions; ``ensure`` makes the
layer's experts resident, waiting for reads where it must. Predictors ask for experts ahead with ``prefetch``.

Its modes are context managers: ``side_pass()`` (a forward pass that is not the model's own step), ``resident_only()``
(a predictor's pass routed among resident experts: no loads) and ``fused_rows(n)`` (the last ``n`` batch rows are a
fast stream riding along: routed to the slow rows' experts).

Threading: MLX arrays are touched only from the forward pass's thread; the loader's threads only read bytes.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import mlx.core as mx
import numpy as np

from ..errors import M2R2Error
from ..tracing import NO_TRACE, Tracer
from .budget import human, parse_budget, resolve_slots
from .clock import Clock, DeviceClock, WallClock
from .device_loader import DeviceLoader
from .loader import DiskLoader, Loader, Read
from .residency import PolicyFactory, Residency
from .stats import CacheStats, Ledger
from .store import ExpertStore

if TYPE_CHECKING:
    from .planner import PrefetchPlanner

Listener = Callable[[int, mx.array], None]
__all__ = ["ExpertCache", "IOConfig", "Mode", "parse_budget", "resolve_slots"]


@dataclass(frozen=True)
class IOConfig:
    """How the wall clock's loader reads: ``io`` "direct" (around the page cache) or "cached" (through it);
    ``workers`` reads in flight at most; ``buffers`` aligned read buffers (None: one per slot of the largest layer,
    kept for loads on demand, plus one per worker; at least one more than the slots)."""

    io: str = "direct"
    workers: int = 4
    buffers: int | None = None


@dataclass(frozen=True)
class Mode:
    side: bool = False  # not the model's own step: loads count as prefetches, nothing is scored
    resident_only: bool = False  # routed among resident experts: no loads, no sync
    fused_rows: int = 0  # the last rows are a fast stream riding along, routed to the slow rows' experts


class ExpertCache:
    """Experts of every MoE layer in fixed slots within a byte budget; see the module docstring. ``clock``: the
    wall clock (default) or a DeviceClock with ``device_scale`` (its bytes per byte held here); ``tracer``: the
    waits for loads run through ``tracer.call("expert-stall", ...)`` (tracing.py)."""

    def __init__(
        self,
        store: ExpertStore,
        budget: float | int | str = 1.0,
        *,
        policy: str | PolicyFactory = "lru",
        clock: Clock | None = None,
        planner: PrefetchPlanner | None = None,
        io: IOConfig = IOConfig(),
        device_scale: float = 1.0,
        tracer: Tracer = NO_TRACE,
    ):
        self.store = store
        self.clock = clock or WallClock()  # what every time-dependent decision reads (clock.py)
        self.residency = Residency(store, budget, policy)
        self.ledger = Ledger(self.residency.layers)
        if isinstance(self.clock, DeviceClock):
            self.loader: Loader = DeviceLoader(store, self.clock, device_scale)
        else:
            slots = max(self.residency.slots_per_layer.values())  # the most one wait for loads can ask for
            buffers = max(io.buffers or slots + io.workers, slots + 1)
            self.loader = DiskLoader(store, io=io.io, workers=io.workers, buffers=buffers, reserve=slots)
        self.tracer = tracer
        self.routers: dict[int, Callable[[mx.array], mx.array]] = {}  # filled by offload_experts
        self.scorers: dict[int, Callable[[mx.array], mx.array]] = {}  # x -> router probabilities (blocks.py)
        self.listeners: list[Listener] = []
        self.position = (-1, -1)  # (step, MoE layer ordinal) the forward pass has reached
        self.tokens_now = 0  # tokens in the forward pass now
        self.mode = Mode()
        self.residency.warm_fill(lambda l, e: store.read(l, e, io.io))
        self.planner = planner
        if planner is not None:
            planner.bind(self)

    # -- state -----------------------------------------------------------------------------

    @property
    def layers(self) -> list[int]:
        return self.residency.layers

    @property
    def step(self) -> int:
        return self.position[0]

    @property
    def stats(self) -> CacheStats:
        return self.ledger.stats

    @property
    def trace(self) -> dict[tuple[int, int], list[int]] | None:
        """The experts each (step, layer) used, where recording (set it to {} to start)."""
        return self.ledger.trace

    @trace.setter
    def trace(self, value: dict | None) -> None:
        self.ledger.trace = value

    @property
    def predictions(self) -> dict[tuple[int, int], set[int]]:
        """(step, layer) -> experts predicted for it and not yet scored."""
        return self.ledger.predictions

    @property
    def slots(self) -> dict[int, dict[str, mx.array]]:
        """layer -> parameter name -> (S, ...) slot tensor."""
        return self.residency.tensors

    @property
    def slots_per_layer(self) -> dict[int, int]:
        return self.residency.slots_per_layer

    @property
    def policies(self):
        return self.residency.policies

    @property
    def resident_bytes(self) -> int:
        return self.residency.resident_bytes

    @property
    def holds_every_expert(self) -> bool:
        return self.residency.holds_every_expert

    def num_experts(self, layer: int) -> int:
        return self.store.num_experts(layer)

    def top_k(self, layer: int) -> int | None:
        return self.store.top_k(layer)

    def is_resident(self, layer: int, expert: int) -> bool:
        return self.residency.is_resident(layer, expert)

    def resident(self, layer: int) -> list[int]:
        return self.residency.resident(layer)

    def resident_mask(self, layer: int) -> mx.array:
        return self.residency.resident_mask(layer)

    def slot_map(self, layer: int) -> mx.array:
        return self.residency.slot_map(layer)

    def ordinal(self, layer: int) -> int:
        """The position of ``layer`` among the MoE layers (0 for the first)."""
        return self.residency.ordinals[layer]

    def next_layers(self, layer: int, n: int = 1) -> list[int]:
        """The ``n`` MoE layers after ``layer``."""
        i = self.ordinal(layer)
        return self.layers[i + 1 : i + 1 + n]

    def in_flight(self, layer: int, expert: int) -> bool:
        """Whether the loader holds a read of ``expert`` into ``layer`` (queued, reading or arrived)."""
        return self.loader.holds(layer, expert)

    def pending_loads(self, layer: int) -> int:
        """Reads into ``layer`` the loader holds, not yet in a slot."""
        return self.loader.count(layer)

    def describe(self) -> str:
        s = sorted(set(self.slots_per_layer.values()))
        e = sorted({self.num_experts(l) for l in self.layers})
        return (
            f"experts: budget {self.residency.budget!r}, {'/'.join(map(str, s))} of {'/'.join(map(str, e))} per "
            f"layer ({human(self.resident_bytes)}), {self.residency.policy_name}"
        )

    # -- modes -----------------------------------------------------------------------------

    @contextmanager
    def _in(self, **mode) -> Iterator[None]:
        before = self.mode
        self.mode = replace(before, **mode)
        try:
            yield
        finally:
            self.mode = before

    def side_pass(self):
        """Forward passes that are not the model's own step (the M2R2 fast stream running ahead). Their experts
        load like prefetches (a later use by the real pass is a prefetch hit); they count no step, hit or miss, run
        no listeners and score no predictions."""
        return self._in(side=True)

    def resident_only(self):
        """A predictor's pass routed among the resident experts: it loads nothing and does not sync."""
        return self._in(resident_only=True)

    def fused_rows(self, rows: int):
        """The last ``rows`` batch rows are a fast stream fused into the slow pass, routed to the slow rows'
        experts: only the slow rows load."""
        return self._in(fused_rows=rows)

    # -- the forward pass ------------------------------------------------------------------

    def begin_layer(self, layer: int, x: mx.array, experts: Iterable[int]) -> list[list[int]]:
        """Before a layer computes its experts: count the step, run listeners, score predictions.

        ``x`` is the MoE block's input, (tokens, D). Returns the experts split into rounds of at
        most S (one round unless a long prompt needs more distinct experts than the layer has slots).
        """
        needed = sorted({int(e) for e in experts})
        if self.mode.side:
            return self._rounds(layer, needed)
        step = self.step + (layer == self.layers[0])
        if layer == self.layers[0]:
            self.ledger.new_step(step, x.shape[0])
        self.position = (step, self.ordinal(layer))
        self.tokens_now = x.shape[0]
        self.ledger.cancelled(self.loader.settle(step, layer, needed))
        if self.planner is not None:
            self.planner.observe(step, layer, needed, x.shape[0])
        for listener in list(self.listeners):
            listener(layer, x)
        self.ledger.score(step, layer, needed)
        return self._rounds(layer, needed)

    def _rounds(self, layer: int, needed: list[int]) -> list[list[int]]:
        s = self.slots_per_layer[layer]
        if len(needed) <= s:
            return [needed]
        needed.sort(key=lambda e: not self.is_resident(layer, e))  # resident experts first: fewer loads
        return [needed[i : i + s] for i in range(0, len(needed), s)]

    def ensure(self, layer: int, experts: Iterable[int]) -> None:
        """Make ``experts`` (at most S of them) resident in ``layer``; never evicts one of them. The wait runs
        through the tracer as "expert-stall"."""
        self.tracer.call("expert-stall", self._ensure, layer, experts)

    def _ensure(self, layer: int, experts: Iterable[int]) -> None:
        needed = list(dict.fromkeys(int(e) for e in experts))
        if len(needed) > self.slots_per_layer[layer]:
            raise ValueError(
                f"{len(needed)} experts asked for at once, layer {layer} has {self.slots_per_layer[layer]} slots"
            )
        start, written = self.clock.now(), self.residency.written
        misses: set[int] = set()  # read on demand: no read was held for them when the pass got here
        for attempt in range(1 if self.mode.side else 2):  # a second only for a prefetch _install refused
            missing = [e for e in needed if not self.is_resident(layer, e)]
            if attempt and not missing:
                break  # (the first round lands whatever has arrived, needed or not)
            misses |= {e for e in missing if not self.loader.holds(layer, e)}
            arrived, late = self.loader.fetch(layer, missing)
            self.ledger.late(layer, late)
            on_demand = set() if self.mode.side else {(layer, e) for e in misses}
            self._land(arrived, on_demand, protected=(layer, set(needed)))
        if not self.mode.side:  # the fast stream pulling experts in ahead: a prefetch, not a use
            for e in needed:
                if e in misses:
                    self.ledger.miss(layer, e, self.store.expert_bytes(layer))
                else:
                    self.ledger.hit(layer, e)
                self.policies[layer].used(e)
        if self.residency.written > written:  # (a pass that found everything resident waited for nothing)
            self.ledger.stalled(self.clock.now() - start)

    def host_sync(self) -> None:
        """The forward pass read the router's choice back to the host (decide loads): a round trip on a device."""
        self.clock.sync()

    # -- predictions and prefetching -------------------------------------------------------

    def prefetch(self, layer: int, experts: Iterable[int], step: int | None = None, scores=None) -> None:
        """Predict that ``layer`` will use ``experts`` at ``step`` (default: the current one) and read them ahead.

        The prediction is scored against the experts really used (precision/recall). At most S experts per request
        are read (more could not all stay resident). With a planner, only those it expects to pay; ``scores``: the
        predictor's probability of every expert of the layer (indexed by expert id), where it has them.
        """
        step = self.step if step is None else step
        experts = list(dict.fromkeys(int(e) for e in experts))
        self.ledger.predicted(step, layer, experts)
        named = set(experts)
        if self.planner is not None:
            experts = self.planner.select(layer, experts, step, scores)
        wanted = [e for e in experts if not self.is_resident(layer, e)][: self.slots_per_layer[layer]]
        self.loader.prefetch(step, layer, wanted, named)

    def add_listener(self, listener: Listener) -> None:
        """``listener(layer, x)`` runs before each MoE layer computes its experts (x: (tokens, D))."""
        self.listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        self.listeners.remove(listener)

    # -- bookkeeping -----------------------------------------------------------------------

    def require_routers(self, who: str) -> None:
        """One line where ``who`` (a predictor) needs a router this model's MoE blocks do not expose."""
        missing = [l for l in self.layers if l not in self.routers]
        if missing:
            raise M2R2Error(f"{who} needs the routers of MoE layers {missing}, which this model's blocks do not expose")

    def reset(self) -> None:
        """Start a new measurement: zero the stats and the step count (resident experts stay)."""
        self.ledger.reset()
        self.position = (-1, -1)

    def close(self) -> None:
        """Stop the loader's threads and close its files."""
        self.loader.close()

    def __enter__(self) -> "ExpertCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _land(self, arrived: list[Read], on_demand: set[tuple[int, int]], protected: tuple[int, set[int]]) -> None:
        """Finished reads into slots: loads on demand (``on_demand``) and arrived prefetches; none evicts an expert
        ``protected`` names (the layer computing now, and the experts it computes with)."""
        for read in arrived:
            nbytes = self.store.expert_bytes(read.layer)
            spare = protected[1] if protected[0] == read.layer else set()
            if read.key in on_demand:
                self._install(read.layer, read.expert, read.arrays, spare)
            elif self.is_resident(*read.key):
                self.ledger.prefetch_arrived(read.layer, nbytes, installed=False)
            else:
                installed = self._install(read.layer, read.expert, read.arrays, spare, prefetched=True)
                self.ledger.prefetch_arrived(read.layer, nbytes, installed)
            self.loader.release(read)

    def _install(
        self, layer: int, expert: int, arrays: dict[str, np.ndarray], protected: set[int], prefetched: bool = False
    ) -> bool:
        """Write an expert into a free slot, or the victim's; False if every slot is protected (or, for a prefetch,
        the planner spares every resident expert: a needed expert whose prefetch lands so is then read on demand)."""
        slot = self.residency.free_slot(layer)
        if slot is None:
            candidates = [e for e in self.residency.occupants(layer) if e not in protected]
            if self.planner is not None and candidates:
                victim = self.planner.victim(layer, candidates, demand=not prefetched)
            else:
                victim = self.policies[layer].victim(candidates) if candidates else None
            if victim is None:
                return False
            slot = self.residency.evict(layer, victim)
            self.ledger.evicted(layer, victim, by_prefetch=prefetched)
        self.loader.landed(self.store.expert_bytes(layer))
        self.residency.write(layer, expert, slot, arrays)
        self.ledger.installed(layer, expert, prefetched)
        return True
