"""update_many: compare-and-set over several records in one transaction, on both stores."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from meshd.core.records import ModelRecord, RecordError, VModelRecord
from meshd.kv.memory import MemoryStore
from meshd.kv.store import Compare, KVStore, Op, StoreUnavailable, TxnResult
from meshd.kv.table import KEEP, MAX_CAS_ATTEMPTS, Table
from meshd.kv.txn import update_many


class Meddling:
    """A store that lets a test write something just before each of the next transactions."""

    def __init__(self, inner: KVStore) -> None:
        self.inner = inner
        self.before_txn: list[tuple[str, bytes]] = []  # one write before each of the next txns
        self.always: tuple[str, bytes] | None = None
        self.txns = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Op]) -> TxnResult:
        self.txns += 1
        if self.before_txn:
            key, value = self.before_txn.pop(0)
            await self.inner.put(key, value)
        elif self.always is not None:
            await self.inner.put(*self.always)
        return await self.inner.txn(compares, ops)


@pytest.fixture
def store(any_store: KVStore) -> Meddling:
    return Meddling(any_store)


@pytest.fixture
async def tables(store: Meddling, etcd_prefix: str) -> AsyncIterator[tuple[Table[ModelRecord], Table[VModelRecord]]]:
    models = Table(store, etcd_prefix + "registry/", ModelRecord.decode, ModelRecord.encode)
    vmodels = Table(store, etcd_prefix + "vmodels/", VModelRecord.decode, VModelRecord.encode)
    await models.start()
    await vmodels.start()
    try:
        yield models, vmodels
    finally:
        await models.stop()
        await vmodels.stop()


Tables = tuple[Table[ModelRecord], Table[VModelRecord]]


async def test_writes_records_of_two_tables_in_one_revision(store: Meddling, tables: Tables) -> None:
    models, vmodels = tables

    def fn(recs: list[Any]) -> list[Any]:
        assert recs == [None, None]
        return [ModelRecord(type="t", refs=1), VModelRecord(owner="o", active_model="m", target_model="m")]

    out = await update_many([(models, "m"), (vmodels, "v")], fn)
    assert out == [ModelRecord(type="t", refs=1), VModelRecord(owner="o", active_model="m", target_model="m")]
    # Read-your-writes on both mirrors, and both keys changed by the same revision.
    assert models.get("m") == ModelRecord(type="t", refs=1)
    assert vmodels.get("v") == VModelRecord(owner="o", active_model="m", target_model="m")
    assert models.entries["m"].mod_revision == vmodels.entries["v"].mod_revision
    assert store.txns == 1


async def test_conflict_retries_against_fresh_reads(store: Meddling, tables: Tables) -> None:
    models, vmodels = tables
    await update_many([(models, "m")], lambda recs: [ModelRecord(type="t", refs=1)])
    # Another writer bumps refs to 5 between our read and our transaction.
    store.before_txn.append((models.key("m"), ModelRecord(type="t", refs=5).encode()))
    seen: list[list[int]] = []

    def fn(recs: list[Any]) -> list[Any]:
        seen.append([recs[0].refs])
        recs[0].refs += 1
        return [recs[0], VModelRecord(active_model="m", target_model="m")]

    out = await update_many([(models, "m"), (vmodels, "v")], fn)
    assert seen == [[1], [5]]  # called again with the other writer's value
    assert out[0].refs == 6 and models.get("m").refs == 6  # type: ignore[union-attr]
    assert vmodels.get("v") is not None


async def test_a_key_compared_absent_conflicts_when_created_meanwhile(store: Meddling, tables: Tables) -> None:
    models, vmodels = tables
    store.before_txn.append((models.key("m"), ModelRecord(type="theirs").encode()))
    calls: list[Any] = []

    def fn(recs: list[Any]) -> list[Any]:
        calls.append(recs[1])
        if recs[1] is None:
            return [VModelRecord(active_model="m", target_model="m"), KEEP]  # leave "m" alone: must stay absent
        return [KEEP, KEEP]

    out = await update_many([(vmodels, "v"), (models, "m")], fn)
    assert calls[0] is None and calls[1].type == "theirs"
    assert out == [None, ModelRecord(type="theirs")]
    assert vmodels.get("v") is None and await store.get(vmodels.key("v")) is None


async def test_delete_and_put_together(tables: Tables) -> None:
    models, _ = tables
    await update_many(
        [(models, "a"), (models, "b")], lambda recs: [ModelRecord(type="a"), ModelRecord(type="b", refs=2)]
    )

    def fn(recs: list[Any]) -> list[Any]:
        recs[1].refs -= 1
        return [None, recs[1], None]  # delete a, update b, "delete" absent c (no-op)

    out = await update_many([(models, "a"), (models, "b"), (models, "c")], fn)
    assert out == [None, ModelRecord(type="b", refs=1), None]
    assert models.get("a") is None and models.get("b") == ModelRecord(type="b", refs=1)
    assert await models.store.get(models.key("a")) is None


async def test_keep_everything_writes_nothing(store: Meddling, tables: Tables) -> None:
    models, _ = tables
    await update_many([(models, "a")], lambda recs: [ModelRecord(type="a")])
    before = store.txns

    def fn(recs: list[Any]) -> list[Any]:
        recs[0].refs = 99  # mutating the given copy must not leak into the result
        return [KEEP, KEEP]

    out = await update_many([(models, "a"), (models, "b")], fn)
    assert out == [ModelRecord(type="a"), None]
    assert store.txns == before


async def test_corrupt_record_raises_and_nothing_is_written(store: Meddling, tables: Tables) -> None:
    models, vmodels = tables
    rev = await store.put(models.key("bad"), b"not json")
    await models.wait_for(rev)
    assert "bad" in models.corrupt
    called = []

    def fn(recs: list[Any]) -> list[Any]:
        called.append(1)
        return [VModelRecord(), ModelRecord(type="t")]

    with pytest.raises(RecordError):
        await update_many([(vmodels, "v"), (models, "bad")], fn)
    assert not called
    assert await store.get(vmodels.key("v")) is None
    kv = await store.get(models.key("bad"))
    assert kv is not None and kv.value == b"not json"


async def test_exception_from_fn_writes_nothing(store: Meddling, tables: Tables) -> None:
    models, vmodels = tables

    def fn(recs: list[Any]) -> list[Any]:
        raise LookupError("no")

    with pytest.raises(LookupError):
        await update_many([(vmodels, "v"), (models, "m")], fn)
    assert store.txns == 0 and await store.get(models.key("m")) is None


async def test_bad_calls_are_refused(tables: Tables) -> None:
    models, _ = tables
    assert await update_many([], lambda recs: []) == []
    with pytest.raises(ValueError, match="twice"):
        await update_many([(models, "a"), (models, "a")], lambda recs: [KEEP, KEEP])
    with pytest.raises(ValueError, match="results"):
        await update_many([(models, "a")], lambda recs: [KEEP, KEEP])
    other = Table(MemoryStore(), "/x/", ModelRecord.decode, ModelRecord.encode)
    with pytest.raises(ValueError, match="one store"):
        await update_many([(models, "a"), (other, "a")], lambda recs: [KEEP, KEEP])


async def test_gives_up_after_bounded_conflicts() -> None:
    inner = MemoryStore()
    store = Meddling(inner)
    models = Table(store, "/t/registry/", ModelRecord.decode, ModelRecord.encode)
    await models.start()
    try:
        store.always = (models.key("m"), ModelRecord(type="x").encode())
        with pytest.raises(StoreUnavailable, match="gave up"):
            await update_many([(models, "m")], lambda recs: [ModelRecord(type="t")])
        assert store.txns == MAX_CAS_ATTEMPTS
    finally:
        await models.stop()
        await inner.close()
