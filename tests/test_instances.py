"""Instance record contents, publish cadence, request-rate meter and lease re-grant."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import pytest

from meshd import instances
from meshd.cache import State, WeightedLRU
from meshd.instances import (
    Identity,
    InstancePublisher,
    RpmMeter,
    Stored,
    instance_record,
    judge_stored,
    numeric_version,
    publish_due,
)
from meshd.kv.lease import LeaseKeeper
from meshd.kv.memory import MemoryStore
from meshd.kv.records import InstanceRecord
from meshd.kv.store import Delete
from meshd.kv.table import Table
from tests.lagging_store import LaggingStore

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


KEY = "instances/i1"


class Rig:
    """A publisher of a constant record on a lagging-capable MemoryStore, with its mirror.

    The publish clock (ms) and the store's lease clock (s) move only when the test says."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, ttl_s: int = 20) -> None:
        monkeypatch.setattr(instances, "PUBLISH_TICK_S", 0.01)
        self.now_s = 0.0
        self.store = LaggingStore(clock=lambda: self.now_s)
        self.mirror: Table[InstanceRecord] = Table(
            self.store, "instances/", InstanceRecord.decode, InstanceRecord.encode
        )
        self.builds = 0
        self.record = instance_record(ME, WeightedLRU(100), 2, 0, 0, False, 1000)
        self.publisher = InstancePublisher(
            self.store, KEY, self.build, ttl_s, clock=lambda: int(self.now_s * 1000), mirror=self.mirror
        )

    def build(self) -> InstanceRecord:
        self.builds += 1
        return self.record

    async def start(self) -> None:
        await self.mirror.start()
        await self.publisher.start()

    async def ticks(self, n: int) -> None:
        """Until the publisher has run `n` more ticks (each builds the record once)."""
        target = self.builds + n
        for _ in range(1000):
            if self.builds >= target:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the publisher stopped ticking")

    async def stored(self) -> InstanceRecord | None:
        kv = await self.store.get(KEY)
        return InstanceRecord.decode(kv.value) if kv is not None else None

    async def close(self) -> None:
        await self.publisher.stop()
        await self.mirror.stop()
        await self.store.close()


def warnings_about(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "meshd.instances" and r.levelno == level]


async def test_lagging_mirror_neither_writes_back_nor_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    rig = Rig(monkeypatch)
    await rig.mirror.start()
    rig.store.flowing.clear()  # the mirror never sees the first put while held
    await rig.publisher.start()
    try:
        rig.now_s += 10  # write-backs would be due by the cadence
        await rig.ticks(5)
        assert rig.store.puts == 1 and not warnings_about(caplog, logging.WARNING)
        rig.store.flowing.set()
        await rig.mirror.wait_for(rig.store.revision)
        rig.now_s += 10
        await rig.ticks(5)
        assert rig.store.puts == 1 and not warnings_about(caplog, logging.WARNING)
    finally:
        await rig.close()


async def test_deleted_record_is_written_back_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    rig = Rig(monkeypatch)
    await rig.start()
    try:
        await rig.store.txn([], [Delete(KEY)])  # behind meshd's back; the lease lives on
        await rig.mirror.wait_for(rig.store.revision)
        rig.now_s += 3
        for _ in range(500):
            if await rig.stored() is not None:
                break
            await rig.ticks(1)
        kv = await rig.store.get(KEY)
        assert kv is not None and kv.lease == rig.publisher.lease.lease_id
        assert InstanceRecord.decode(kv.value) == rig.record
        await rig.mirror.wait_for(rig.store.revision)
        rig.now_s += 3
        await rig.ticks(5)
        assert rig.store.puts == 2  # the first publish and one write-back
        assert warnings_about(caplog, logging.WARNING) == [f"instance record at {KEY} was deleted; writing it again"]
    finally:
        await rig.close()


async def test_record_of_another_process_with_the_same_id_is_reported_once_and_not_fought(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    rig = Rig(monkeypatch)
    await rig.start()
    try:
        other = replace(rig.record, start_time=ME.start_ms + 1, location="10.0.0.2:8080")
        await rig.store.put(KEY, other.encode())  # a second process started with our id
        await rig.mirror.wait_for(rig.store.revision)
        for _ in range(3):
            rig.now_s += 3
            await rig.ticks(5)
        assert rig.store.puts == 2 and await rig.stored() == other  # its put, none from us since
        errors = warnings_about(caplog, logging.ERROR)
        assert len(errors) == 1 and "another process" in errors[0] and "10.0.0.2:8080" in errors[0]
        assert not warnings_about(caplog, logging.WARNING)
    finally:
        await rig.close()


async def test_record_returns_only_after_the_rejoin_check(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch, ttl_s=1)
    checking, release = asyncio.Event(), asyncio.Event()
    seen_at_check: list[bool] = []

    async def check() -> None:
        checking.set()
        seen_at_check.append(await rig.stored() is not None)
        await release.wait()

    rig.publisher.before_rejoin = check
    await rig.start()
    first = rig.publisher.lease.lease_id
    try:
        rig.now_s += 10  # frozen past the TTL
        rig.store.expire_leases()
        assert await rig.stored() is None
        rig.now_s += 3  # the publisher's write-back cadence is due throughout
        await asyncio.wait_for(checking.wait(), 30)
        for _ in range(20):  # the publisher keeps ticking while the check runs
            await asyncio.sleep(0.02)
            assert await rig.stored() is None
        assert seen_at_check == [False] and rig.publisher.lease.lost
        release.set()
        for _ in range(1000):
            if await rig.stored() is not None:
                break
            await asyncio.sleep(0.01)
        kv = await rig.store.get(KEY)
        assert kv is not None and kv.lease == rig.publisher.lease.lease_id != first
        assert not rig.publisher.lease.lost
    finally:
        await rig.close()
