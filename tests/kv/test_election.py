"""Leader election on both stores (MemoryStore with a fake clock, and the session etcd).

Each test owns its `etcd_prefix`. Waits are bounded polls of each candidate's own view;
no test asserts how long anything takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshd.kv.election import Election, leader_of
from meshd.kv.embedded import EmbeddedEtcd
from meshd.kv.etcd import EtcdStore
from meshd.kv.lease import LeaseKeeper
from meshd.kv.memory import MemoryStore
from meshd.kv.store import Compare, Event, KeyValue, KVStore, Op, StoreUnavailable, TxnResult
from meshd.testing.etcd import start_test_etcd

WAIT_S = 15.0
TTL_S = 2  # etcd's practical minimum; on memory it is fake time


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Freezable:
    """A view of `inner` whose calls and watch deliveries hold while frozen: a stopped process."""

    def __init__(self, inner: KVStore) -> None:
        self.inner = inner
        self._thawed = asyncio.Event()
        self._thawed.set()

    def freeze(self) -> None:
        self._thawed.clear()

    def thaw(self) -> None:
        self._thawed.set()

    async def get(self, key: str) -> KeyValue | None:
        await self._thawed.wait()
        return await self.inner.get(key)

    async def range_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        await self._thawed.wait()
        return await self.inner.range_prefix(prefix)

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        await self._thawed.wait()
        return await self.inner.put(key, value, lease)

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Op]) -> TxnResult:
        await self._thawed.wait()
        return await self.inner.txn(compares, ops)

    async def grant_lease(self, ttl_s: int) -> int:
        await self._thawed.wait()
        return await self.inner.grant_lease(ttl_s)

    async def keep_alive(self, lease_id: int, timeout_s: float | None = None) -> int:
        await self._thawed.wait()
        return await self.inner.keep_alive(lease_id, timeout_s)

    async def revoke_lease(self, lease_id: int) -> None:
        await self._thawed.wait()
        await self.inner.revoke_lease(lease_id)

    def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[list[Event]]:
        return self._watch(prefix, start_revision)

    async def _watch(self, prefix: str, start_revision: int) -> AsyncIterator[list[Event]]:
        async with contextlib.aclosing(self.inner.watch_prefix(prefix, start_revision)) as watch:  # type: ignore[type-var]
            async for batch in watch:
                await self._thawed.wait()
                yield batch

    async def compact(self, revision: int) -> None:
        await self.inner.compact(revision)

    async def close(self) -> None:
        pass  # the inner store is the test's to close


@dataclass
class Env:
    kind: str
    store: KVStore
    p: str
    clock: FakeClock | None  # memory only: drives lease expiry and the elections' guard
    elections: list[Election]
    frozen: list[Freezable]

    def election(self, cid: str, lease: LeaseKeeper | None = None, store: KVStore | None = None) -> Election:
        clock = self.clock if self.clock is not None else time.monotonic
        e = Election(store or self.store, self.p + "leader/", cid, cid.encode(), TTL_S, lease=lease, clock=clock)
        self.elections.append(e)
        return e

    def freezable(self) -> Freezable:
        f = Freezable(self.store)
        self.frozen.append(f)
        return f

    async def expire(self, victim: Election, others: list[Election]) -> None:
        """The victim's lease runs out (nothing keeps it alive any more); the others' stay alive."""
        if isinstance(self.store, MemoryStore) and self.clock is not None:
            for _ in range(2 * TTL_S + 1):  # nothing else runs meanwhile: no await yields here
                for e in others:
                    await self.store.keep_alive(e.lease.lease_id)
                self.clock.now += 0.5
                self.store.expire_leases()
        else:
            await self.store.revoke_lease(victim.lease.lease_id)  # etcd: expiry, without the wait


@pytest.fixture(params=["memory", "etcd"])
async def env(request: pytest.FixtureRequest, etcd_prefix: str) -> AsyncIterator[Env]:
    if request.param == "etcd":
        server: EmbeddedEtcd = request.getfixturevalue("etcd_server")
        e = Env("etcd", EtcdStore.from_url(server.url), etcd_prefix, None, [], [])
    else:
        clock = FakeClock()
        e = Env("memory", MemoryStore(clock=clock), etcd_prefix, clock, [], [])
    try:
        yield e
    finally:
        for f in e.frozen:
            f.thaw()
        for el in e.elections:
            await el.stop()
        await e.store.close()


async def until(cond: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    async def poll() -> None:
        while True:
            if cond():
                return
            await asyncio.sleep(0.05)

    try:
        await asyncio.wait_for(poll(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"timed out waiting until {what}") from None


def agreed(es: list[Election], leader: Election) -> bool:
    """`leader` leads, and it alone, in everyone's view."""
    everyone_agrees = all(e.leader_id == leader.candidate_id for e in es)
    return leader.is_leader and everyone_agrees and sum(e.is_leader for e in es) == 1


