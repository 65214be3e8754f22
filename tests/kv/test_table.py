"""Watch-fed mirrors with CAS update loops, on both stores."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from meshd.core.records import ModelRecord, RecordError
from meshd.kv.memory import MemoryStore
from meshd.kv.store import Delete, KVStore
from meshd.kv.table import KEEP, Table
from meshd.testing.procs import wait_until_async
from tests.lagging_store import LaggingStore


@pytest.fixture
def store(any_store: KVStore) -> KVStore:
    return any_store


def table(store: KVStore, prefix: str) -> Table[ModelRecord]:
    return Table(store, prefix + "registry/", ModelRecord.decode, ModelRecord.encode)


async def test_mirror_lists_then_follows_changes(store: KVStore, etcd_prefix: str) -> None:
    await store.put(etcd_prefix + "registry/a", ModelRecord(type="t").encode())
    t = table(store, etcd_prefix)
    changes: list[tuple[str, str | None, str | None]] = []
    t.listeners.append(lambda i, old, new: changes.append((i, old and old.type, new and new.type)))
    await t.start()
    try:
        assert t.get("a") == ModelRecord(type="t")
        await store.put(etcd_prefix + "registry/b", ModelRecord(type="u").encode())
        await store.put(etcd_prefix + "other/x", b"{}")  # outside the prefix
        rev = await store.put(etcd_prefix + "registry/a", ModelRecord(type="t2").encode())
        await t.wait_for(rev)
        assert t.get("b") == ModelRecord(type="u") and t.get("a") == ModelRecord(type="t2")
        assert len(t) == 2
        result = await t.update("b", lambda rec: None)  # delete
        assert result is None and t.get("b") is None
        assert changes == [("a", None, "t"), ("b", None, "u"), ("a", "t", "t2"), ("b", "u", None)]
    finally:
        await t.stop()


async def test_update_retries_on_conflict_and_keep_writes_nothing(store: KVStore, etcd_prefix: str) -> None:
    t = table(store, etcd_prefix)
    await t.start()
    try:
        await t.update("m", lambda rec: ModelRecord(type="t"))
        calls = 0

        def add_copy(rec: ModelRecord | None) -> ModelRecord:
            nonlocal calls
            calls += 1
            assert rec is not None
            rec.instance_ids["mine"] = 1
            return rec

        # Another writer changes the record while our watch is down, so the mirror is stale:
        # the first CAS fails and the retry sees both changes.
        await t.stop()
        other = ModelRecord(type="t", instance_ids={"theirs": 2})
        await store.put(etcd_prefix + "registry/m", other.encode())
        assert t.get("m") == ModelRecord(type="t")
        t._task = asyncio.create_task(t._watch())  # update() reads the mirror before this runs
        result = await t.update("m", add_copy)
        assert result is not None
        assert calls == 2
        assert result.instance_ids == {"theirs": 2, "mine": 1}
        kv = await store.get(etcd_prefix + "registry/m")
        assert kv is not None and ModelRecord.decode(kv.value).instance_ids == {"theirs": 2, "mine": 1}
        before = kv.mod_revision
        assert await t.update("m", lambda rec: KEEP) == result
        kv = await store.get(etcd_prefix + "registry/m")
        assert kv is not None and kv.mod_revision == before
    finally:
        await t.stop()


async def test_corrupt_values_are_reported_and_never_overwritten(store: KVStore, etcd_prefix: str) -> None:
    await store.put(etcd_prefix + "registry/bad", b"{not json")
    t = table(store, etcd_prefix)
    await t.start()
    try:
        assert t.get("bad") is None and "bad" in t.corrupt
        with pytest.raises(RecordError):
            await t.update("bad", lambda rec: ModelRecord(type="t"))
        kv = await store.get(etcd_prefix + "registry/bad")
        assert kv is not None and kv.value == b"{not json"
        # Valid JSON the decoder cannot take must not stop the mirror either.
        for nasty in (b'{"type": "t", "lu": 1' + b"1" * 5000 + b"}", b"[" * 100_000):
            rev = await store.put(etcd_prefix + "registry/nasty", nasty)
            await t.wait_for(rev)
            assert "nasty" in t.corrupt
        # Repaired by someone else: the mirror picks it up.
        rev = await store.put(etcd_prefix + "registry/bad", ModelRecord(type="ok").encode())
        await t.wait_for(rev)
        assert t.get("bad") == ModelRecord(type="ok") and "bad" not in t.corrupt
    finally:
        await t.stop()


async def test_compaction_while_not_watching_is_repaired_by_relisting(store: KVStore, etcd_prefix: str) -> None:
    await store.put(etcd_prefix + "registry/a", ModelRecord(type="t").encode())
    await store.put(etcd_prefix + "registry/b", ModelRecord(type="t").encode())
    t = table(store, etcd_prefix)
    removed: list[str] = []
    t.listeners.append(lambda i, old, new: removed.append(i) if new is None else None)
    await t.start()
    await t.stop()  # the watch is down; history moves on and is compacted
    await store.put(etcd_prefix + "registry/c", ModelRecord(type="t").encode())
    await store.txn([], [Delete(etcd_prefix + "registry/b")])
    rev = await store.put(etcd_prefix + "x", b"1")
    await store.compact(rev)
    relists = 0
    relist = t._relist

    async def counting_relist() -> None:
        nonlocal relists
        relists += 1
        await relist()

    t._relist = counting_relist  # type: ignore[method-assign]
    t._task = asyncio.create_task(t._watch())  # resume from the stale, compacted revision
    try:
        await wait_until_async(lambda: t.get("c") is not None and t.get("b") is None, 5, "c in and b gone")
        assert relists == 1  # repaired by re-listing, not by replaying history
        assert sorted(i for i, _ in t.items()) == ["a", "c"]
        assert removed == ["b"]
    finally:
        await t.stop()


async def test_a_listing_in_pages_mirrors_every_record_and_drops_the_deleted(store: KVStore, etcd_prefix: str) -> None:
    """The start and every re-listing read the prefix a few keys at a time (here 2 of 7):
    nothing is missed at a page's edge, and what is gone from the store goes from the mirror."""
    for n in range(7):
        await store.put(etcd_prefix + f"registry/m{n}", ModelRecord(type=f"t{n}").encode())
    t = Table(store, etcd_prefix + "registry/", ModelRecord.decode, ModelRecord.encode, page_keys=2)
    await t.start()
    try:
        assert sorted(i for i, _ in t.items()) == [f"m{n}" for n in range(7)]
        assert t.get("m6") == ModelRecord(type="t6")
        await t.stop()
        await store.txn([], [Delete(etcd_prefix + "registry/m3")])
        await store.put(etcd_prefix + "registry/m7", ModelRecord(type="t7").encode())
        await t.catch_up()
        assert sorted(i for i, _ in t.items()) == [f"m{n}" for n in (0, 1, 2, 4, 5, 6, 7)]
    finally:
        await t.stop()


