"""Instance record contents, publish cadence, request-rate meter and lease re-grant."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import pytest

from meshd.core.records import InstanceRecord
from meshd.decisions.cache import WeightedLRU
from meshd.decisions.publishing import Identity, instance_record
from meshd.kv.lease import LeaseKeeper
from meshd.kv.memory import MemoryStore
from meshd.kv.store import Delete
from meshd.kv.table import Table
from meshd.registry import instances
from meshd.registry.instances import InstancePublisher
from tests.lagging_store import LaggingStore

ME = Identity("i1", "10.0.0.1:8080", "z1", ("mt:demo",), 5)


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
    return [r.getMessage() for r in caplog.records if r.name == "meshd.registry.instances" and r.levelno == level]


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
