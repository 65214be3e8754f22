"""The instance record on a real etcd: published on a lease, gone on stop or death."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest

from meshd.kv.embedded import EmbeddedEtcd
from meshd.kv.etcd import EtcdStore
from meshd.kv.store import KeyValue
from meshd.testing.cluster import LocalMesh
from meshd.testing.procs import wait_until

from .conftest import NodeFactory

pytestmark = pytest.mark.slow


def read(etcd: EmbeddedEtcd, key: str) -> KeyValue | None:
    async def get() -> KeyValue | None:
        store = EtcdStore.from_url(etcd.url)
        try:
            return await store.get(key)
        finally:
            await store.close()

    return asyncio.run(get())


def test_record_published_on_a_lease_and_revoked_on_sigterm(
    start_node: NodeFactory, mesh: LocalMesh, etcd_server: EmbeddedEtcd
) -> None:
    c = start_node("inst-a", settings={"labels": "mt:demo,gpu", "zone": "z1"})
    key = f"/tas-runtime/{mesh.service}/instances/inst-a"
    wait_until(lambda: read(etcd_server, key) is not None, 15, "the record to be published")
    kv = read(etcd_server, key)
    assert kv is not None and kv.lease != 0
    rec = json.loads(kv.value)
    assert rec["loc"] == f"127.0.0.1:{c.node.peer_port}"
    assert rec["labels"] == ["mt:demo", "gpu"] and rec["zone"] == "z1"
    assert rec["cap"] == (8 << 20) // 8192 and rec["count"] == 0 and rec["shutdown"] is False
    c.node.meshd.stop(sig=signal.SIGTERM)
    assert read(etcd_server, key) is None  # revoked before exit, not after the TTL


def test_record_of_a_killed_instance_expires_with_its_lease(
    start_node: NodeFactory, mesh: LocalMesh, etcd_server: EmbeddedEtcd
) -> None:
    c = start_node("inst-b", settings={"instance_ttl_s": 2})
    key = f"/tas-runtime/{mesh.service}/instances/inst-b"
    # Published last in start-up, just after the gRPC port (what start_node waits for) opens.
    wait_until(lambda: read(etcd_server, key) is not None, 15, "the record to be published")
    c.node.meshd.kill()
    wait_until(lambda: read(etcd_server, key) is None, 15, "the lease to expire")
