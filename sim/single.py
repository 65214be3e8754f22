"""One cache on its own: meshd's eviction, the offline optimum and the field's yardsticks.

Owns the single-cache runs that put meshd's eviction beside known results:
- `che_hit_ratio`: Che's approximation of LRU's hit ratio under independent requests
  (the characteristic time T solves sum_i (1 - exp(-p_i T)) = C).
- `meshd_hit_ratio`: `meshd.decisions.cache.WeightedLRU` (LRU, GDSF or LRFU) over a request stream, as
  `LocalModels` drives it (a hit touches; a miss admits, evicting, and loads at once).
- `belady_hit_ratio`: Belady's MIN (evict the object requested furthest in the future);
  the offline optimum for objects of one size, a strong heuristic bound otherwise.
- `libcachesim_hit_ratios`: the same stream through libCacheSim's algorithms (PyPI
  `libcachesim`, optional): LRU, S3-FIFO, SIEVE, GDSF, ARC, LeCaR, CACHEUS, LHD, Belady.
- `oracle_hits`: a policy that knows every model's request probability at each moment (from
  the generator) but not the future: it holds the most probable models per unit that fit
  and loads a missed model only when it is among them or there is free room (issue 20's
  yardstick).
- `lfu_hits`: LFU with a perfect memory (every past request counted, none forgotten): the
  best a policy that learns popularity from the requests can do while popularity holds still.
Each `*_hits` gives a flag per request (1: a hit); `Outcome` turns flags into the hit ratio
and the load-seconds spent on misses.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from meshd.decisions.cache import Eviction, State, WeightedLRU
from meshd.decisions.regret import fleet_order
from sim.workloads import Epoch

# LFUDA is left out: libcachesim 0.3.5's LFUDA did not finish at 1 % capacity here.
LIBCACHESIM_ALGORITHMS = ("LRU", "S3FIFO", "Sieve", "GDSF", "ARC", "LeCaR", "Cacheus", "LHD", "Belady")
_NEVER = 1 << 62
_INT64_MAX = (1 << 63) - 1


def che_hit_ratio(popularity: Sequence[float], capacity: int) -> float:
    """LRU hit ratio by Che's approximation, for request probabilities `popularity` (unit sizes)."""
    if capacity >= len(popularity):
        return 1.0
    total = sum(popularity)
    p = [x / total for x in popularity]

    def filled(t: float) -> float:
        return sum(1.0 - math.exp(-x * t) for x in p)

    lo, hi = 0.0, 1.0
    while filled(hi) < capacity:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        if filled(mid) < capacity:
            lo = mid
        else:
            hi = mid
    t = (lo + hi) / 2
    return sum(x * (1.0 - math.exp(-x * t)) for x in p)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one cache did over the counted requests."""

    hit_ratio: float
    miss_load_s: float  # load-seconds spent on misses, per 1,000 counted requests
    misses: int

    @classmethod
    def of(cls, hits: bytearray, requests: Sequence[int], load_ms: Sequence[float], warmup: int = 0) -> Outcome:
        counted = len(requests) - warmup
        if counted <= 0:
            return cls(0.0, 0.0, 0)
        hit = sum(hits[warmup:])
        missed_ms = sum(load_ms[m] for m, h in zip(requests[warmup:], hits[warmup:], strict=True) if not h)
        return cls(hit / counted, missed_ms / counted, counted - hit)  # ms per request = s per 1,000


def _ratio(hits: bytearray, warmup: int) -> float:
    counted = len(hits) - warmup
    return sum(hits[warmup:]) / counted if counted > 0 else 0.0


def meshd_hits(
    requests: Sequence[int],
    units: Sequence[int],
    capacity_units: int,
    eviction: Eviction = Eviction.LRU,
    load_ms: Sequence[float] | None = None,
) -> bytearray:
    """meshd's cache over `requests` (model indexes), one request per ms: a hit touches, a
    miss admits (evicting) and loads at once, as `LocalModels` drives it. ADAPTIVE: a fleet of
    one, its records' eviction notes kept here, its order chosen after each eviction from its own
    tally (the daemon chooses at each publish)."""
    cache = WeightedLRU(capacity_units, eviction)
    names = [str(i) for i in range(len(units))]
    hits = bytearray(len(requests))
    regret = cache.regret
    notes: dict[str, tuple[int, float]] = {}
    for t, m in enumerate(requests, 1):
        mid = names[m]
        entry = cache.get(mid)
        if entry is not None and entry.state is State.LOADED:
            hits[t - 1] = 1
            cache.touch(mid, t)
        elif entry is None:
            admission = cache.admit(mid, units[m], t, t, evicted_by=notes.pop(mid, None) if regret else None)
            if not admission.admitted:
                continue
            cache.set_state(mid, State.LOADED, t, load_ms[m] if load_ms is not None else None)
            if regret is not None and admission.evicted:
                for victim in admission.evicted:
                    notes[victim.model_id] = (victim.evicted_by, victim.evicted_clock)
                cache.follow_order(fleet_order(regret, ()))
    return hits


def meshd_hit_ratio(
    requests: Sequence[int],
    units: Sequence[int],
    capacity_units: int,
    eviction: Eviction = Eviction.LRU,
    load_ms: Sequence[float] | None = None,
    warmup: int = 0,
) -> float:
    """Hit ratio of meshd's cache over `requests` after the first `warmup`."""
    return _ratio(meshd_hits(requests, units, capacity_units, eviction, load_ms), warmup)


