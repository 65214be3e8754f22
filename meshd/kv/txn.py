"""Compare-and-set over several records at once: one etcd transaction, retried on conflict.

`Table.update` changes one record; changes that must land together (a vmodel and the
reference counts of the models it points at, SPEC §5) go through `update_many`. Every
key read is compared on its mod revision (0: absent), including the keys left as they
are, so a decision taken on records that changed meanwhile is never written: the loser
re-reads every key (linearizable reads) and decides again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from meshd.kv.store import Compare, Delete, KeyValue, Op, Put, StoreUnavailable
from meshd.kv.table import MAX_CAS_ATTEMPTS, Keep, Table

UpdateFn = Callable[[list[Any | None]], Sequence[Any | Keep | None]]


async def update_many(
    tables_and_ids: Sequence[tuple[Table[Any], str]],
    fn: UpdateFn,
) -> list[Any | None]:
    """Apply `fn` to fresh copies of several records and write the changes atomically.

    `fn` receives the current records in the order given (None: absent) and returns, for
    each, the new record, None to delete it, or KEEP to leave it untouched. It may be
    called several times (once per conflict) and must not have side effects beyond its
    arguments; exceptions it raises propagate and nothing is written. Returns the records
    as they are after the write (KEEP: the current record, a fresh copy).

    All tables must share one store. A corrupt stored value raises RecordError and
    nothing is written; StoreUnavailable after MAX_CAS_ATTEMPTS conflicting writes.
    On success each table's mirror has caught up with the write (read-your-writes).
    """
    if not tables_and_ids:
        return []
    store = tables_and_ids[0][0].store
    if any(table.store is not store for table, _ in tables_and_ids):
        raise ValueError("update_many: all tables must share one store")
    keys = [table.key(item_id) for table, item_id in tables_and_ids]
    if len(set(keys)) != len(keys):
        raise ValueError(f"update_many: a key is given twice: {keys}")

    kvs: list[KeyValue | None] = []
    for (table, item_id), key in zip(tables_and_ids, keys, strict=True):
        kv = table.mirrored(item_id)
        kvs.append(kv if kv is not None else await store.get(key))  # absent or corrupt here: ask the store

    for _ in range(MAX_CAS_ATTEMPTS):
        currents = [
            table._decode_or_raise(kv.value) if kv is not None else None
            for (table, _), kv in zip(tables_and_ids, kvs, strict=True)
        ]
        results = list(fn(currents))
        if len(results) != len(currents):
            raise ValueError(f"update_many: fn returned {len(results)} results for {len(currents)} records")
        compares = [Compare(key, kv.mod_revision if kv is not None else 0) for key, kv in zip(keys, kvs, strict=True)]
        ops: list[Op] = []
        written: list[Table[Any]] = []  # tables this write changes (each once)
        out: list[Any | None] = []
        for (table, _), key, kv, result in zip(tables_and_ids, keys, kvs, results, strict=True):
            if isinstance(result, Keep):
                # fn may have mutated the copy it was given: hand back an untouched one.
                out.append(table._decode_or_raise(kv.value) if kv is not None else None)
                continue
            if result is None:
                out.append(None)
                if kv is None:
                    continue  # already absent (the compare keeps it so)
                ops.append(Delete(key))
            else:
                ops.append(Put(key, table._encode(result)))
                out.append(result)
            if not any(table is t for t in written):
                written.append(table)
        if not ops:
            return out
        txn = await store.txn(compares, ops)
        if txn.succeeded:
            # A mirror only advances on changes under its own prefix: wait on those changed.
            for table in written:
                await table.wait_for(txn.revision)
            return out
        kvs = list(await asyncio.gather(*(store.get(key) for key in keys)))
    raise StoreUnavailable(f"gave up updating {keys} after {MAX_CAS_ATTEMPTS} conflicting writes")
