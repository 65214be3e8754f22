"""The cache's eviction order (kept in a heap; CAPPED's by a scan) agrees with sorting every
entry by its order's definition, whatever happens."""

from __future__ import annotations

import math
import random
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshd.decisions.cache as cache_module
from meshd.decisions.cache import (
    DEFAULT_LOAD_MS_PER_UNIT,
    LRFU_HALF_LIFE_TURNOVERS,
    RATE_HALF_LIFE_TURNOVERS,
    RATE_HOLD_TURNOVERS,
    RATE_PRIOR_TURNOVERS,
    RATE_USES_KEPT,
    CacheEntry,
    Eviction,
    State,
    WeightedLRU,
    use_rate,
)

OP_NAMES = [
    "admit",
    "touch",
    "bulk",
    "load",
    "load_even",
    "resize",
    "remove",
    "busy",
    "idle",
    "fail",
    "follow",
    "fleet",
]
ops = st.lists(
    st.tuples(
        st.sampled_from(OP_NAMES),
        st.integers(0, 7),  # model
        st.integers(1, 5),  # units / time step
    ),
    max_size=300,  # long enough for the heap to drop its stale items several times
)


def sorted_plan(
    cache: WeightedLRU, needed: int, exclude: str, newer_than: int | None, weight: float | None = None
) -> list[str] | None:
    """The specification: sort all evictable entries by (serving, key, admission order);
    `weight`: ADAPTIVE's order for this plan (None: the one it follows)."""
    if needed <= 0:
        return []
    cands = [e for e in cache.entries() if e.state is not State.LOADING and e.model_id != exclude]
    cands.sort(key=lambda e: (e.inflight > 0, spec_key(cache, e, weight), e.seq))
    out: list[str] = []
    freed = 0
    for e in cands:
        if freed >= needed:
            break
        if newer_than is not None and e.last_used_ms > newer_than:
            continue
        out.append(e.model_id)
        freed += e.units
    return out if freed >= needed else None


def spec_key(cache: WeightedLRU, e: CacheEntry, weight: float | None = None) -> tuple[float, ...]:
    """Each order's key as its docs define it (LRFU: log of the decayed uses x cost per unit;
    RATE: log of the rate x cost per unit, decayed since the last use; ADAPTIVE: RATE's, or the
    clock of the last use alone)."""
    if cache.eviction is Eviction.GDSF:
        return (e.priority, e.last_used_ms)
    if cache.eviction is Eviction.CAPPED:  # RATE's value now x the odds its rate still holds
        cost = e.load_ms / e.units if e.load_ms > 0 else DEFAULT_LOAD_MS_PER_UNIT
        half_life = RATE_HALF_LIFE_TURNOVERS * cache.capacity_units
        rate = use_rate(e.uses_at, RATE_PRIOR_TURNOVERS * cache.capacity_units)
        log_value = math.log2(rate * cost) + (e.clock - cache.clock) / half_life
        silence = cache.clock - e.clock
        if silence > 0:  # P(holds) = 1 / (1 + h g e^(r g)), in logs (e^(r g) overflows)
            ended = math.log(silence / (RATE_HOLD_TURNOVERS * cache.capacity_units)) + rate * silence
            log_value -= (max(ended, 0.0) + math.log1p(math.exp(-abs(ended)))) / math.log(2)
        return (log_value, e.last_used_ms)
    if cache.eviction in (Eviction.LRFU, Eviction.RATE, Eviction.ADAPTIVE):
        cost = e.load_ms / e.units if e.load_ms > 0 else DEFAULT_LOAD_MS_PER_UNIT
        if cache.eviction is Eviction.LRFU:
            score, half_life = e.score, LRFU_HALF_LIFE_TURNOVERS * cache.capacity_units
        else:  # the rate from the clocks of the last uses, recomputed here
            assert 1 <= len(e.uses_at) <= RATE_USES_KEPT and e.uses_at[-1] == e.clock
            score = use_rate(e.uses_at, RATE_PRIOR_TURNOVERS * cache.capacity_units)
            half_life = RATE_HALF_LIFE_TURNOVERS * cache.capacity_units
        # ADAPTIVE: RATE's, or recency on the same clock alone while it follows recency
        if weight is None:
            weight = cache.frequency_weight if cache.eviction is Eviction.ADAPTIVE else 1.0
        return (weight * math.log2(score * cost) + e.clock / half_life, e.last_used_ms)
    return (e.last_used_ms,)


