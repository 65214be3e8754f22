"""One KVStore contract, run against MemoryStore and a real etcd (EtcdStore), plus etcd-only
fault tests: restarts under an open watch, compaction while a watcher is away, outages.

Tests share one etcd per session, so each works under its own `etcd_prefix` and asserts
revisions only relative to ones it observed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from meshd.kv.embedded import EmbeddedEtcd, free_port
from meshd.kv.etcd import EtcdStore
from meshd.kv.memory import MemoryStore
from meshd.kv.store import (
    Compacted,
    Compare,
    Delete,
    Event,
    KVStore,
    LeaseExpired,
    Put,
    StoreUnavailable,
    delete_if,
    prefix_pages,
    put_if,
)
from meshd.testing.etcd import start_test_etcd

T = TypeVar("T")
WAIT_S = 10.0  # bound on any single wait; generous so slow machines do not flake


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    kind: str
    store: KVStore
    p: str  # key prefix owned by this test
    advance: Callable[[float], Awaitable[None]]  # let time pass (fake clock or real sleep)

    async def wait_gone(self, key: str, timeout_s: float = WAIT_S) -> None:
        """Let time pass until `key` is deleted (lease expiry is asynchronous in etcd)."""
        steps = int(timeout_s / 0.1)
        for _ in range(steps):
            if await self.store.get(key) is None:
                return
            await self.advance(0.1)
        raise AssertionError(f"{key} still present after {timeout_s}s")


@pytest.fixture(params=["memory", "etcd"])
def backend(request: pytest.FixtureRequest) -> tuple[str, EmbeddedEtcd | None]:
    # Only the etcd parameter pulls in the session etcd, so memory-only runs need no etcd.
    if request.param == "etcd":
        return "etcd", request.getfixturevalue("etcd_server")
    return "memory", None


@pytest.fixture
async def h(backend: tuple[str, EmbeddedEtcd | None], etcd_prefix: str) -> AsyncIterator[Harness]:
    kind, server = backend
    if server is None:
        clock = FakeClock()
        mem = MemoryStore(clock=clock)

        async def advance_fake(seconds: float) -> None:
            clock.now += seconds
            mem.expire_leases()

        harness = Harness(kind, mem, etcd_prefix, advance_fake)
    else:
        harness = Harness(kind, EtcdStore.from_url(server.url), etcd_prefix, asyncio.sleep)
    try:
        yield harness
    finally:
        await harness.store.close()


async def bounded(aw: Awaitable[T], timeout_s: float = WAIT_S) -> T:
    return await asyncio.wait_for(aw, timeout_s)


async def take(it: AsyncIterator[list[Event]], n: int, timeout_s: float = WAIT_S) -> list[list[Event]]:
    return [await bounded(anext(it), timeout_s) for _ in range(n)]


def flat(batches: list[list[Event]], prefix: str) -> list[list[tuple[str, str, bytes, int]]]:
    """Batches as plain tuples with the test prefix stripped, for readable asserts."""
    return [[(e.kind, e.key.removeprefix(prefix), e.value, e.mod_revision) for e in b] for b in batches]


# -- reads and writes ---------------------------------------------------------------------


async def test_get_missing_and_present(h: Harness) -> None:
    s, p = h.store, h.p
    assert await s.get(p + "a") is None
    r1 = await s.put(p + "a", b"one")
    kv = await s.get(p + "a")
    assert kv is not None
    assert (kv.key, kv.value, kv.mod_revision, kv.create_revision, kv.lease) == (p + "a", b"one", r1, r1, 0)
    r2 = await s.put(p + "a", b"two")
    kv = await s.get(p + "a")
    assert kv is not None
    assert (kv.value, kv.mod_revision, kv.create_revision) == (b"two", r2, r1)


async def test_put_revision_increments(h: Harness) -> None:
    s, p = h.store, h.p
    _, r0 = await s.range_prefix(p)
    revs = [await s.put(p + f"k{i}", b"v") for i in range(4)]
    assert r0 < revs[0] < revs[1] < revs[2] < revs[3]
    _, now = await s.range_prefix(p)
    assert now == revs[-1]


async def test_range_prefix_sorted_with_revision(h: Harness) -> None:
    s, p = h.store, h.p
    for key in ["m", "b/2", "ü", "a", "b/1", "B"]:
        await s.put(p + key, key.encode())
    outside = p[:-1] + "0"  # shares every character but the separator: not under p
    last = await s.put(outside, b"x")
    kvs, rev = await s.range_prefix(p)
    assert [kv.key.removeprefix(p) for kv in kvs] == ["B", "a", "b/1", "b/2", "m", "ü"]
    assert [kv.value for kv in kvs] == [k.removeprefix(p).encode() for k in [kv.key for kv in kvs]]
    assert rev == last
    sub, rev2 = await s.range_prefix(p + "b/")
    assert [kv.key for kv in sub] == [p + "b/1", p + "b/2"] and rev2 == last
    none, _ = await s.range_prefix(p + "nothing/")
    assert none == []


async def test_prefix_pages_read_every_key_once_as_of_the_first_page(h: Harness) -> None:
    """Pages of two, sorted, none skipped or repeated; all as of the first page's revision."""
    s, p = h.store, h.p
    keys = ["a", "b", "b0", "c", "d"]  # "b0" sorts right after "b": the next-key boundary
    for key in keys:
        await s.put(p + key, key.encode())
    await s.put(p[:-1] + "0", b"x")  # outside the prefix
    pages = [(kvs, rev) async for kvs, rev in prefix_pages(s, p, limit=2)]
    assert [[kv.key.removeprefix(p) for kv in kvs] for kvs, _ in pages] == [["a", "b"], ["b0", "c"], ["d"]]
    assert len({rev for _, rev in pages}) == 1
    empty = [kvs async for kvs, _ in prefix_pages(s, p + "nothing/")]
    assert empty == [[]]


