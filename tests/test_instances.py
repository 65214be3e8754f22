"""Instance record contents, publish cadence, request-rate meter and lease re-grant."""

from __future__ import annotations

import asyncio

from meshd.cache import State, WeightedLRU
from meshd.instances import Identity, RpmMeter, instance_record, numeric_version, publish_due
from meshd.kv.lease import LeaseKeeper
from meshd.kv.memory import MemoryStore

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


def test_rpm_meter_counts_the_last_minute_without_extrapolating() -> None:
    m = RpmMeter()
    assert m.rpm(0, 0) == 0
    assert m.rpm(3, 1_000) == 3  # a burst right after start is not 180 rpm
    assert m.rpm(100, 30_000) == 100
    assert m.rpm(250, 61_000) == 247  # baseline moved to the sample a minute old (t=1 s)
    assert m.rpm(250, 200_000) == 0  # nothing in the last minute


async def test_lease_keeper_regrants_and_reattaches_after_expiry() -> None:
    now = [0.0]
    store = MemoryStore(clock=lambda: now[0])
    regranted: list[int] = []

    async def reattach(lease_id: int) -> None:
        regranted.append(lease_id)
        await store.put("me", b"back", lease=lease_id)

    keeper = LeaseKeeper(store, 1, on_new_lease=reattach)
    first = await keeper.start()
    await store.put("me", b"1", lease=first)
    now[0] += 10  # the process "froze" past its TTL
    store.expire_leases()
    assert await store.get("me") is None
    for _ in range(50):
        if regranted:
            break
        await asyncio.sleep(0.05)
    assert regranted and regranted[0] != first and keeper.lease_id == regranted[0]
    kv = await store.get("me")
    assert kv is not None and kv.value == b"back" and kv.lease == keeper.lease_id
    await keeper.stop(revoke=True)
    assert await store.get("me") is None
    await store.close()