@settings(max_examples=300, deadline=None)
@given(ops=ops, eviction=st.sampled_from(list(Eviction)), capacity=st.integers(4, 16), rebase_often=st.booleans())
def test_heap_order_matches_a_full_sort(
    ops: list[tuple[str, int, int]], eviction: Eviction, capacity: int, rebase_often: bool
) -> None:
    """`rebase_often`: LRFU restarts its clock after every half-life (rebuilding the heap)."""
    limit = 1 if rebase_often else cache_module._LRFU_REBASE
    with mock.patch.object(cache_module, "_LRFU_REBASE", limit):
        run_ops(ops, eviction, capacity)


@pytest.mark.parametrize("eviction", list(Eviction), ids=[e.value for e in Eviction])
def test_heap_order_matches_a_full_sort_over_long_seeded_runs(eviction: Eviction) -> None:
    """Hypothesis favours short runs; the counting orders differ most after many evictions."""
    for seed in range(40):
        rng = random.Random(seed)
        ops = [(rng.choice(OP_NAMES), rng.randint(0, 7), rng.randint(1, 5)) for _ in range(300)]
        run_ops(ops, eviction, rng.randint(4, 16))


def run_ops(ops: list[tuple[str, int, int]], eviction: Eviction, capacity: int) -> None:
    cache = WeightedLRU(capacity, eviction)
    if cache.regret is not None:  # explore often, so the other order's plans are checked too
        cache.regret.explore_every = 7
    now = 1000
    for op, m, n in ops:
        now += n
        mid = f"m{m}"
        entry = cache.get(mid)
        if op == "admit":
            for used in (now, now - 50):  # a request, and a placement dated in the past
                fits = mid not in cache and n <= capacity
                needed = n - cache.free_units
                weight = None  # ADAPTIVE: an admission that explores evicts by the other order
                if cache.regret is not None and needed > 0 and cache.regret.explores_next():
                    weight = 1.0 - cache.frequency_weight
                expected = sorted_plan(cache, needed, mid, used, weight) if fits else None
                adm = cache.admit(mid, n, used, now)
                if expected is not None:
                    assert adm.admitted and [e.model_id for e in adm.evicted] == expected
                elif fits:
                    assert not adm.admitted
                if adm.admitted:
                    break
        elif op == "touch":
            cache.touch(mid, now)
        elif op == "bulk":  # counts in bulk (the native data plane's), more than RATE keeps at times
            cache.touch(mid, now, uses=2 * n)
        elif op == "load" and entry is not None:
            cache.set_state(mid, State.LOADED, now, float(n * 100))
        elif op == "load_even" and entry is not None:  # one cost per unit for all: uses decide
            cache.set_state(mid, State.LOADED, now, 100.0 * entry.units)
        elif op == "resize" and entry is not None:
            old_units = entry.units  # read before: resize changes the entry
            needed = cache.used_units + n - old_units - capacity
            expected = sorted_plan(cache, needed, mid, None) or []  # none that covers it: run over
            assert [e.model_id for e in cache.resize(mid, n)] == (expected if n != old_units else [])
        elif op == "remove":
            cache.remove(mid)
        elif op == "busy" and entry is not None:
            entry.inflight += 1
        elif op == "idle" and entry is not None and entry.inflight:
            entry.inflight -= 1
        elif op == "fail" and entry is not None:
            cache.set_state(mid, State.FAILED, now)
        elif op == "follow" and cache.regret is not None:  # ADAPTIVE: the fleet's regret moves it
            cache.follow_order(n % 2)
        elif op == "fleet":  # peers evicted: the clock moves with no eviction here (CAPPED's order moves)
            cache.follow_fleet(2, n / 2)
        assert cache.used_units == sum(e.units for e in cache.entries())
        assert cache.loaded_summary(now) == scanned_summary(cache, now)


def scanned_summary(cache: WeightedLRU, now: int) -> tuple[int, int]:
    """The specification of `loaded_summary`: count the loaded entries, and the last use of
    the first of them in eviction order (now when none)."""
    loaded = [e for e in cache.entries() if e.state is State.LOADED]
    if not loaded:
        return 0, now
    first = min(loaded, key=lambda e: (spec_key(cache, e), e.seq))
    return len(loaded), first.last_used_ms
