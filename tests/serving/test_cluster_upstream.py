"""An upstream (Java) instance record in the registry: left out of the view, counted, logged once,
and its id never pruned from model records by the leader."""

from __future__ import annotations

import json
import logging

import pytest

from meshd.core.records import EMPTY_LRU_TIME, InstanceRecord
from meshd.kv.memory import MemoryStore
from meshd.kv.table import Table
from meshd.serving.cluster import Cluster
from meshd.serving.peers import Peers

JAVA = json.dumps({"lruTime": EMPTY_LRU_TIME, "cap": 100, "loc": "10.0.0.9", "startTime": 1}).encode()


async def test_upstream_instances_are_never_in_the_view(caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryStore()
    await store.put("/p/instances/java-1", JAVA)
    await store.put("/p/instances/me", InstanceRecord(capacity=100, location="127.0.0.1:1").encode())
    table = Table(store, "/p/instances/", InstanceRecord.decode, InstanceRecord.encode)
    await table.start()
    try:
        cluster = Cluster("me", table, Peers(1 << 20), lambda _type: 0, 1)
        with caplog.at_level(logging.ERROR):
            assert set(cluster.view().instances) == {"me"}
            await store.put("/p/instances/me", InstanceRecord(capacity=100, count=1, location="127.0.0.1:1").encode())
            assert set(cluster.view().instances) == {"me"}
        assert cluster.upstream_ids() == ["java-1"]
        assert sum("java-1" in r.getMessage() for r in caplog.records) == 1  # once
        # meshd never wrote it back.
        kv = await store.get("/p/instances/java-1")
        assert kv is not None and kv.value == JAVA
    finally:
        await table.stop()
        await store.close()