async def test_a_listing_outlived_by_its_revision_starts_again() -> None:
    """Writes (and, on etcd, a compaction) between two pages: the listing starts again at the
    store's new revision and the mirror ends with what the store holds then."""
    store = MemoryStore()  # keeps no history: any write between pages compacts the listing's
    for n in range(5):
        await store.put(f"registry/m{n}", ModelRecord(type="t").encode())
    t = Table(store, "registry/", ModelRecord.decode, ModelRecord.encode, page_keys=2)
    real_page = store.range_page
    pages = 0

    async def page_then_write(prefix: str, after: str | None, limit: int, revision: int) -> Any:
        nonlocal pages
        pages += 1
        out = await real_page(prefix, after, limit, revision)
        if pages == 1:
            await store.put("registry/late", ModelRecord(type="late").encode())
        return out

    store.range_page = page_then_write  # type: ignore[method-assign]
    await t.start()
    try:
        assert sorted(i for i, _ in t.items()) == sorted([f"m{n}" for n in range(5)] + ["late"])
        assert pages > 3  # the first listing was abandoned after its first page
    finally:
        await t.stop()


async def test_an_update_starts_from_the_mirrored_record_not_a_shared_one(store: KVStore, etcd_prefix: str) -> None:
    """The mirror keeps each record once (decoded, not also as stored): an update function
    gets a copy of its own, so changing it in place leaves the mirror as it was."""
    t = table(store, etcd_prefix)
    await t.start()
    try:
        await t.update("m", lambda rec: ModelRecord(type="t"))
        seen: list[ModelRecord] = []

        def change(rec: ModelRecord | None) -> object:
            assert rec is not None and rec is not t.get("m")
            rec.type = "mutated"
            seen.append(rec)
            return KEEP

        await t.update("m", change)
        assert seen and t.get("m") == ModelRecord(type="t")
    finally:
        await t.stop()


async def test_catch_up_brings_a_lagging_mirror_to_the_store_without_replaying_events() -> None:
    store = LaggingStore()
    t = table(store, "")
    changes: list[tuple[str, str | None, str | None]] = []
    t.listeners.append(lambda i, old, new: changes.append((i, old and old.type, new and new.type)))
    await t.start()
    try:
        await store.put("registry/a", ModelRecord(type="t").encode())
        await t.wait_for(store.revision)
        store.flowing.clear()  # the watch falls behind (a process just resumed, say)
        await store.put("registry/a", ModelRecord(type="t2").encode())
        await store.put("registry/b", ModelRecord(type="u").encode())
        await store.txn([], [Delete("registry/a")])
        await store.put("other/x", b"{}")  # outside the prefix: the mirror's revision cannot reach it by watching
        assert t.get("a") == ModelRecord(type="t") and t.get("b") is None
        await t.catch_up()
        assert t.get("a") is None and t.get("b") == ModelRecord(type="u") and t.revision == store.revision
        assert changes == [("a", None, "t"), ("b", None, "u"), ("a", "t", None)]
        store.flowing.set()  # the held events arrive late: already covered, so skipped
        await store.put("registry/c", ModelRecord(type="v").encode())
        await wait_until_async(lambda: t.get("c") is not None, 5, "c in the mirror")
        assert t.get("a") is None and t.get("b") == ModelRecord(type="u")
        assert changes[3:] == [("c", None, "v")]
    finally:
        await t.stop()
        await store.close()


def test_a_page_of_no_keys_is_refused(store: KVStore) -> None:
    with pytest.raises(ValueError, match="page_keys"):
        Table(store, "registry/", ModelRecord.decode, ModelRecord.encode, page_keys=0)
