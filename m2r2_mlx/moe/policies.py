"""Which resident expert to evict when a layer's slots are full."""

from __future__ import annotations

from typing import Iterable

from ..errors import M2R2Error


class EvictionPolicy:
    """Keeps per-expert recency; subclasses choose the victim by their own key.

    ``used`` marks an expert a forward pass asked for; ``inserted`` an expert that was just
    loaded (a prefetch counts as recent, so the next miss does not evict it at once, but it
    is not a use).
    """

    name = ""

    def __init__(self) -> None:
        self._clock = 0
        self._last: dict[int, int] = {}

    def _tick(self, expert: int) -> None:
        self._clock += 1
        self._last[expert] = self._clock

    def used(self, expert: int) -> None:
        self._tick(expert)

    def inserted(self, expert: int) -> None:
        self._tick(expert)

    def victim(self, candidates: Iterable[int]) -> int:
        return min(candidates, key=self.rank)

    def rank(self, expert: int):
        """The expert's place in the eviction order: the least is evicted first."""
        raise NotImplementedError


class LRU(EvictionPolicy):
    """Evict the expert used (or loaded) longest ago."""

    name = "lru"

    def rank(self, expert: int):
        return self._last.get(expert, 0)


class LFU(EvictionPolicy):
    """Evict the expert used least often; ties go to the least recent.

    Counts survive eviction: an expert that is popular over the whole run keeps its count
    when a burst of other experts pushes it out, so it is not the first victim once back.
    """

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._count: dict[int, int] = {}

    def used(self, expert: int) -> None:
        super().used(expert)
        self._count[expert] = self._count.get(expert, 0) + 1

    def rank(self, expert: int):
        return self._count.get(expert, 0), self._last.get(expert, 0)


POLICIES = {cls.name: cls for cls in (LRU, LFU)}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name.lower()]()
    except KeyError:
        raise M2R2Error(f"unknown eviction policy {name!r}; choose one of: {', '.join(POLICIES)}") from None