async def test_a_page_at_a_revision_no_longer_kept_is_compacted(h: Harness) -> None:
    s, p = h.store, h.p
    await s.put(p + "a", b"1")
    _, rev, more = await s.range_page(p, None, 1, 0)
    assert not more
    latest = await s.put(p + "a", b"2")
    await s.compact(latest)
    with pytest.raises(Compacted):
        await s.range_page(p, None, 1, rev)


# -- transactions ---------------------------------------------------------------------------


async def test_txn_cas(h: Harness) -> None:
    s, p = h.store, h.p
    k = p + "cas"
    created = await put_if(s, k, b"v1", 0)  # create only if absent
    assert created.succeeded
    again = await put_if(s, k, b"other", 0)
    assert not again.succeeded and again.revision == created.revision  # failure changes nothing
    kv = await s.get(k)
    assert kv is not None and kv.value == b"v1" and kv.mod_revision == created.revision

    stale = await put_if(s, k, b"v2", created.revision - 1)
    assert not stale.succeeded
    ok = await put_if(s, k, b"v2", created.revision)
    assert ok.succeeded and ok.revision > created.revision
    kv = await s.get(k)
    assert kv is not None and kv.value == b"v2" and kv.mod_revision == ok.revision


async def test_txn_is_atomic_across_keys(h: Harness) -> None:
    s, p = h.store, h.p
    ra = await s.put(p + "a", b"a0")
    rc = await s.put(p + "c", b"c0")
    before, rev_before = await s.range_prefix(p)

    # One wrong compare (b is absent, not at 999): nothing happens.
    bad = await s.txn(
        [Compare(p + "a", ra), Compare(p + "b", 999)],
        [Put(p + "a", b"a1"), Put(p + "b", b"b1"), Delete(p + "c")],
    )
    assert not bad.succeeded and bad.revision == rev_before
    assert await s.range_prefix(p) == (before, rev_before)

    good = await s.txn(
        [Compare(p + "a", ra), Compare(p + "b", 0), Compare(p + "c", rc)],
        [Put(p + "a", b"a1"), Put(p + "b", b"b1"), Delete(p + "c")],
    )
    assert good.succeeded and good.revision == rev_before + 1  # one revision for all ops
    kvs, rev = await s.range_prefix(p)
    assert rev == good.revision
    assert [(kv.key, kv.value, kv.mod_revision) for kv in kvs] == [
        (p + "a", b"a1", good.revision),
        (p + "b", b"b1", good.revision),
    ]


