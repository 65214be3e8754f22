"""One cache on its own: meshd's eviction, the offline optimum and the field's yardsticks.

Owns the single-cache runs that put meshd's eviction beside known results:
- `che_hit_ratio`: Che's approximation of LRU's hit ratio under independent requests
  (the characteristic time T solves sum_i (1 - exp(-p_i T)) = C).
- `meshd_hit_ratio`: `meshd.decisions.cache.WeightedLRU` (LRU, GDSF or LRFU) over a request stream, as
  `LocalModels` drives it (a hit touches; a miss admits, evicting, and loads at once).
- `belady_hit_ratio`: Belady's MIN (evict the object requested furthest in the future);
  the offline optimum for objects of one size, a strong heuristic bound otherwise.
- `libcachesim_hit_ratios`: the same stream through libCacheSim's algorithms (PyPI
  `libcachesim`, optional): LRU, S3-FIFO, SIEVE, GDSF, ARC, Belady.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from meshd.decisions.cache import Eviction, State, WeightedLRU

# LFUDA is left out: libcachesim 0.3.5's LFUDA did not finish at 1 % capacity here.
LIBCACHESIM_ALGORITHMS = ("LRU", "S3FIFO", "Sieve", "GDSF", "ARC", "Belady")
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


def meshd_hit_ratio(
    requests: Sequence[int],
    units: Sequence[int],
    capacity_units: int,
    eviction: Eviction = Eviction.LRU,
    load_ms: Sequence[float] | None = None,
    warmup: int = 0,
) -> float:
    """Hit ratio of meshd's cache over `requests` (model indexes), one request per ms."""
    cache = WeightedLRU(capacity_units, eviction)
    names = [str(i) for i in range(len(units))]
    hits = counted = 0
    for t, m in enumerate(requests, 1):
        mid = names[m]
        entry = cache.get(mid)
        hit = entry is not None and entry.state is State.LOADED
        if hit:
            cache.touch(mid, t)
        elif entry is None and cache.admit(mid, units[m], t, t).admitted:
            cache.set_state(mid, State.LOADED, t, load_ms[m] if load_ms is not None else None)
        if t > warmup:
            counted += 1
            hits += hit
    return hits / counted if counted else 0.0


def next_uses(requests: Sequence[int]) -> list[int]:
    """For each request, the index of the next request for the same object (_NEVER if none)."""
    out = [_NEVER] * len(requests)
    last: dict[int, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        out[i] = last.get(requests[i], _NEVER)
        last[requests[i]] = i
    return out


def belady_hit_ratio(requests: Sequence[int], units: Sequence[int], capacity_units: int, warmup: int = 0) -> float:
    """Belady's MIN over `requests`: on a miss, evict the cached objects needed furthest ahead
    until the newcomer fits (objects bigger than the cache are never cached)."""
    nxt = next_uses(requests)
    cached: dict[int, int] = {}  # object -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, object), lazily invalidated
    used = hits = counted = 0
    for i, m in enumerate(requests):
        hit = m in cached
        if hit:
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
        if i >= warmup:
            counted += 1
            hits += hit
    return hits / counted if counted else 0.0


def libcachesim_hit_ratios(
    requests: Sequence[int],
    units: Sequence[int],
    capacity_units: int,
    algorithms: Sequence[str] = LIBCACHESIM_ALGORITHMS,
    warmup: int = 0,
) -> dict[str, float]:
    """Hit ratios of libCacheSim's algorithms over the same stream (sizes in units).

    Raises ImportError when `libcachesim` is not installed (`pip install libcachesim`)."""
    import libcachesim  # optional: a dev/benchmark dependency

    nxt = next_uses(requests)
    out: dict[str, float] = {}
    for name in algorithms:
        cache = getattr(libcachesim, name)(capacity_units)
        hits = counted = 0
        for i, m in enumerate(requests):
            nv = nxt[i] if nxt[i] != _NEVER else _INT64_MAX  # libCacheSim's "never again"
            req = libcachesim.Request(obj_size=units[m], obj_id=m + 1, clock_time=i, next_access_vtime=nv)
            hit = bool(cache.get(req))
            if i >= warmup:
                counted += 1
                hits += hit
        out[name] = hits / counted if counted else 0.0
    return out
