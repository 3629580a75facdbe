"""When a prefetch pays: the expert loader's planner (the speculative engine's CostPlanner, decoding/planner.py, is
the model; both learn their rates with estimates.Rates).

A predictor names experts a later layer will need. Loading one ahead of time is worth, in units of one expert's
transfer ``t``:

    gain = p                   the probability the layer uses it, times the stall a hit saves (one transfer)
    cost = (1 - p) * u + q     the link time a wrong guess wastes (u: the link's measured busy share: an idle link
                               loses nothing to it) plus the reuse probability q of the expert it would evict: the
                               chance that the same visit uses it, which a load on demand would have kept (it
                               evicts only what the layer does not use), right guess or wrong

and a load is issued only where gain exceeds cost by ``margin``. ``p`` is calibrated online from the hits of past
predictions, scored whether loaded or not, per target layer, distance (MoE layers between the prediction and its
use), rank in the prediction and confidence (the router's probability over the uniform one); ``q`` is measured
from the routing history: per layer, how often the resident expert at each eviction rank was used at the next
visit. Both are Beta posteriors read at their means (the expected gain against the expected cost: a pessimistic
read would decline loads that pay, and a predictor that carries nothing is still calibrated near chance, after at
most a lucky early guess or two has loaded), with counts that decay each step, so estimates follow the text.

Eviction changes too: a prefetched expert evicts, in the policy's order, a resident expert that no pending
prediction names for that layer, never one the current token used there (nor, as always, one the layer computes
with now); where only named or current experts are left, the load is not made. So a prediction that carries
nothing (random experts) is calibrated near chance, loses to the reuse of what it would evict, and the cache runs
as on-demand LRU; a good one replaces exactly the experts the next step will not need. A load on demand must evict
something: never an expert a pending prediction names while an unnamed one is resident, and among named ones the
least likely (prediction-aware caching; the bench's Belady row is the on-demand optimum it is measured against).

Decisions are made for decode steps (one token); a prompt's experts load on demand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from ..estimates import Rates
from .governor import PredictorGovernor

if TYPE_CHECKING:
    from .cache import ExpertCache

DISTANCE_EDGES = (1, 2, 3, 6, 12)  # MoE layers ahead: 1, 2, 3, 4-6, 7-12, 13+
RELATIVE_EDGES = (1.0, 2.0, 4.0)  # router probability x experts: below uniform, up to 2x, 4x, above


def _bucket(value: float, edges: Sequence[float]) -> int:
    return next((i for i, e in enumerate(edges) if value <= e), len(edges))


@dataclass(frozen=True)
class PlannerConfig:
    margin: float = 0.05  # gain must beat cost by this much (in transfers): ties go to not loading
    prior: float = 0.25  # a prediction's hit rate before any is scored
    strength: float = 2.0  # prior pseudo-observations
    decay: float = 0.995  # per decode step: a count is worth half after ~140 steps
    min_util: float = 0.1  # the link's busy share is read as at least this
    util_smoothing: float = 0.1  # weight of the newest step in the link's busy share
    probe_every: int = 8  # a layer whose predictions never pay is still predicted every this many decode steps
    governed: bool = True  # the predictor runs only while its measured savings exceed its cost (governor.py)


class PrefetchPlanner:
    """Decides which predicted experts an ``ExpertCache`` loads ahead, and what they evict; see the module docstring.

    Passed to the cache it serves (``ExpertCache(..., planner=PrefetchPlanner())``), which binds it to itself."""

    def __init__(self, config: PlannerConfig = PlannerConfig()):
        self.config = config
        self.hits = Rates(
            config.prior, config.strength, config.decay
        )  # was a predicted expert used by its layer at its step
        self.reuse = Rates(
            config.prior, config.strength, config.decay
        )  # was the resident expert at an eviction rank used at the layer's next visit
        self.cache: ExpertCache | None = None
        self._pending: dict[tuple[int, int], list[tuple[int, tuple]]] = {}  # (step, layer) -> (expert, keys)
        self._used_now: dict[int, tuple[int, set[int]]] = {}  # layer -> (step, experts it used then)
        self._dist: dict[tuple[int, int], Sequence[float]] = {}  # (step, layer) -> predicted probability per expert
        self._util, self._clock = 1.0, None  # the link's busy share (pessimistic until measured)
        self.decisions = {"considered": 0, "loaded": 0}
        self.governor = PredictorGovernor() if config.governed else None  # does the predictor pay for its work

    def bind(self, cache: ExpertCache) -> None:
        """The cache this planner serves (called by the cache's constructor)."""
        if self.cache is not None:
            raise ValueError("a PrefetchPlanner serves one expert cache")
        self.cache = cache

    # -- what the cache tells it ------------------------------------------------------------------

    def observe(self, step: int, layer: int, needed: Sequence[int], tokens: int) -> None:
        """Layer ``layer`` of the forward pass at ``step`` uses ``needed``: score predictions, learn reuse."""
        cache, used = self.cache, set(needed)
        if layer == cache.layers[0] and tokens == 1:
            self._tick()
        elif tokens != 1 and self.governor is not None:
            self.governor.interrupt()
        for expert, keys in self._pending.pop((step, layer), ()):
            self.hits.observe(keys, expert in used)
        if tokens == 1 and (self.governor is None or self.governor.active):  # off: no loads ahead, no evictions
            named, dist = self._named(layer), self._dist.get((step, layer))
            for rank, e in enumerate(e for e in self._eviction_order(layer, dist) if e not in named):
                self.reuse.observe(self._reuse_keys(layer, rank, dist is not None), e in used)
        self._dist.pop((step, layer), None)
        self._used_now[layer] = (step, used)

    def _tick(self) -> None:
        """Once per decode step: counts decay (they stand still while the predictor is off), the reads' busy share
        is measured over the last step."""
        if self.governor is None or self.governor.active:
            self.hits.tick()
            self.reuse.tick()
        busy, now = self.cache.loader.busy_s, self.cache.clock.now()
        if self._clock is not None and now > self._clock[0]:
            share = (busy - self._clock[1]) / (now - self._clock[0])
            a = self.config.util_smoothing
            self._util = (1 - a) * self._util + a * min(max(share, 0.0), 1.0)
        self._clock = (now, busy)
        step = self.cache.step
        self._pending = {k: v for k, v in self._pending.items() if k[0] >= step}
        self._dist = {k: v for k, v in self._dist.items() if k[0] >= step}
        if self.governor is not None:
            self.governor.tick(self.cache)

    # -- decisions --------------------------------------------------------------------------------

    def select(self, layer: int, experts: Sequence[int], step: int, scores: Sequence[float] | None) -> list[int]:
        """Of ``experts`` (predicted for ``layer`` at ``step``, most likely first; ``scores`` the predictor's
        probability of every expert of the layer, if it has them), those whose load is expected to pay, most likely
        first. With scores, a prefetch evicts the resident expert the predictor finds least likely."""
        cache = self.cache
        if cache.tokens_now != 1 or step < cache.step:
            return []  # a prompt's pass loads on demand; a past step's prediction is of no use
        here_step, here = cache.position
        ahead = cache.ordinal(layer) - here + len(cache.layers) * (step - here_step)
        if ahead < 1 and step == here_step:
            return []
        n = cache.num_experts(layer)
        if scores is not None:
            self._dist[(step, layer)] = scores
        candidates = []
        for rank, e in enumerate(experts):
            if cache.is_resident(layer, e) or cache.in_flight(layer, e):
                continue
            rel = scores[e] * n if scores is not None else None
            keys = self._hit_keys(layer, ahead, rank, rel)
            # the best candidate of a layer also tells whether predicting the layer is worth its own work (wants)
            scored = keys if candidates else keys + (("top", layer), ("top",))
            self._pending.setdefault((step, layer), []).append((e, scored))
            candidates.append((self.hits.mean(keys), e))
        victims = self._victims(layer)
        chosen = []
        by_dist = self._pending_dist(layer) is not None
        for (p, e), (rank, _) in zip(sorted(candidates, key=lambda c: -c[0]), victims):
            self.decisions["considered"] += 1
            q = 0.0 if rank is None else self.reuse.mean(self._reuse_keys(layer, rank, by_dist))
            if p <= (1 - p) * max(self._util, self.config.min_util) + q + self.config.margin:
                break  # the rest are less likely, and would evict experts more likely to come back
            chosen.append(e)
        self.decisions["loaded"] += len(chosen)
        self.decisions["considered"] += max(0, len(candidates) - len(victims))
        return chosen

    def wants(self, layer: int) -> bool:
        """Whether a predictor should predict ``layer`` at this step (its own work costs time): not where even
        its best candidate would pay for a load on average (means, not the bounds loads are decided on: a layer is
        dropped only where its predictions clearly do not pay); every ``probe_every`` steps
        regardless, so the estimates keep up with the text. Nothing at all while the predictor's own work does
        not pay (the governor's measure; a prompt's pass never loads ahead)."""
        if self.governor is not None:
            if not self.governor.active or self.cache.tokens_now != 1:
                return False
            if self.governor.probing:
                return True  # the governor's probe measures every layer's predictions
        if self.cache.step % self.config.probe_every == 0 or self.cache.tokens_now != 1:
            return True
        p = self.hits.mean((("top", layer), ("top",)))
        # the victim's reuse under the ordering this layer's evictions have followed (the one with more history)
        keys = max((self._reuse_keys(layer, 0, d) for d in (False, True)), key=lambda k: self.reuse.counts[k[0]][1])
        q = self.reuse.mean(keys)
        return p > (1 - p) * self.config.min_util + q + self.config.margin

    def victim(self, layer: int, candidates: Sequence[int], demand: bool) -> int | None:
        """Which of ``candidates`` (resident, not needed by the layer computing now) a load into ``layer`` evicts:
        a prefetch spares what predictions name and what the current token used there (None: nothing to spare
        for it); a load on demand never evicts an expert a prediction names while an unnamed one is resident, and
        among named ones takes the least likely."""
        named = self._named(layer)
        if demand:  # must evict one: what no prediction names first, then the least likely of what they name
            order = [e for e in self._eviction_order(layer, self._pending_dist(layer)) if e in candidates]
            unnamed = [e for e in order if e not in named]
            return (unnamed or order)[0]
        spare = named | self._current(layer)
        order = [
            e for e in self._eviction_order(layer, self._pending_dist(layer)) if e in candidates and e not in spare
        ]
        return order[0] if order else None

    # -- helpers ----------------------------------------------------------------------------------

    def _hit_keys(self, layer: int, ahead: int, rank: int, rel: float | None) -> tuple:
        coarse = ("d", _bucket(ahead, DISTANCE_EDGES), min(rank, 4))
        mid = (*coarse, -1 if rel is None else _bucket(rel, RELATIVE_EDGES))
        return (("l", layer, *mid[1:]), mid, coarse)

    @staticmethod
    def _reuse_keys(layer: int, rank: int, by_dist: bool) -> tuple:
        return (("l", layer, by_dist, rank), ("r", by_dist, rank))

    def _eviction_order(self, layer: int, dist: Sequence[float] | None = None) -> list[int]:
        """Resident experts, the first to evict first: the least likely by the predictor's probabilities where it
        gave them (``dist``), else (and among ties) the policy's order."""
        key = self.cache.policies[layer].rank
        if dist is None:
            return sorted(self.cache.resident(layer), key=key)
        return sorted(self.cache.resident(layer), key=lambda e: (dist[e], key(e)))

    def _pending_dist(self, layer: int) -> Sequence[float] | None:
        """The predictor's probabilities for ``layer`` at the earliest step not yet computed there."""
        steps = [s for (s, l) in self._dist if l == layer and s >= self.cache.step]
        return self._dist[(min(steps), layer)] if steps else None

    def _named(self, layer: int) -> set[int]:
        """Experts that predictions for ``layer`` at this step or later name."""
        step = self.cache.step
        out: set[int] = set()
        for (s, l), experts in self.cache.predictions.items():
            if l == layer and s >= step:
                out |= experts
        return out

    def _current(self, layer: int) -> set[int]:
        step, used = self._used_now.get(layer, (None, set()))
        return used if step == self.cache.step else set()

    def _victims(self, layer: int) -> list[tuple[int | None, int | None]]:
        """(eviction rank, expert) of what successive loads into ``layer`` would evict: free slots first (rank
        None), then resident experts no prediction names and the current token did not use, in the policy's
        order (rank counted among the unnamed, as the reuse history counts it)."""
        cache = self.cache
        free = cache.slots_per_layer[layer] - len(cache.resident(layer)) - cache.pending_loads(layer)
        named, current = self._named(layer), self._current(layer)
        unnamed = [e for e in self._eviction_order(layer, self._pending_dist(layer)) if e not in named]
        out = [(None, None)] * max(free, 0) + [(rank, e) for rank, e in enumerate(unnamed) if e not in current]
        return out[max(-free, 0) :]  # loads already in flight take the first of them