async def test_txn_without_changes_keeps_revision(h: Harness) -> None:
    s, p = h.store, h.p
    _, rev = await s.range_prefix(p)
    res = await s.txn([Compare(p + "ghost", 0)], [Delete(p + "ghost")])
    assert res.succeeded and res.revision == rev


async def test_delete_if(h: Harness) -> None:
    s, p = h.store, h.p
    k = p + "d"
    r = await s.put(k, b"v")
    stale = await delete_if(s, k, r - 1)
    assert not stale.succeeded and await s.get(k) is not None
    ok = await delete_if(s, k, r)
    assert ok.succeeded and ok.revision == r + 1
    assert await s.get(k) is None
    gone = await delete_if(s, k, r)  # it is absent now, so mod_revision r no longer holds
    assert not gone.succeeded


# -- leases -----------------------------------------------------------------------------------


async def test_lease_keep_alive_and_revoke(h: Harness) -> None:
    s, p = h.store, h.p
    lease = await s.grant_lease(30)
    await s.put(p + "l1", b"1", lease=lease)
    await s.put(p + "l2", b"2", lease=lease)
    await s.put(p + "free", b"3")
    kv = await s.get(p + "l1")
    assert kv is not None and kv.lease == lease
    assert await s.keep_alive(lease) == 30

    await s.revoke_lease(lease)
    kvs, _ = await s.range_prefix(p)
    assert [kv.key for kv in kvs] == [p + "free"]
    with pytest.raises(LeaseExpired):
        await s.keep_alive(lease)
    await s.revoke_lease(lease)  # absent lease: no-op
    with pytest.raises(LeaseExpired):
        await s.put(p + "late", b"x", lease=lease)
    with pytest.raises(LeaseExpired):
        await put_if(s, p + "late", b"x", 0, lease=lease)
    assert await s.get(p + "late") is None


async def test_keep_alive_unknown_lease(h: Harness) -> None:
    with pytest.raises(LeaseExpired):
        await h.store.keep_alive(0x5EED_0BAD)


async def test_lease_ttl_counts_down_from_each_renewal_and_is_none_once_gone(h: Harness) -> None:
    """Peers read an instance's renewals through `lease_ttl` (placement.liveness): the time
    since the last renewal is granted - remaining, never less than the truth (rounded down)."""
    s = h.store
    lease = await s.grant_lease(10)
    fresh = await s.lease_ttl(lease)
    assert fresh is not None and fresh.granted_s == 10 and 9 <= fresh.remaining_s <= 10
    await h.advance(2.2)
    aged = await s.lease_ttl(lease)
    assert aged is not None and aged.granted_s == 10
    assert 10 - aged.remaining_s >= 2.2  # at least the time that passed: rounded down
    await s.keep_alive(lease)
    renewed = await s.lease_ttl(lease)
    assert renewed is not None and renewed.remaining_s > aged.remaining_s
    await s.revoke_lease(lease)
    assert await s.lease_ttl(lease) is None
    assert await s.lease_ttl(0x5EED_0BAD) is None


async def test_lease_expiry_deletes_keys_and_notifies(h: Harness) -> None:
    s, p = h.store, h.p
    # etcd's minimum TTL with default timing is 2 s; 3 s leaves margin for the refresh check.
    lease = await s.grant_lease(3)
    _, r0 = await s.range_prefix(p)
    async with contextlib.aclosing(s.watch_prefix(p, r0 + 1)) as watch:
        r1 = await s.put(p + "e1", b"1", lease=lease)
        r2 = await s.put(p + "e2", b"2", lease=lease)
        await h.advance(2.0)
        assert await s.keep_alive(lease) >= 3  # refresh: the lease now outlives its first TTL
        await h.advance(2.0)
        assert await s.get(p + "e1") is not None
        await h.wait_gone(p + "e1")
        assert await s.get(p + "e2") is None
        with pytest.raises(LeaseExpired):
            await s.keep_alive(lease)

        batches = await take(watch, 3)
        assert flat(batches[:2], p) == [[("put", "e1", b"1", r1)], [("put", "e2", b"2", r2)]]
        # Both keys go in one revision, in key order.
        assert [(e.kind, e.key) for e in batches[2]] == [("delete", p + "e1"), ("delete", p + "e2")]
        assert batches[2][0].mod_revision == batches[2][1].mod_revision > r2


