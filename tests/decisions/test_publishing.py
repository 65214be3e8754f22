"""Instance record contents, publish cadence, request-rate meter and lease re-grant."""

from __future__ import annotations

from dataclasses import replace

from meshd.core.records import VICTIM_VALUE, victim_reading
from meshd.decisions.cache import Eviction, State, WeightedLRU
from meshd.decisions.publishing import (
    Identity,
    RpmMeter,
    Stored,
    instance_record,
    judge_stored,
    numeric_version,
    publish_due,
)

ME = Identity("i1", "10.0.0.1:8080", "z1", ("mt:demo",), 5)


def record(cache: WeightedLRU, rpm: int = 0, now: int = 1000) -> object:
    return instance_record(ME, cache, 2, 0, rpm, False, now)


def test_record_reflects_the_cache() -> None:
    cache = WeightedLRU(100)
    cache.admit("a", 10, 300, 300)
    cache.set_state("a", State.LOADED, 300)
    cache.admit("b", 5, 400, 400)  # still loading: counted in used, not in count
    r = instance_record(ME, cache, 2, 1, 42, False, 1000)
    assert (r.count, r.capacity, r.used, r.lru_time, r.loading_threads, r.loading_in_progress, r.rpm) == (
        1,
        100,
        15,
        300,
        2,
        1,
        42,
    )
    assert (r.location, r.zone, r.labels, r.start_time) == ("10.0.0.1:8080", "z1", ["mt:demo"], 5)
    assert numeric_version("1.2.3") > numeric_version("1.1.9") > numeric_version("0.9")


def test_upstream_service_versions_number_as_upstream_does() -> None:
    # start.sh's SERVICE_VERSION forms: the date's epoch milliseconds plus the build number.
    assert numeric_version("modelmesh-20230512-7") == 1_683_849_600_000 + 7
    assert numeric_version("20170515-0930-2") == 1_494_840_600_000 + 2
    assert numeric_version("20170515-0930") == 1_494_840_600_000
    assert numeric_version("mm-20231301-1") == 0  # no 13th month: not upstream's form, nor dotted
    assert numeric_version("modelmesh-20240101-1") > numeric_version("modelmesh-20231231-9") > numeric_version("9.9.9")


def test_the_record_carries_the_configured_version() -> None:
    cache = WeightedLRU(100)
    newer = Identity("i2", "10.0.0.2:8080", "", (), 5, "2.0.0")
    older = Identity("i3", "10.0.0.3:8080", "", (), 5, "1.9.0")
    new, old = (instance_record(me, cache, 1, 0, 0, False, 6) for me in (newer, older))
    assert new.version > old.version


def test_publish_cadence() -> None:
    cache = WeightedLRU(100)
    first = instance_record(ME, cache, 2, 0, 0, False, 1000)
    assert publish_due(None, first, 0, 1000, False)
    cache.admit("a", 10, 1000, 1000)
    changed = instance_record(ME, cache, 2, 0, 0, False, 1500)
    assert not publish_due(first, changed, 1000, 1500, True)  # never closer than 2 s
    assert publish_due(first, changed, 1000, 3000, False)  # material change
    drift = instance_record(ME, WeightedLRU(100), 2, 0, 50, False, 3000)  # only rpm moved
    assert not publish_due(first, drift, 1000, 30_000, False)
    assert publish_due(first, drift, 1000, 41_000, False)  # ... until 40 s have passed
    assert publish_due(first, first, 1000, 3000, True)  # forced after a load


def test_stored_record_is_judged_only_once_the_mirror_has_the_last_put() -> None:
    mine = instance_record(ME, WeightedLRU(100), 2, 0, 0, False, 1000)
    assert judge_stored(mine, 10, 9, None) is Stored.LAGGING
    assert judge_stored(mine, 10, 10, mine) is Stored.OURS
    assert judge_stored(mine, 10, 12, None) is Stored.GONE
    assert judge_stored(mine, 10, 12, replace(mine, count=7)) is Stored.CHANGED
    assert judge_stored(mine, 10, 12, replace(mine, start_time=6)) is Stored.FOREIGN
    assert judge_stored(mine, 10, 12, replace(mine, location="10.0.0.2:8080")) is Stored.FOREIGN


