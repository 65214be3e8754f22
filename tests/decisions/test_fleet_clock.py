"""The fleet's shared cache clock and the use histories that travel on it (issue 33), pure."""

from __future__ import annotations

from meshd.core.records import FLEET_CLOCK, FLEET_EVICTED, USE_HISTORY, InstanceRecord, fleet_reading, use_history
from meshd.decisions.cache import RATE_USES_KEPT, Eviction, State, WeightedLRU
from meshd.decisions.fleet_clock import FleetClock, peer_readings


def test_peers_evictions_advance_the_clock_per_instance_from_the_second_sight_on() -> None:
    clock = FleetClock()
    first = clock.step({"b": (500, 40.0), "c": (100, 38.0)})
    assert (first.fleet_size, first.advance, first.floor) == (3, 0.0, 40.0)  # joins at the peers' clock
    second = clock.step({"b": (530, 41.0), "c": (130, 39.0)})
    assert (second.advance, second.floor) == (20.0, 0.0)  # 60 units over 3 instances; joined once
    restarted = clock.step({"b": (560, 50.0), "c": (9, 0.0)})  # c restarted: its 9 units are new
    assert restarted.advance == (30 + 9) / 3
    newcomer = clock.step({"b": (560, 50.0), "c": (9, 0.0), "d": (700, 0.0)})
    assert (newcomer.fleet_size, newcomer.advance) == (4, 0.0)  # d's past is not new to the fleet
    assert FleetClock().step({}).fleet_size == 1  # alone: the cache's own turnover
    wild = FleetClock().step({"b": (5, 40.0), "c": (5, 41.0), "d": (5, 1e300)})
    assert wild.floor == 41.0  # one wild record does not throw a joining clock ahead


def test_a_cache_in_a_fleet_counts_its_own_evictions_per_instance_and_never_runs_back() -> None:
    cache = WeightedLRU(2, Eviction.RATE)
    cache.follow_fleet(4, 0.0, floor=100.0)
    assert cache.clock == 100.0
    for n, t in (("a", 1), ("b", 2), ("c", 3)):
        assert cache.admit(n, 1, t, t).admitted
        cache.set_state(n, State.LOADED, t)
    assert cache.clock == 100.25 and cache.evicted_units == 1  # "a" evicted: 1 unit over 4 instances
    cache.follow_fleet(4, 2.0, floor=50.0)  # a lower floor does not move it back
    assert cache.clock == 102.25


def test_a_model_resumes_its_use_history_from_its_record_on_another_instance() -> None:
    """Evicted on one instance, loaded on another: it starts from the uses its record carries,
    not as a stranger, so it is not the first to go again."""
    a = WeightedLRU(1, Eviction.RATE)
    assert a.admit("m", 1, 1, 1).admitted
    a.set_state("m", State.LOADED, 1)
    for t in range(2, 6):
        a.touch("m", t)
    evicted = a.admit("x", 1, 10, 10).evicted
    history = evicted[0].uses_at
    assert len(history) == 5
    b = WeightedLRU(2, Eviction.RATE)
    b.follow_fleet(2, 0.0, floor=a.clock)
    for n, t in (("stranger", 20), ("m", 21)):
        assert b.admit(n, 1, t, t, history=history if n == "m" else ()).admitted
        b.set_state(n, State.LOADED, t)
    m = b.get("m")
    assert m is not None and m.uses_at[:5] == history and len(m.uses_at) == 6
    assert [e.model_id for e in b.admit("new", 1, 30, 30).evicted] == ["stranger"]
    # Without the history it would have been a stranger too, and the older one goes first.
    c = WeightedLRU(2, Eviction.RATE)
    for n, t in (("stranger", 20), ("m", 21)):
        assert c.admit(n, 1, t, t).admitted
        c.set_state(n, State.LOADED, t)
    assert len(c.get("m").uses_at) == 1  # type: ignore[union-attr]


def test_the_newer_of_a_ghost_and_a_record_history_counts_and_future_uses_count_as_now() -> None:
    cache = WeightedLRU(1, Eviction.RATE)
    cache.follow_fleet(2, 0.0, floor=10.0)
    assert cache.admit("m", 1, 1, 1).admitted
    cache.set_state("m", State.LOADED, 1)
    assert cache.admit("x", 1, 2, 2).admitted  # m's ghost: one use at clock 10; the clock 10.5
    cache.set_state("x", State.LOADED, 2)
    assert cache.admit("m", 1, 3, 3, history=(1.0, 2.0)).admitted  # an older history: the ghost wins
    assert cache.get("m").uses_at == (10.0, 11.0)  # type: ignore[union-attr]
    other = WeightedLRU(1, Eviction.RATE)
    other.admit("m", 1, 3, 3, history=(1.0, 2.0, 99.0))  # a peer's clock a little ahead
    assert other.get("m").uses_at == (0.0, 0.0, 0.0, 0.0)  # type: ignore[union-attr]
    assert len(other.get("m").uses_at) <= RATE_USES_KEPT  # type: ignore[union-attr]


def test_records_carry_the_clock_and_histories_and_shrug_off_bad_values() -> None:
    assert fleet_reading({FLEET_EVICTED: 512, FLEET_CLOCK: 40.5}) == (512, 40.5)
    assert fleet_reading({FLEET_EVICTED: "many", FLEET_CLOCK: True}) == (0, 0.0)
    assert fleet_reading({}) == (0, 0.0)
    assert use_history({USE_HISTORY: [1, 2.5, 3]}) == (1.0, 2.5, 3.0)
    for bad in ("1,2", [3, 1], [1, "x"], [True], list(range(9)), [float("inf")]):
        assert use_history({USE_HISTORY: bad}) == (), bad
    upstream = InstanceRecord(shutdown=True)
    upstream.upstream = True
    mine = InstanceRecord(extra={FLEET_EVICTED: 8, FLEET_CLOCK: 2.0})
    peers = peer_readings([("me", mine), ("b", mine), ("java", upstream)], "me")
    assert peers == {"b": (8, 2.0)}  # upstream instances keep no fleet clock