# -- watches ----------------------------------------------------------------------------------


async def test_watch_delivers_history_then_live_changes_grouped_by_revision(h: Harness) -> None:
    s, p = h.store, h.p
    _, r0 = await s.range_prefix(p)
    lease = await s.grant_lease(30)
    # History written before the watch starts...
    r1 = await s.put(p + "a", b"1")
    await s.put(p[:-1] + "0/elsewhere", b"not mine")
    t2 = await s.txn([], [Put(p + "b", b"2"), Put(p + "c", b"3", lease=lease), Delete(p + "a")])
    r3 = await s.put(p + "d", b"4", lease=lease)

    async with contextlib.aclosing(s.watch_prefix(p, r1)) as watch:
        first = await take(watch, 3)
        # ...and changes made while it is open.
        r4 = await s.put(p + "b", b"5")
        await s.revoke_lease(lease)
        rest = await take(watch, 2)

    assert r0 < r1
    assert flat(first, p) == [
        [("put", "a", b"1", r1)],
        [("put", "b", b"2", t2.revision), ("put", "c", b"3", t2.revision), ("delete", "a", b"", t2.revision)],
        [("put", "d", b"4", r3)],
    ]
    assert flat(rest[:1], p) == [[("put", "b", b"5", r4)]]
    assert [(e.kind, e.key.removeprefix(p), e.value) for e in rest[1]] == [("delete", "c", b""), ("delete", "d", b"")]
    assert rest[1][0].mod_revision == rest[1][1].mod_revision > r4


async def test_watch_from_compacted_revision_raises(h: Harness) -> None:
    s, p = h.store, h.p
    r1 = await s.put(p + "k", b"1")
    await s.put(p + "k", b"2")
    r3 = await s.put(p + "k", b"3")
    await s.compact(r3)
    with pytest.raises(Compacted) as err:
        async with contextlib.aclosing(s.watch_prefix(p, r1)) as watch:
            await bounded(anext(watch))
    assert err.value.compact_revision == r3
    # The compaction revision itself is still watchable.
    async with contextlib.aclosing(s.watch_prefix(p, r3)) as watch:
        assert flat(await take(watch, 1), p) == [[("put", "k", b"3", r3)]]
    await s.compact(r3)  # compacting again to the same point is harmless


async def test_close_ends_watches(h: Harness) -> None:
    s, p = h.store, h.p
    _, rev = await s.range_prefix(p)
    watch = s.watch_prefix(p, rev + 1)
    pending = asyncio.ensure_future(anext(watch))
    await asyncio.sleep(0.2)  # let it block waiting for changes
    await s.close()
    with pytest.raises(StopAsyncIteration):
        await bounded(pending)
    with pytest.raises(StoreUnavailable):
        await s.get(p + "x")


# -- memory-only details ----------------------------------------------------------------------


async def test_memory_expiry_is_lazy_and_explicit() -> None:
    clock = FakeClock()
    s = MemoryStore(clock=clock)
    lease = await s.grant_lease(5)
    await s.put("/k", b"v", lease=lease)
    clock.now += 5
    assert s.expire_leases() == [lease]
    assert await s.get("/k") is None
    # Lazily, on the next operation, without calling expire_leases().
    lease2 = await s.grant_lease(1)
    await s.put("/k2", b"v", lease=lease2)
    clock.now += 1
    assert await s.get("/k2") is None


# -- etcd-only ----------------------------------------------------------------------------------


def test_from_url() -> None:
    for url in ["http://127.0.0.1:23790", "127.0.0.1:23790", "http://127.0.0.1:23790,http://127.0.0.1:1"]:
        store = EtcdStore.from_url(url)
        assert (store.host, store.port) == ("127.0.0.1", 23790)
    assert EtcdStore.from_url("https://127.0.0.1:2379").target.tls  # upstream: https means TLS
    assert [str(e) for e in EtcdStore.from_url("h1:1,h2").target.endpoints] == ["h1:1", "h2:2379"]
    with pytest.raises(ValueError):
        EtcdStore.from_url("ftp://127.0.0.1:2379")


