"""What tests watch a running mesh with, from outside it: its records in etcd as an outside
tool reads them (`EtcdView`), a check that takes an RPC error as "not yet" (`answers`), and
client threads that keep sending until the test's block ends (`ClientThreads`, which each
test's traffic fills in with what it sends and keeps). Synchronous, for test code that is
not in an event loop."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Self, TypeVar

import grpc

from meshd.kv.election import leader_of
from meshd.kv.etcd import EtcdStore

T = TypeVar("T")
A = TypeVar("A")


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


def answers(check: Callable[[], bool]) -> Callable[[], bool]:
    """`check`, with an RPC error read as "not yet" (an instance may still be reconnecting):
    for wait_until."""

    def run() -> bool:
        try:
            return check()
        except grpc.RpcError:
            return False

    return run


class ClientThreads(Generic[A]):
    """A thread per item of `each`, running `_run(item)` (the subclass's: what it sends and
    keeps), started when the `with` block begins and stopped when it ends: asked to stop,
    then joined for up to `join_s`. `_going()` is the loop's test: it waits `pace_s`, then
    says whether the block is still running."""

    def __init__(self, each: Sequence[A], *, pace_s: float = 0.0, join_s: float = 30.0, daemon: bool = False) -> None:
        self._stop = threading.Event()
        self._pace_s = pace_s
        self._join_s = join_s
        self._threads = [threading.Thread(target=self._run, args=(item,), daemon=daemon) for item in each]

    def _run(self, item: A) -> None:
        raise NotImplementedError

    def _going(self) -> bool:
        return not (self._stop.wait(self._pace_s) if self._pace_s else self._stop.is_set())

    def __enter__(self) -> Self:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self._join_s)