def lfu_hits(
    requests: Sequence[int], units: Sequence[int], capacity_units: int, load_ms: Sequence[float] | None = None
) -> bytearray:
    """LFU with a perfect memory: every miss loads (evicting), and the victims are those with the
    fewest requests so far per unit (x load time per unit, with `load_ms`: meshd's value)."""
    counts = [0] * len(units)
    cost = [(load_ms[m] if load_ms is not None else 1.0) / units[m] for m in range(len(units))]
    cached: set[int] = set()
    heap: list[tuple[float, int, int]] = []  # (value, object, its count then), lazily invalidated
    used = 0
    hits = bytearray(len(requests))
    for i, m in enumerate(requests):
        counts[m] += 1
        if m in cached:
            hits[i] = 1
        elif units[m] <= capacity_units:
            while used + units[m] > capacity_units:
                _, victim, seen = heapq.heappop(heap)
                if victim in cached and counts[victim] == seen:
                    cached.discard(victim)
                    used -= units[victim]
            cached.add(m)
            used += units[m]
        else:
            continue
        heapq.heappush(heap, (counts[m] * cost[m], m, counts[m]))
    return hits


def oracle_hits(
    requests: Sequence[int],
    units: Sequence[int],
    capacity_units: int,
    popularity: Sequence[Epoch],
    load_ms: Sequence[float] | None = None,
) -> bytearray:
    """The popularity oracle: knows each model's request probability now (`popularity`, the
    generator's epochs), not the future. In each epoch it aims at the set a greedy knapsack
    picks: the most probable models per unit (x load time per unit, with `load_ms`) that fit,
    or the single most valuable model when that is worth more (the classic fix for a model as
    big as the cache). A miss in that set loads, evicting what is outside it (least valuable
    first); a miss outside it loads only into free room, and is the first to go."""
    if not popularity:
        raise ValueError("the popularity oracle needs the probabilities a synthetic workload was drawn from")
    n = len(units)
    cost = [(load_ms[m] if load_ms is not None else 1.0) / units[m] for m in range(n)]
    cached: set[int] = set()
    used = 0
    hits = bytearray(len(requests))
    ends = [epoch.start for epoch in popularity[1:]] + [len(requests)]
    for epoch, end in zip(popularity, ends, strict=True):
        density = [epoch.p(m) * cost[m] for m in range(n)]
        target = _knapsack(density, units, capacity_units)
        outside = [(density[m], m) for m in cached if m not in target]  # evicted first
        heapq.heapify(outside)
        for i in range(epoch.start, end):
            m = requests[i]
            if m in cached:
                hits[i] = 1
                continue
            if m in target:
                while used + units[m] > capacity_units:
                    victim = heapq.heappop(outside)[1]  # the target fits: what is outside makes room
                    cached.discard(victim)
                    used -= units[victim]
            elif used + units[m] <= capacity_units:
                heapq.heappush(outside, (density[m], m))
            else:
                continue
            cached.add(m)
            used += units[m]
    return hits