async def test_etcd_unreachable_raises_store_unavailable() -> None:
    store = EtcdStore("127.0.0.1", free_port(), timeout_s=2.0)
    try:
        ops: list[Callable[[], Awaitable[object]]] = [
            lambda: store.get("/k"),
            lambda: store.range_prefix("/"),
            lambda: store.put("/k", b"v"),
            lambda: put_if(store, "/k", b"v", 0),
            lambda: store.grant_lease(5),
            lambda: store.keep_alive(1),
            lambda: store.revoke_lease(1),
            lambda: store.compact(1),
        ]
        for op in ops:
            with pytest.raises(StoreUnavailable):
                await bounded(op())
    finally:
        await store.close()


async def put_retrying(store: KVStore, key: str, value: bytes) -> int:
    """Put once etcd is reachable again (the channel may still be backing off right after a restart)."""
    for _ in range(100):
        try:
            return await store.put(key, value)
        except StoreUnavailable:
            await asyncio.sleep(0.1)
    raise AssertionError("etcd did not come back")


@pytest.mark.slow
async def test_etcd_watch_survives_restart_without_loss_or_repeats(tmp_path: Path) -> None:
    etcd = start_test_etcd(tmp_path)
    store = EtcdStore.from_url(etcd.url, timeout_s=2.0)
    p = "/restart/"
    try:
        _, r0 = await store.range_prefix(p)
        async with contextlib.aclosing(store.watch_prefix(p, r0 + 1)) as watch:
            before = [await store.put(p + f"before{i}", b"b") for i in range(3)]
            assert [b[0].mod_revision for b in await take(watch, 3)] == before

            etcd.stop()
            with pytest.raises(StoreUnavailable):
                await bounded(store.get(p + "before0"))
            # The consumer is waiting while etcd is down; the watch must reconnect by itself.
            pending = asyncio.ensure_future(take(watch, 5, timeout_s=30.0))
            await asyncio.sleep(0.5)
            assert not pending.done()
            etcd.start()
            after = [await put_retrying(store, p + f"after{i}", b"a") for i in range(5)]
            got = await bounded(pending, 40.0)
            assert [[(e.kind, e.key, e.mod_revision) for e in b] for b in got] == [
                [("put", p + f"after{i}", rev)] for i, rev in enumerate(after)
            ]
            # Nothing repeated behind them: the next thing seen is the next write.
            sentinel = await store.put(p + "sentinel", b"s")
            assert [e.mod_revision for e in (await take(watch, 1))[0]] == [sentinel]
    finally:
        await store.close()
        etcd.stop()


@pytest.mark.slow
async def test_etcd_compaction_while_watcher_disconnected_raises_compacted(tmp_path: Path) -> None:
    etcd = start_test_etcd(tmp_path)
    store = EtcdStore.from_url(etcd.url, timeout_s=2.0)
    p = "/compact/"
    try:
        _, r0 = await store.range_prefix(p)
        async with contextlib.aclosing(store.watch_prefix(p, r0 + 1)) as watch:
            await store.put(p + "a", b"1")
            await take(watch, 1)
            # The watcher is not reading (suspended), so it cannot reconnect before the
            # compaction; its stream dies with the restart.
            etcd.restart()
            await put_retrying(store, p + "b", b"2")
            r3 = await store.put(p + "c", b"3")
            await store.compact(r3)
            with pytest.raises(Compacted) as err:
                await bounded(anext(watch), 30.0)
            assert err.value.compact_revision == r3

        # The caller re-lists and re-watches from the listed revision.
        kvs, rev = await store.range_prefix(p)
        assert [kv.key for kv in kvs] == [p + "a", p + "b", p + "c"]
        async with contextlib.aclosing(store.watch_prefix(p, rev + 1)) as watch:
            r4 = await store.put(p + "d", b"4")
            assert flat(await take(watch, 1), p) == [[("put", "d", b"4", r4)]]
    finally:
        await store.close()
        etcd.stop()
