"""A store of each kind for tests that must hold on both: in-process and real etcd."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from meshd.kv.embedded import EmbeddedEtcd
from meshd.kv.etcd import EtcdStore
from meshd.kv.memory import MemoryStore
from meshd.kv.store import KVStore


@pytest.fixture(params=["memory", "etcd"])
async def any_store(request: pytest.FixtureRequest) -> AsyncIterator[KVStore]:
    # Only the etcd parameter pulls in the session etcd, so memory-only runs need none.
    s: KVStore
    if request.param == "etcd":
        server: EmbeddedEtcd = request.getfixturevalue("etcd_server")
        s = EtcdStore.from_url(server.url)
    else:
        s = MemoryStore()
    try:
        yield s
    finally:
        await s.close()