def _knapsack(density: Sequence[float], units: Sequence[int], capacity_units: int) -> set[int]:
    """Greedy by value per unit (skipping what no longer fits), or the single most valuable
    model when it is worth more than that set."""
    chosen: set[int] = set()
    room, worth = capacity_units, 0.0
    for m in sorted(range(len(units)), key=lambda x: -density[x]):
        if density[m] <= 0:
            break
        if units[m] <= room:
            chosen.add(m)
            room -= units[m]
            worth += density[m] * units[m]
    fits = [m for m in range(len(units)) if units[m] <= capacity_units]
    best = max(fits, key=lambda x: density[x] * units[x], default=None)
    if best is not None and density[best] * units[best] > worth:
        return {best}
    return chosen


def next_uses(requests: Sequence[int]) -> list[int]:
    """For each request, the index of the next request for the same object (_NEVER if none)."""
    out = [_NEVER] * len(requests)
    last: dict[int, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        out[i] = last.get(requests[i], _NEVER)
        last[requests[i]] = i
    return out


def belady_hit_ratio(requests: Sequence[int], units: Sequence[int], capacity_units: int, warmup: int = 0) -> float:
    """Belady's MIN's hit ratio after the first `warmup` requests."""
    return _ratio(belady_hits(requests, units, capacity_units), warmup)


def belady_hits(requests: Sequence[int], units: Sequence[int], capacity_units: int) -> bytearray:
    """Belady's MIN over `requests`: on a miss, evict the cached objects needed furthest ahead
    until the newcomer fits (objects bigger than the cache are never cached)."""
    nxt = next_uses(requests)
    cached: dict[int, int] = {}  # object -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, object), lazily invalidated
    used = 0
    hits = bytearray(len(requests))
    for i, m in enumerate(requests):
        if m in cached:
            hits[i] = 1
            cached[m] = nxt[i]
            heapq.heappush(heap, (-nxt[i], m))
        elif units[m] <= capacity_units and nxt[i] != _NEVER:  # never-again objects are not worth a slot
            while used + units[m] > capacity_units:
                neg, victim = heapq.heappop(heap)
                if cached.get(victim) == -neg:
                    del cached[victim]
                    used -= units[victim]
            cached[m] = nxt[i]
            used += units[m]
            heapq.heappush(heap, (-nxt[i], m))
    return hits


def libcachesim_hit_ratios(
    requests: Sequence[int],
    units: Sequence[int],
    capacity_units: int,
    algorithms: Sequence[str] = LIBCACHESIM_ALGORITHMS,
    warmup: int = 0,
) -> dict[str, float]:
    """Hit ratios of libCacheSim's algorithms after the first `warmup` requests."""
    return {k: _ratio(v, warmup) for k, v in libcachesim_hits(requests, units, capacity_units, algorithms).items()}


def libcachesim_hits(
    requests: Sequence[int],
    units: Sequence[int],
    capacity_units: int,
    algorithms: Sequence[str] = LIBCACHESIM_ALGORITHMS,
) -> dict[str, bytearray]:
    """libCacheSim's algorithms over the same stream (sizes in units): hit flags by name.

    Raises ImportError when `libcachesim` is not installed (`pip install libcachesim`)."""
    import libcachesim  # optional: a dev/benchmark dependency

    nxt = next_uses(requests)
    out: dict[str, bytearray] = {}
    for name in algorithms:
        cache = getattr(libcachesim, name)(capacity_units)
        hits = bytearray(len(requests))
        for i, m in enumerate(requests):
            nv = nxt[i] if nxt[i] != _NEVER else _INT64_MAX  # libCacheSim's "never again"
            req = libcachesim.Request(obj_size=units[m], obj_id=m + 1, clock_time=i, next_access_vtime=nv)
            hits[i] = bool(cache.get(req))
        out[name] = hits
    return out
