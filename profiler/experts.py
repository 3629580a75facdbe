"""An expert cache's work over one decode, per token: loads, the time the forward pass stalled on them, and the
time its reads from the disk were under way (on-demand loads and prefetches, overlapped with compute or not)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertWork:
    tokens: int  # tokens through the first MoE layer (the prompt's included)
    loads: int  # experts over the link: on-demand loads and prefetches
    misses: int
    hits: int
    stall_s: float
    read_busy_s: float
    read_bytes: int

    def per_token(self) -> dict:
        n = max(self.tokens, 1)
        return {
            "tokens": self.tokens,
            "loads_per_token": self.loads / n,
            "stall_ms_per_token": 1e3 * self.stall_s / n,
            "read_busy_ms_per_token": 1e3 * self.read_busy_s / n,
            "mb_per_token": self.read_bytes / n / 1e6,
            "hit_rate": self.hits / max(self.hits + self.misses, 1),
        }


def begin(cache) -> tuple[float, int]:
    """Zero the cache's counters (its resident experts stay) and note its loader's, which keep counting."""
    cache.reset()
    return cache.loader.busy_s, cache.loader.bytes


def work(cache, start: tuple[float, int]) -> ExpertWork:
    s = cache.stats
    return ExpertWork(
        s.tokens,
        s.misses + s.total("prefetch_loads"),
        s.misses,
        s.hits,
        s.stall_s,
        cache.loader.busy_s - start[0],
        cache.loader.bytes - start[1],
    )