def test_rpm_meter_counts_the_last_minute_without_extrapolating() -> None:
    m = RpmMeter()
    assert m.rpm(0, 0) == 0
    assert m.rpm(3, 1_000) == 3  # a burst right after start is not 180 rpm
    assert m.rpm(100, 30_000) == 100
    assert m.rpm(250, 61_000) == 247  # baseline moved to the sample a minute old (t=1 s)
    assert m.rpm(250, 200_000) == 0  # nothing in the last minute


def test_an_empty_instance_publishes_upstreams_lru_time() -> None:
    from meshd.core.records import EMPTY_LRU_TIME

    assert instance_record(ME, WeightedLRU(100), 2, 0, 0, False, 1000).lru_time == EMPTY_LRU_TIME


def test_the_record_carries_what_the_next_victim_is_worth_under_rate_and_lrfu_only() -> None:
    """`meshdVictim` (placement by price): log2 of the next victim's worth, decayed to the
    cache's clock; a drift like the LRU time, not a reason to publish; absent under LRU."""
    rate = WeightedLRU(20, Eviction.RATE)
    assert VICTIM_VALUE not in instance_record(ME, rate, 2, 0, 0, False, 1000).extra  # nothing loaded
    for model, uses in (("a", 1), ("b", 6)):
        rate.admit(model, 10, 1000, 1000)
        rate.set_state(model, State.LOADED, 1000, 100.0)
        for _ in range(uses - 1):
            rate.touch(model, 1001)
    cheap = instance_record(ME, rate, 2, 0, 0, False, 2000)
    assert cheap.extra[VICTIM_VALUE] == round(rate.victim_value() or 0.0, 3)
    rate.remove("a")  # the used one is next: it is worth more
    dear = instance_record(ME, rate, 2, 0, 0, False, 2000)
    assert dear.extra[VICTIM_VALUE] > cheap.extra[VICTIM_VALUE]
    drift = replace(cheap, extra={**cheap.extra, VICTIM_VALUE: 99.0})
    assert not publish_due(cheap, drift, 1000, 30_000, False)
    lru = WeightedLRU(20)
    lru.admit("a", 10, 1000, 1000)
    lru.set_state("a", State.LOADED, 1000, 100.0)
    assert lru.victim_value() is None and VICTIM_VALUE not in instance_record(ME, lru, 2, 0, 0, False, 2000).extra


def test_a_victim_value_that_is_not_a_number_reads_as_none() -> None:
    assert victim_reading({VICTIM_VALUE: 1.5}) == 1.5
    for bad in ("1.5", True, float("nan"), None, [1]):
        assert victim_reading({VICTIM_VALUE: bad}) is None


def test_the_adaptive_order_publishes_its_regret_tally_which_alone_does_not_make_a_publish_due() -> None:
    from meshd.core.records import REGRET, regret_reading

    assert REGRET not in instance_record(ME, WeightedLRU(4, Eviction.RATE), 2, 0, 0, False, 1000).extra
    cache = WeightedLRU(1, Eviction.ADAPTIVE)
    for n, t in (("a", 1), ("b", 2)):
        cache.admit(n, 1, t, t)
        cache.set_state(n, State.LOADED, t)
    first = instance_record(ME, cache, 2, 0, 0, False, 1000)
    assert regret_reading(first.extra) == (1.0, 0.0, 0.0, 0.0)  # one eviction, by RATE's order
    assert cache.regret is not None
    cache.regret.reloaded(0, 0.0)
    charged = instance_record(ME, cache, 2, 0, 0, False, 1000)
    assert regret_reading(charged.extra) == (1.0, 1.0, 0.0, 0.0)
    assert not publish_due(first, charged, 1000, 30_000, False)  # it drifts: the next publish carries it
