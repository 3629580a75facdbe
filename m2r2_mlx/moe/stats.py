"""What the expert cache did: hits, misses, bytes moved, stall time, prediction quality.

Counters live per MoE layer; totals are sums over layers, so the two never disagree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


@dataclass
class LayerStats:
    hits: int = 0  # experts a forward pass needed that were resident (prefetched ones included)
    misses: int = 0  # experts read on demand while the forward pass waited
    bytes_on_demand: int = 0  # = misses x expert bytes
    prefetch_loads: int = 0  # experts the prefetcher brought in
    prefetch_bytes: int = 0
    prefetch_hits: int = 0  # prefetched experts later used (counted once, at the first use)
    prefetch_wasted: int = 0  # prefetched experts evicted unused, or already resident on arrival
    late_prefetches: int = 0  # needed experts still in flight: the pass waited for the prefetcher
    evicted_ahead_missed: int = 0  # experts a prefetch evicted that a later pass then loaded on demand
    predicted: int = 0  # predicted (step, layer, expert) triples that were later checked
    predicted_used: int = 0  # ... of which the layer really used the expert
    used_when_predicted: int = 0  # experts used at (step, layer) pairs that had a prediction

    @property
    def precision(self) -> float:
        return _ratio(self.predicted_used, self.predicted)

    @property
    def recall(self) -> float:
        return _ratio(self.predicted_used, self.used_when_predicted)

    @property
    def hit_rate(self) -> float:
        return _ratio(self.hits, self.hits + self.misses)


@dataclass
class CacheStats:
    tokens: int = 0  # tokens through the first MoE layer (a prompt counts all its tokens)
    steps: int = 0  # forward passes
    stall_s: float = 0.0  # time the forward pass waited on the cache: reads, in-flight prefetches, copies into slots
    prefetch_dropped: int = 0  # queued prefetches cancelled unread: their layer came without needing them, or a newer
    # prediction for it no longer named them
    layers: dict[int, LayerStats] = field(default_factory=dict)

    def layer(self, layer: int) -> LayerStats:
        return self.layers.setdefault(layer, LayerStats())

    def total(self, name: str) -> int:
        return sum(getattr(s, name) for s in self.layers.values())

    @property
    def hits(self) -> int:
        return self.total("hits")

    @property
    def misses(self) -> int:
        return self.total("misses")

    @property
    def hit_rate(self) -> float:
        return _ratio(self.hits, self.hits + self.misses)

    @property
    def bytes_moved(self) -> int:
        """Every byte over the link: on-demand loads and prefetches."""
        return self.total("bytes_on_demand") + self.total("prefetch_bytes")

    @property
    def bytes_per_token(self) -> float:
        return _ratio(self.bytes_moved, self.tokens)

    @property
    def stall_per_token_s(self) -> float:
        return _ratio(self.stall_s, self.tokens)

    @property
    def loads_per_token(self) -> float:
        """Experts over the link per token: on-demand loads and prefetches."""
        return _ratio(self.misses + self.total("prefetch_loads"), self.tokens)

    @property
    def precision(self) -> float:
        return _ratio(self.total("predicted_used"), self.total("predicted"))

    @property
    def recall(self) -> float:
        return _ratio(self.total("predicted_used"), self.total("used_when_predicted"))

    def add(self, other: CacheStats) -> None:
        """Count ``other``'s counters in these too: several runs (each cache.reset() zeroes the cache's) as one."""
        vars(self).update(_summed(self, other, skip="layers"))
        for l, theirs in other.layers.items():
            mine = self.layer(l)
            vars(mine).update(_summed(mine, theirs))

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default_factory() if f.name == "layers" else f.default)

    def summary(self) -> dict:
        """Totals, rates and per-layer counters as plain JSON-ready values."""
        totals = {f.name: self.total(f.name) for f in fields(LayerStats)}
        return {
            "tokens": self.tokens,
            "steps": self.steps,
            "stall_s": self.stall_s,
            "stall_per_token_s": self.stall_per_token_s,
            "prefetch_dropped": self.prefetch_dropped,
            **totals,
            "hit_rate": self.hit_rate,
            "bytes_moved": self.bytes_moved,
            "bytes_per_token": self.bytes_per_token,
            "precision": self.precision,
            "recall": self.recall,
            "layers": {
                l: {**asdict(s), "hit_rate": s.hit_rate, "precision": s.precision, "recall": s.recall}
                for l, s in sorted(self.layers.items())
            },
        }


class Ledger:
    """An expert cache's accounting: the counters (``stats``), the predictions not yet scored, which resident
    experts came in as prefetches and are still unused, which experts a prefetch evicted, and (where asked for) the
    experts each (step, layer) used (``trace``)."""

    def __init__(self, layers: list[int]):
        self.stats = CacheStats()
        self.predictions: dict[tuple[int, int], set[int]] = {}  # (step, layer) -> experts predicted, not yet scored
        self._unused_prefetch: dict[int, set[int]] = {l: set() for l in layers}
        self._evicted_ahead: dict[int, set[int]] = {l: set() for l in layers}  # evicted by a prefetch, not back
        self.trace: dict[tuple[int, int], list[int]] | None = None  # {} records the experts used per (step, layer)

    def new_step(self, step: int, tokens: int) -> None:
        self.stats.steps += 1
        self.stats.tokens += tokens
        self.predictions = {k: v for k, v in self.predictions.items() if k[0] >= step}

    def predicted(self, step: int, layer: int, experts: list[int]) -> None:
        self.predictions.setdefault((step, layer), set()).update(experts)

    def score(self, step: int, layer: int, needed: list[int]) -> None:
        """``layer`` uses ``needed`` at ``step``: the prediction for it is scored, the trace records it."""
        predicted = self.predictions.pop((step, layer), None)
        if predicted is not None:
            st = self.stats.layer(layer)
            st.predicted += len(predicted)
            st.predicted_used += len(predicted.intersection(needed))
            st.used_when_predicted += len(needed)
        if self.trace is not None:
            self.trace[(step, layer)] = needed

    def hit(self, layer: int, expert: int) -> None:
        st = self.stats.layer(layer)
        st.hits += 1
        if expert in self._unused_prefetch[layer]:
            self._unused_prefetch[layer].discard(expert)
            st.prefetch_hits += 1

    def miss(self, layer: int, expert: int, nbytes: int) -> None:
        st = self.stats.layer(layer)
        st.misses += 1
        st.evicted_ahead_missed += expert in self._evicted_ahead[layer]
        st.bytes_on_demand += nbytes

    def prefetch_arrived(self, layer: int, nbytes: int, installed: bool) -> None:
        st = self.stats.layer(layer)
        st.prefetch_loads += 1
        st.prefetch_bytes += nbytes
        st.prefetch_wasted += not installed

    def evicted(self, layer: int, victim: int, by_prefetch: bool) -> None:
        if by_prefetch:
            self._evicted_ahead[layer].add(victim)
        if victim in self._unused_prefetch[layer]:
            self._unused_prefetch[layer].discard(victim)
            self.stats.layer(layer).prefetch_wasted += 1

    def installed(self, layer: int, expert: int, prefetched: bool) -> None:
        self._evicted_ahead[layer].discard(expert)
        if prefetched:
            self._unused_prefetch[layer].add(expert)

    def late(self, layer: int, n: int) -> None:
        """``n`` experts the pass needed were still being read as prefetches: it waited for them."""
        self.stats.layer(layer).late_prefetches += n

    def cancelled(self, n: int) -> None:
        """``n`` queued prefetches were cancelled before they were read."""
        self.stats.prefetch_dropped += n

    def stalled(self, seconds: float) -> None:
        self.stats.stall_s += seconds

    def reset(self) -> None:
        """Zero the counters and forget the predictions (resident experts stay what they are)."""
        self.stats.reset()
        self.predictions.clear()
        for kept in (*self._unused_prefetch.values(), *self._evicted_ahead.values()):
            kept.clear()
        if self.trace is not None:
            self.trace = {}


def _summed(mine, theirs, skip: str = "") -> dict:
    """Each counter field of two stats of one kind, added."""
    return {f.name: getattr(mine, f.name) + getattr(theirs, f.name) for f in fields(mine) if f.name != skip}
