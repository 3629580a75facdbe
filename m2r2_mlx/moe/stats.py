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
    misses: int = 0  # experts loaded on demand while the forward pass waited
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
    stall_s: float = 0.0  # time the forward pass waited on the cache: loads, in-flight prefetches, copies into slots
    prefetch_dropped: int = 0  # requests the loader skipped because the pass had already gone past their layer
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
        for f in fields(self):
            if f.name != "layers":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        for l, theirs in other.layers.items():
            mine = self.layer(l)
            for f in fields(LayerStats):
                setattr(mine, f.name, getattr(mine, f.name) + getattr(theirs, f.name))

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
