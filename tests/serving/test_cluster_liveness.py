"""A peer the data path finds unreachable: etcd's word on its lease (a real etcd) tells a dead
or frozen one (lapsed: its copies stop counting toward max copies) from one cut off from this
instance only (alive: its copies still count, so a capped model is not loaded twice)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from meshd.core.records import InstanceRecord
from meshd.decisions.placement.liveness import counted_for_max_copies
from meshd.kv.etcd import EtcdStore
from meshd.kv.lease import LeaseKeeper
from meshd.kv.store import KVStore
from meshd.kv.table import Table
from meshd.serving.cluster import Cluster
from meshd.serving.peers import Peers
from meshd.testing.etcd import EmbeddedEtcd

TTL_S = 2  # etcd's least; a live owner renews every 0.67 s
SETTLE_S = 8.0  # far more than a verdict takes (a few renewal periods)


@pytest.fixture
async def store(etcd_server: EmbeddedEtcd) -> AsyncIterator[KVStore]:
    s = EtcdStore.from_url(etcd_server.url)
    try:
        yield s
    finally:
        await s.close()


async def _cluster(store: KVStore, prefix: str) -> tuple[Cluster, Table[InstanceRecord]]:
    await store.put(f"{prefix}instances/me", InstanceRecord(capacity=100, location="127.0.0.1:1").encode())
    table = Table(store, f"{prefix}instances/", InstanceRecord.decode, InstanceRecord.encode)
    await table.start()
    return Cluster("me", table, Peers(1 << 20), lambda _type: 0, 1), table


async def _peer(store: KVStore, prefix: str, lease: int) -> None:
    record = InstanceRecord(capacity=100, location="127.0.0.1:2")
    await store.put(f"{prefix}instances/peer", record.encode(), lease=lease)


async def test_a_peer_renewing_its_lease_is_cut_off_not_gone(store: KVStore, etcd_prefix: str) -> None:
    keeper = LeaseKeeper(store, TTL_S)
    await _peer(store, etcd_prefix, await keeper.start())
    cluster, table = await _cluster(store, etcd_prefix)
    try:
        await table.wait_for((await store.range_prefix(etcd_prefix))[1])
        cluster.note_unreachable("peer")
        assert await cluster.settle(["peer"], SETTLE_S)
        assert not cluster.probing(["peer"])  # a verdict came, not the timeout
        view = cluster.view()
        assert "peer" in view.unreachable and "peer" not in view.lapsed
        assert "peer" in counted_for_max_copies(view)
    finally:
        await cluster.close()
        await table.stop()
        await keeper.stop()


async def test_a_peer_that_stopped_renewing_its_lease_lapses(store: KVStore, etcd_prefix: str) -> None:
    lease = await store.grant_lease(30)  # nobody renews it: a frozen owner, long TTL
    await _peer(store, etcd_prefix, lease)
    cluster, table = await _cluster(store, etcd_prefix)
    try:
        await table.wait_for((await store.range_prefix(etcd_prefix))[1])
        cluster.note_unreachable("peer")
        # Not at once: it may have renewed just before it froze.
        assert "peer" not in cluster.view().lapsed
        assert await cluster.settle(["peer"], SETTLE_S)
        view = cluster.view()
        assert "peer" in view.lapsed and "peer" not in counted_for_max_copies(view)
        assert "peer" in view.instances  # its record is still there: only the lease tells
    finally:
        await cluster.close()
        await table.stop()
        await store.revoke_lease(lease)


async def test_a_peer_whose_lease_is_gone_lapses_at_once(store: KVStore, etcd_prefix: str) -> None:
    lease = await store.grant_lease(30)
    await _peer(store, etcd_prefix, lease)
    cluster, table = await _cluster(store, etcd_prefix)
    try:
        await table.wait_for((await store.range_prefix(etcd_prefix))[1])
        await store.revoke_lease(lease)  # the mirror may still show the record
        cluster.note_unreachable("peer")
        assert await cluster.settle(["peer"], 2.0)
        assert not cluster.probing(["peer"])
        assert "peer" in cluster.view().lapsed
        assert not await cluster.settle(["peer"], 1.0)  # nothing left to wait for
    finally:
        await cluster.close()
        await table.stop()
