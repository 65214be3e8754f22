"""What tests watch a running mesh with, from outside it: its records in etcd as an outside
tool reads them (`EtcdView`). Synchronous, for test code that is not in an event loop."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from meshd.kv.election import leader_of
from meshd.kv.etcd import EtcdStore

T = TypeVar("T")


@dataclass(frozen=True)
class EtcdView:
    """One mesh's keys (`prefix`, e.g. /tas-runtime/<service>) in the etcd at `url`, each read
    on a store of its own, opened and closed around it (a test may stop etcd in between).
    `timeout_s`: the store's per-call timeout; None, EtcdStore's default."""

    url: str
    prefix: str
    timeout_s: float | None = None

    def _open(self) -> EtcdStore:
        if self.timeout_s is None:
            return EtcdStore.from_url(self.url)
        return EtcdStore.from_url(self.url, timeout_s=self.timeout_s)

    def call(self, fn: Callable[[EtcdStore], Awaitable[T]]) -> T:
        """`fn` on a store of its own, from synchronous code."""

        async def run() -> T:
            store = self._open()
            try:
                return await fn(store)
            finally:
                await store.close()

        return asyncio.run(run())

    def records(self, kind: str) -> dict[str, dict[str, Any]]:
        """Every record under `<prefix>/<kind>/`, decoded, by the rest of its key."""
        base = f"{self.prefix}/{kind}/"

        async def read(store: EtcdStore) -> dict[str, dict[str, Any]]:
            kvs, _ = await store.range_prefix(base)
            return {kv.key[len(base) :]: json.loads(kv.value) for kv in kvs}

        return self.call(read)

    def leader(self) -> str | None:
        """The instance holding the leader latch, as etcd has it."""
        base = f"{self.prefix}/leaderLatch/"

        async def read(store: EtcdStore) -> str | None:
            kvs, _ = await store.range_prefix(base)
            return leader_of(kvs, base)

        return self.call(read)
