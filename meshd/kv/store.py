"""The one seam to the key-value world: what meshd needs from etcd, as a Protocol.

Two implementations keep the same semantics and pass one contract suite
(tests/kv/test_contract.py): `EtcdStore` (real etcd through aetcd) and `MemoryStore`
(in-process, for unit tests and the simulator).

Semantics are etcd's: one global revision that every write bumps; each key has a
`mod_revision` (revision of its last write) and `create_revision`; compare-and-set is on
`mod_revision`, with 0 meaning "key absent"; leases expire after their TTL unless kept
alive, deleting their keys; a prefix watch delivers every change after a given revision,
in order, grouped by revision.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int = 0


@dataclass(frozen=True, slots=True)
class LeaseTTL:
    """A lease as the store has it now: `remaining_s` of `granted_s` (whole seconds, rounded
    down, as etcd reports them)."""

    remaining_s: int
    granted_s: int


@dataclass(frozen=True, slots=True)
class Event:
    kind: Literal["put", "delete"]
    key: str
    value: bytes  # b"" for deletes
    mod_revision: int  # revision of this change


@dataclass(frozen=True, slots=True)
class Compare:
    """Succeeds when `key`'s mod_revision equals `mod_revision` (0: key absent)."""

    key: str
    mod_revision: int


@dataclass(frozen=True, slots=True)
class Put:
    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    key: str


Op = Put | Delete


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int  # store revision after the transaction (unchanged when it failed)


class StoreError(Exception):
    """Base for store failures."""


class StoreUnavailable(StoreError):
    """The store cannot be reached (etcd down, connection refused, timed out)."""


class Compacted(StoreError):
    """A watch asked for a revision the store has compacted away; re-list and re-watch."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted (store compacted up to {compact_revision})")
        self.compact_revision = compact_revision


class LeaseExpired(StoreError):
    """A keep-alive or put named a lease that no longer exists."""


class KVStore(Protocol):
    async def get(self, key: str) -> KeyValue | None:
        """Linearizable read of one key."""

    async def range_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """All keys under `prefix`, sorted by key, and the store revision they were read at."""

    async def range_page(
        self, prefix: str, after: str | None, limit: int, revision: int
    ) -> tuple[list[KeyValue], int, bool]:
        """At most `limit` keys under `prefix` sorted by key, those after `after` (None: from
        the first), as of `revision` (0: now; raises Compacted when that is gone); with the
        revision read at and whether more keys follow."""

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Unconditional write; returns the new revision."""

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Op]) -> TxnResult:
        """Apply every op atomically when every compare holds; otherwise change nothing."""

    async def grant_lease(self, ttl_s: int) -> int:
        """A new lease id with the given TTL in seconds."""

    async def keep_alive(self, lease_id: int, timeout_s: float | None = None) -> int:
        """Refresh the lease; returns its TTL. Raises LeaseExpired when it is gone.
        `timeout_s`: a shorter deadline than the store's own (a keep-alive must not outlive
        the lease on a member that went silent: a timed-out call moves to the next one)."""

    async def revoke_lease(self, lease_id: int) -> None:
        """Delete the lease and every key attached to it (absent lease: no-op)."""

    async def lease_ttl(self, lease_id: int) -> LeaseTTL | None:
        """How long the lease has left (None: it is gone). Any client may ask about any
        lease: peers read an instance's renewals as its heartbeat (placement.liveness)."""

    def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[list[Event]]:
        """Changes under `prefix` from `start_revision` (inclusive), one list per revision.

        Survives store restarts and reconnects by resuming after the last delivered
        revision, so no event is lost or repeated. Raises Compacted when the revision to
        resume from has been compacted (the caller re-lists), StoreUnavailable only if
        the implementation gives up reconnecting. Ends when the iterator is closed.
        """

    def responsive(self) -> bool:
        """False while the store is known not to answer (kv.health): caller-facing calls
        then give up at once instead of waiting out their deadline."""

    async def compact(self, revision: int) -> None:
        """Discard history before `revision` (tests use this to exercise re-listing)."""

    async def close(self) -> None:
        """Release connections; watches end."""


async def put_if(store: KVStore, key: str, value: bytes, mod_revision: int, lease: int = 0) -> TxnResult:
    """Compare-and-set on `key`'s mod_revision (0: create only if absent)."""
    return await store.txn([Compare(key, mod_revision)], [Put(key, value, lease)])


async def delete_if(store: KVStore, key: str, mod_revision: int) -> TxnResult:
    """Delete `key` only if its mod_revision is still `mod_revision`."""
    return await store.txn([Compare(key, mod_revision)], [Delete(key)])


# Keys per page when a whole prefix is read: a mirror of 100,000 records then never holds the
# whole listing (etcd's response and its decoded copies) at once, only one page of it.
PAGE_KEYS = 2000


async def prefix_pages(
    store: KVStore, prefix: str, limit: int = PAGE_KEYS
) -> AsyncGenerator[tuple[list[KeyValue], int], None]:
    """Every key under `prefix` in pages of at most `limit`, sorted, all as of one revision
    (the first page's), with that revision. Compacted if the store drops it meanwhile."""
    if limit < 1:
        raise ValueError(f"a page holds at least one key, not {limit}")
    after: str | None = None
    revision = 0
    while True:
        kvs, revision, more = await store.range_page(prefix, after, limit, revision)
        yield kvs, revision
        if not more or not kvs:
            return
        after = kvs[-1].key