def reported(env: Env, changes: list[bool], expected: list[bool]) -> bool:
    """on_change fired exactly `expected` on memory; on etcd see `reported_etcd`."""
    return changes == expected if env.kind == "memory" else reported_etcd(changes, expected)


def reported_etcd(changes: list[bool], expected: list[bool]) -> bool:
    """On real time a loaded machine may add a brief lapse of confirmation, so only the first
    and last reports are checked (on_change fires only on changes, so reports alternate)."""
    alternating = all(x != y for x, y in itertools.pairwise(changes))
    return alternating and changes[:1] == expected[:1] and changes[-1:] == expected[-1:]


# -- pure --------------------------------------------------------------------------------------


def kv(key: str, create: int) -> KeyValue:
    return KeyValue(key, b"", create + 5, create)


def test_leader_of_lowest_create_revision() -> None:
    p = "/svc/leader/"
    assert leader_of([], p) is None
    assert leader_of([kv(p + "b", 7), kv(p + "a", 9), kv(p + "c", 8)], p) == "b"
    # Ties (one txn) go by key; keys not directly under the prefix do not count.
    assert leader_of([kv(p + "z", 3), kv(p + "y", 3)], p) == "y"
    assert leader_of([kv(p + "x/deeper", 1), kv("/other/a", 1), kv(p, 1), kv(p + "q", 4)], p) == "q"
    assert leader_of([kv("k1", 2), kv("k0", 3)]) == "k1"


def test_candidate_id_must_be_a_single_segment() -> None:
    with pytest.raises(ValueError):
        Election(MemoryStore(), "/p/", "a/b", b"", TTL_S)


# -- both stores ---------------------------------------------------------------------------------


async def test_single_candidate_becomes_leader(env: Env) -> None:
    changes: list[bool] = []
    a = env.election("a")
    a.on_change = changes.append
    await a.start()
    await asyncio.wait_for(a.wait_until_leader(), WAIT_S)
    assert a.leader_id == "a" and a.leader_value == b"a" and reported(env, changes, [True])
    fence = a.fence()
    assert fence is not None and fence.key == a.key
    kv_a = await env.store.get(a.key)
    assert kv_a is not None and kv_a.lease == a.lease.lease_id and fence.mod_revision == kv_a.mod_revision


async def test_three_candidates_one_leader_all_agree(env: Env) -> None:
    es = [env.election(c) for c in ("c1", "c2", "c3")]
    for e in es:
        await e.start()
    await until(lambda: agreed(es, es[0]), "the first candidate leads and all agree")
    assert all(e.candidates == ["c1", "c2", "c3"] for e in es)
    assert [e.is_leader for e in es] == [True, False, False]
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(es[1].wait_until_leader(), 0.3)


async def test_resign_passes_leadership_in_creation_order(env: Env) -> None:
    # Creation order, not id order: z joins first.
    es = [env.election(c) for c in ("z", "m", "a")]
    for e in es:
        await e.start()
    z, m, a = es
    await until(lambda: agreed(es, z), "z leads")
    await z.resign()
    assert not z.is_leader  # at once, before anyone saw the delete
    await until(lambda: agreed(es, m), "m leads after z resigned")
    assert await env.store.get(z.key) is None
    await m.resign(rejoin=True)  # back of the line, behind a
    await until(lambda: agreed(es, a), "a leads after m resigned")
    await a.resign()
    await until(lambda: agreed(es, m), "m leads again after a resigned")
    assert z.leader_id == "m" and not z.is_leader


async def test_frozen_leader_is_replaced_and_steps_down(env: Env) -> None:
    changes: list[bool] = []
    fa = env.freezable()
    a, b, c = env.election("a", store=fa), env.election("b"), env.election("c")
    a.on_change = changes.append
    es = [a, b, c]
    for e in es:
        await e.start()
    await until(lambda: agreed(es, a), "a leads")

    fa.freeze()  # a's process stops: no keep-alives, no checks, no watch events
    await env.expire(a, [b, c])  # ...past its TTL
    await until(lambda: agreed([b, c], b), "b leads after a's lease expired")
    if env.kind == "memory":  # on etcd the lease was revoked early, so a's TTL has not yet run out
        assert not a.is_leader  # a distrusts its leadership before hearing anything
        await until(lambda: changes == [True, False], "a reported stepping down while frozen")

    # a comes back: it steps down, its keeper re-grants a lease and it rejoins at the back.
    fa.thaw()
    await until(lambda: a.candidates == ["b", "c", "a"], "a's key is back, last in line")
    await until(lambda: agreed(es, b), "b still leads")
    await b.stop()
    assert b.leader_id is None and not b.is_leader  # a stopped candidate knows nothing
    await until(lambda: agreed([a, c], c), "c leads after b, then a")
    assert reported(env, changes, [True, False])


