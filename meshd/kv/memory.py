"""`MemoryStore`: an in-process `KVStore` with etcd's semantics, for unit tests and the simulator.

It owns a global revision, per-key mod/create revisions, compare-and-set transactions,
leases whose TTL runs on an injectable clock, and a full event history that prefix
watches replay from any uncompacted revision.

Nothing runs in the background: expired leases are reaped lazily at the start of every
operation and whenever the owner calls `expire_leases()` (the simulator does, after
advancing its clock). Reaping a lease deletes its keys in one revision and the deletes
reach watchers like any other change.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from meshd.kv.store import (
    Compacted,
    Compare,
    Event,
    KeyValue,
    LeaseExpired,
    LeaseTTL,
    Op,
    Put,
    StoreError,
    StoreUnavailable,
    TxnResult,
)

# etcd's revision counter starts at 1 on a fresh cluster; the first write makes it 2.
_INITIAL_REVISION = 1
# Lease ids are opaque; a recognizable base keeps them distinct from revisions in logs.
_FIRST_LEASE_ID = 0x7E57_0000


@dataclass(slots=True)
class _Lease:
    id: int
    ttl_s: int
    deadline: float
    keys: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class _Record:
    """Every change of one revision, unfiltered; watchers filter by prefix."""

    revision: int
    events: tuple[Event, ...]


class MemoryStore:
    """In-process KVStore; every method is atomic because none awaits mid-change."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._revision = _INITIAL_REVISION
        self._compacted = 0  # history before this revision is gone
        self._data: dict[str, KeyValue] = {}
        self._leases: dict[int, _Lease] = {}
        self._next_lease_id = _FIRST_LEASE_ID
        self._history: list[_Record] = []
        self._wakers: set[asyncio.Event] = set()
        self._closed = False

    # -- introspection for tests and the simulator ------------------------------------

    @property
    def revision(self) -> int:
        return self._revision

    @property
    def compacted_revision(self) -> int:
        return self._compacted

    # -- KVStore ---------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        self._begin()
        return self._data.get(key)

    async def range_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        self._begin()
        kvs = sorted((kv for k, kv in self._data.items() if k.startswith(prefix)), key=lambda kv: kv.key)
        return kvs, self._revision

    async def range_page(
        self, prefix: str, after: str | None, limit: int, revision: int
    ) -> tuple[list[KeyValue], int, bool]:
        self._begin()
        if revision and revision != self._revision:
            raise Compacted(self._revision)  # no history kept: a past revision is gone
        kvs = sorted(
            (kv for k, kv in self._data.items() if k.startswith(prefix) and (after is None or k > after)),
            key=lambda kv: kv.key,
        )
        return kvs[:limit], self._revision, len(kvs) > limit

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        self._begin()
        self._check_leases([Put(key, value, lease)])
        self._commit([self._apply_put(Put(key, value, lease), self._revision + 1)])
        return self._revision

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Op]) -> TxnResult:
        self._begin()
        keys = [op.key for op in ops]
        if len(set(keys)) != len(keys):
            # etcd rejects a txn that touches one key twice; match it so both stores agree.
            raise StoreError("duplicate key given in txn request")
        if not all(self._mod_revision(c.key) == c.mod_revision for c in compares):
            return TxnResult(succeeded=False, revision=self._revision)
        self._check_leases(ops)
        rev = self._revision + 1
        events: list[Event] = []
        for op in ops:
            if isinstance(op, Put):
                events.append(self._apply_put(op, rev))
            else:
                ev = self._apply_delete(op.key, rev)
                if ev is not None:
                    events.append(ev)
        # Like etcd, a txn that changes nothing (only deletes of absent keys) keeps the revision.
        self._commit(events)
        return TxnResult(succeeded=True, revision=self._revision)

    async def grant_lease(self, ttl_s: int) -> int:
        self._begin()
        ttl = max(1, int(ttl_s))
        lease_id = self._next_lease_id
        self._next_lease_id += 1
        self._leases[lease_id] = _Lease(lease_id, ttl, self._clock() + ttl)
        return lease_id

    def responsive(self) -> bool:
        return True  # in process: it always answers

    async def keep_alive(self, lease_id: int, timeout_s: float | None = None) -> int:
        self._begin()
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseExpired(f"lease {lease_id:x} not found")
        lease.deadline = self._clock() + lease.ttl_s
        return lease.ttl_s

    async def revoke_lease(self, lease_id: int) -> None:
        self._begin()
        self._revoke(lease_id)

    async def lease_ttl(self, lease_id: int) -> LeaseTTL | None:
        self._begin()
        lease = self._leases.get(lease_id)
        if lease is None:
            return None
        return LeaseTTL(remaining_s=max(0, int(lease.deadline - self._clock())), granted_s=lease.ttl_s)

    def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[list[Event]]:
        self._ensure_open()
        # Resolve "from now" eagerly, so writes made before the first pull are not missed.
        start = start_revision if start_revision > 0 else self._revision + 1
        return self._watch(prefix, start)

    async def compact(self, revision: int) -> None:
        self._begin()
        if revision > self._revision:
            raise StoreError(f"cannot compact to future revision {revision} (current {self._revision})")
        if revision <= self._compacted:
            return
        self._compacted = revision
        cut = bisect.bisect_left(self._history, revision, key=lambda r: r.revision)
        del self._history[:cut]
        self._wake()  # lagging watchers must notice the compaction

    async def close(self) -> None:
        self._closed = True
        self._wake()

    # -- lease expiry ----------------------------------------------------------------

    def expire_leases(self) -> list[int]:
        """Revoke every lease past its deadline (one revision each); returns their ids."""
        now = self._clock()
        expired = sorted(
            (le for le in self._leases.values() if le.deadline <= now), key=lambda le: (le.deadline, le.id)
        )
        for lease in expired:
            self._revoke(lease.id)
        return [le.id for le in expired]

    # -- internals -------------------------------------------------------------------

    def _ensure_open(self) -> None:
        if self._closed:
            raise StoreUnavailable("memory store is closed")

    def _begin(self) -> None:
        self._ensure_open()
        self.expire_leases()

    def _mod_revision(self, key: str) -> int:
        kv = self._data.get(key)
        return kv.mod_revision if kv is not None else 0

    def _check_leases(self, ops: Sequence[Op]) -> None:
        for op in ops:
            if isinstance(op, Put) and op.lease and op.lease not in self._leases:
                raise LeaseExpired(f"lease {op.lease:x} not found")

    def _apply_put(self, op: Put, rev: int) -> Event:
        old = self._data.get(op.key)
        if old is not None and old.lease and old.lease != op.lease and old.lease in self._leases:
            self._leases[old.lease].keys.discard(op.key)
        if op.lease:
            self._leases[op.lease].keys.add(op.key)
        created = old.create_revision if old is not None else rev
        self._data[op.key] = KeyValue(op.key, op.value, rev, created, op.lease)
        return Event("put", op.key, op.value, rev)

    def _apply_delete(self, key: str, rev: int) -> Event | None:
        old = self._data.pop(key, None)
        if old is None:
            return None
        if old.lease and old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        return Event("delete", key, b"", rev)

    def _revoke(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        rev = self._revision + 1
        # etcd deletes a lease's keys in sorted order within one revision.
        events = [ev for key in sorted(lease.keys) if (ev := self._apply_delete(key, rev)) is not None]
        self._commit(events)

    def _commit(self, events: list[Event]) -> None:
        if not events:
            return
        self._revision = events[0].mod_revision
        self._history.append(_Record(self._revision, tuple(events)))
        self._wake()

    def _wake(self) -> None:
        for waker in self._wakers:
            waker.set()

    async def _watch(self, prefix: str, start: int) -> AsyncIterator[list[Event]]:
        waker = asyncio.Event()
        self._wakers.add(waker)
        next_rev = start
        try:
            while not self._closed:
                if next_rev < self._compacted:
                    raise Compacted(self._compacted)
                i = bisect.bisect_left(self._history, next_rev, key=lambda r: r.revision)
                if i == len(self._history):
                    waker.clear()
                    await waker.wait()
                    continue
                record = self._history[i]
                next_rev = record.revision + 1
                matching = [ev for ev in record.events if ev.key.startswith(prefix)]
                if matching:
                    yield matching
        finally:
            self._wakers.discard(waker)
