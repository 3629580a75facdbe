"""An expert cache's work over one decode, per token: loads, the time the forward pass stalled on them, and the
time the link was busy (on-demand loads and background prefetches, overlapped with compute or not)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertWork:
    tokens: int  # tokens through the first MoE layer (the prompt's included)
    loads: int  # experts over the link: on-demand loads and prefetches
    misses: int
    hits: int
    stall_s: float
    link_busy_s: float
    link_bytes: int

    def per_token(self) -> dict:
        n = max(self.tokens, 1)
        return {
            "tokens": self.tokens,
            "loads_per_token": self.loads / n,
            "stall_ms_per_token": 1e3 * self.stall_s / n,
            "link_busy_ms_per_token": 1e3 * self.link_busy_s / n,
            "mb_per_token": self.link_bytes / n / 1e6,
            "hit_rate": self.hits / max(self.hits + self.misses, 1),
        }


def begin(cache) -> tuple[float, int]:
    """Zero the cache's counters (its resident experts stay) and note the link's, which keep counting."""
    cache.reset()
    return cache.link.busy_s, cache.link.bytes


def work(cache, start: tuple[float, int]) -> ExpertWork:
    s = cache.stats
    return ExpertWork(
        s.tokens,
        s.misses + s.total("prefetch_loads"),
        s.misses,
        s.hits,
        s.stall_s,
        cache.link.busy_s - start[0],
        cache.link.bytes - start[1],
    )