async def test_shared_lease_rejoins_after_expiry(env: Env) -> None:
    keeper = LeaseKeeper(env.store, TTL_S)
    await keeper.start()
    a = env.election("a", lease=keeper)
    b = env.election("b")
    try:
        await a.start()
        await b.start()
        await until(lambda: agreed([a, b], a), "a leads on the shared lease")
        await keeper.stop(revoke=False)
        await env.expire(a, [b])
        await until(lambda: agreed([a, b], b), "b leads")
        await keeper.start()  # the instance's keeper got a new lease
        await until(lambda: a.candidates == ["b", "a"], "a rejoined on the new lease")
        kv_a = await env.store.get(a.key)
        assert kv_a is not None and kv_a.lease == keeper.lease_id
        await b.resign()
        await until(lambda: agreed([a, b], a), "a leads again")
        await a.stop()
        assert await env.store.get(a.key) is None
        assert await env.store.keep_alive(keeper.lease_id)  # the shared lease is not revoked
    finally:
        await keeper.stop()


async def test_stopped_candidate_key_disappears(env: Env) -> None:
    a, b = env.election("a"), env.election("b")
    await a.start()
    await b.start()
    await until(lambda: agreed([a, b], a), "a leads")
    await b.stop()
    assert await env.store.get(b.key) is None
    await a.stop()
    assert await env.store.get(a.key) is None and not a.is_leader
    with pytest.raises(RuntimeError):
        await a.wait_until_leader()


# -- memory only -----------------------------------------------------------------------------------


class CutStore(MemoryStore):
    """A MemoryStore whose linearizable reads fail while `down` (the election's check)."""

    down = False

    async def get(self, key: str) -> KeyValue | None:
        if self.down:
            raise StoreUnavailable("cut off")
        return await super().get(key)


async def test_unconfirmed_longer_than_ttl_loses_leadership() -> None:
    store = CutStore()  # leases on real time (kept alive); the election's guard on a fake clock
    clock = FakeClock()
    changes: list[bool] = []
    a = Election(store, "/p/leader/", "a", b"", TTL_S, on_change=changes.append, clock=clock)
    try:
        await a.start()
        await asyncio.wait_for(a.wait_until_leader(), WAIT_S)
        store.down = True
        clock.now += TTL_S + 1  # frozen or cut off past the TTL
        assert not a.is_leader  # distrusted at once, before any check has run
        await until(lambda: changes == [True, False], "a reported losing leadership")
        store.down = False
        await asyncio.wait_for(a.wait_until_leader(), WAIT_S)  # confirmed again: its key survived
        assert changes == [True, False, True]
    finally:
        await a.stop()
        await store.close()


# -- etcd only ---------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_etcd_real_lease_expiry(etcd_server: EmbeddedEtcd, etcd_prefix: str) -> None:
    store = EtcdStore.from_url(etcd_server.url)
    fa = Freezable(store)
    changes: list[bool] = []
    a = Election(fa, etcd_prefix, "a", b"", TTL_S, on_change=changes.append)
    b = Election(store, etcd_prefix, "b", b"", TTL_S)
    es = [a, b]
    try:
        for e in es:
            await e.start()
        await until(lambda: agreed(es, a), "a leads")
        fa.freeze()  # etcd lets a's 2 s TTL run out
        await until(lambda: b.is_leader, "b leads after a's lease expired", timeout_s=30.0)
        # b saw a's lease expire, which is at least a TTL after a's last confirmation.
        assert not a.is_leader
        await until(lambda: reported_etcd(changes, [True, False]), "a reported stepping down while frozen")
        fa.thaw()
        await until(lambda: agreed(es, b) and a.candidates == ["b", "a"], "a rejoined behind b")
    finally:
        fa.thaw()
        for e in es:
            await e.stop()
        await store.close()


@pytest.mark.slow
async def test_etcd_restart_keeps_one_leader_and_watch_resumes(tmp_path: Path) -> None:
    etcd = start_test_etcd(tmp_path)
    store = EtcdStore.from_url(etcd.url, timeout_s=2.0)
    es = [Election(store, "/restart/leader/", c, b"", TTL_S) for c in ("a", "b")]
    a, b = es
    try:
        for e in es:
            await e.start()
        await until(lambda: agreed(es, a), "a leads")
        await asyncio.to_thread(etcd.restart)  # the candidates keep running meanwhile
        # a keeps leading unless its lease ran out while etcd was down (then b leads).
        await until(lambda: agreed(es, a) or agreed(es, b), "one leader after the restart", timeout_s=40.0)
        leader, other = (a, b) if a.is_leader else (b, a)
        with contextlib.suppress(StoreUnavailable):  # the channel may still be reconnecting:
            await leader.resign()  # then the delete is retried in the background
        await until(lambda: agreed(es, other), "the other leads (its resumed watch saw the resign)", timeout_s=40.0)
    finally:
        for e in es:
            await e.stop()
        await store.close()
        etcd.stop()
