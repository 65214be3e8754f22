"""Watch-fed in-memory mirror of one key prefix of records, with CAS update loops.

Reads are local (eventually consistent, like upstream); writes are compare-and-set on the
key's mod revision, retried on conflict against a fresh linearizable read. After a
successful write the caller may `wait_for(revision)` so its own mirror reflects it
(read-your-writes); `catch_up()` brings it to the store's current revision when a check
must not act on a lagging watch. The watch resumes after store outages (the store does that) and
re-lists after compaction, reporting the difference to listeners.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from meshd.core.records import RecordError
from meshd.kv.store import (
    PAGE_KEYS,
    Compacted,
    Delete,
    KeyValue,
    KVStore,
    StoreError,
    StoreUnavailable,
    prefix_pages,
    put_if,
)
from meshd.kv.store import Compare as _Compare

log = logging.getLogger(__name__)

R = TypeVar("R")

# Conflicting writers retry against a fresh read; beyond this something is wrong.
MAX_CAS_ATTEMPTS = 32
# A listing in pages starts again when compaction passes it; beyond this, give up (retried later).
RELIST_ATTEMPTS = 5


class Keep:
    """Returned by an update function to leave the record as it is."""


KEEP = Keep()


@dataclass(frozen=True, slots=True)
class Entry(Generic[R]):
    record: R
    mod_revision: int


class Table(Generic[R]):
    def __init__(
        self,
        store: KVStore,
        prefix: str,
        decode: Callable[[bytes], R],
        encode: Callable[[R], bytes],
        page_keys: int = PAGE_KEYS,
    ) -> None:
        if page_keys < 1:  # a page of none would list nothing and drop every record
            raise ValueError(f"page_keys must be at least 1, not {page_keys}")
        self.store = store
        self.page_keys = page_keys  # a (re-)listing reads this many keys per request
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self._decode = decode
        self._encode = encode
        self.entries: dict[str, Entry[R]] = {}
        self.corrupt: dict[str, str] = {}  # id -> why its stored value cannot be decoded
        self.revision = 0
        self.listeners: list[Callable[[str, R | None, R | None], None]] = []
        # Told the revision of each watch batch once applied (meshd.kv.watch_trace).
        self.on_applied: Callable[[int], None] | None = None
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self.synced = asyncio.Event()

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        await self._relist()
        self._task = asyncio.create_task(self._watch(), name=f"watch {self.prefix}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # ---- reads -----------------------------------------------------------------------
    def key(self, item_id: str) -> str:
        return self.prefix + item_id

    def get(self, item_id: str) -> R | None:
        entry = self.entries.get(item_id)
        return entry.record if entry is not None else None

    def __len__(self) -> int:
        return len(self.entries)

    def items(self) -> list[tuple[str, R]]:
        return [(k, e.record) for k, e in self.entries.items()]

    async def wait_for(self, revision: int, timeout_s: float = 10.0) -> None:
        """Return once the mirror has applied `revision` (read-your-writes)."""
        if self.revision >= revision:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((revision, fut))
        try:
            async with asyncio.timeout(timeout_s):
                await fut
        except TimeoutError:
            raise StoreUnavailable(f"mirror of {self.prefix} did not reach revision {revision}") from None

    async def catch_up(self) -> None:
        """Bring the mirror to at least the store's current revision (one range read).

        `wait_for` cannot serve here: the mirror's revision moves only with changes under
        its own prefix, so in a quiet prefix it would never reach the store's. Changes found
        reach listeners as with a re-list; the watch then skips what the read covered.
        """
        await self._relist()

    # ---- writes ----------------------------------------------------------------------
    async def update(self, item_id: str, fn: Callable[[R | None], R | Keep | None], lease: int = 0) -> R | None:
        """Apply `fn` to a fresh copy of the record (None: absent) and CAS the result.

        `fn` returns the new record, None to delete, or KEEP to write nothing. It may be
        called several times (once per conflict) and must not have side effects.
        Raises RecordError when the stored value is corrupt (nothing is overwritten).
        """
        key = self.key(item_id)
        kv = self.mirrored(item_id)
        if kv is None:
            kv = await self.store.get(key)
        for _ in range(MAX_CAS_ATTEMPTS):
            current = self._decode_or_raise(kv.value) if kv is not None else None
            result = fn(current)
            if isinstance(result, Keep):
                return current
            rev = kv.mod_revision if kv is not None else 0
            if result is None:
                if kv is None:
                    return None
                txn = await self.store.txn([_Compare(key, rev)], [Delete(key)])
            else:
                txn = await put_if(self.store, key, self._encode(result), rev, lease)
            if txn.succeeded:
                await self.wait_for(txn.revision)
                return result
            kv = await self.store.get(key)
        raise StoreUnavailable(f"gave up updating {key} after {MAX_CAS_ATTEMPTS} conflicting writes")

    def mirrored(self, item_id: str) -> KeyValue | None:
        """The record as this mirror holds it, as the store would return it (None: not held
        here, or corrupt: ask the store). Encoded again from the record rather than kept as
        stored: the mirror of 100,000 records then holds one copy of each, not two; decoding
        it gives the update a copy of its own to change."""
        entry = self.entries.get(item_id)
        if entry is None or item_id in self.corrupt:
            return None
        return KeyValue(self.key(item_id), self._encode(entry.record), entry.mod_revision, 0)

    def _decode_or_raise(self, value: bytes) -> R:
        try:
            return self._decode(value)
        except RecordError:
            raise
        except Exception as e:
            raise RecordError(f"{type(e).__name__}: {e}") from None

    # ---- mirror maintenance ------------------------------------------------------------
    def _apply(self, key: str, value: bytes | None, mod_revision: int) -> None:
        item_id = key[len(self.prefix) :]
        old = self.entries.get(item_id)
        new_record: R | None = None
        if value is None:
            self.entries.pop(item_id, None)
            self.corrupt.pop(item_id, None)
        else:
            try:
                new_record = self._decode(value)
            except Exception as e:  # RecordError, or anything a decoder did not foresee
                # Reported, never fatal: the id is listed as corrupt and skipped. Listeners
                # are not told: a corrupt overwrite is not a deletion (copies stay loaded).
                log.error("corrupt record at %s: %s", key, e)
                self.corrupt[item_id] = str(e)
                self.entries.pop(item_id, None)
                return
            else:
                self.corrupt.pop(item_id, None)
                self.entries[item_id] = Entry(new_record, mod_revision)
        old_record = old.record if old is not None else None
        if old_record is not None or new_record is not None:
            for listener in self.listeners:
                try:
                    listener(item_id, old_record, new_record)
                except Exception:
                    log.exception("listener failed for %s", key)

    def _advance(self, revision: int) -> None:
        if revision <= self.revision:
            return
        self.revision = revision
        still: list[tuple[int, asyncio.Future[None]]] = []
        for rev, fut in self._waiters:
            if rev <= revision:
                if not fut.done():
                    fut.set_result(None)
            elif not fut.done():
                still.append((rev, fut))
        self._waiters = still

    async def _relist(self) -> None:
        """Read the whole prefix (in pages, all as of one revision) and apply the difference.
        A listing whose revision is compacted away between two pages starts again at the
        store's current one (what it applied so far was newer than the mirror, so it stands)."""
        for attempt in range(RELIST_ATTEMPTS):
            try:
                await self._list_once()
                return
            except Compacted:
                if attempt == RELIST_ATTEMPTS - 1:
                    raise
                log.info("listing %s outlived its revision (compacted); listing again", self.prefix)

    async def _list_once(self) -> None:
        seen = set()
        revision = 0
        async with contextlib.aclosing(prefix_pages(self.store, self.prefix, self.page_keys)) as pages:
            async for kvs, revision in pages:
                if revision <= self.revision:
                    return  # the watch applied this much (or more) while a page was out
                for kv in kvs:
                    item_id = kv.key[len(self.prefix) :]
                    seen.add(item_id)
                    entry = self.entries.get(item_id)
                    if entry is None or entry.mod_revision != kv.mod_revision:
                        self._apply(kv.key, kv.value, kv.mod_revision)
        for item_id in [i for i in [*self.entries, *self.corrupt] if i not in seen]:
            self._apply(self.key(item_id), None, revision)
        self._advance(revision)
        self.synced.set()

    async def _watch(self) -> None:
        backoff = 0.1
        while True:
            try:
                async for batch in self.store.watch_prefix(self.prefix, self.revision + 1):
                    # Events a `catch_up` read already covered may still arrive: skip them.
                    events = [ev for ev in batch if ev.mod_revision > self.revision]
                    for ev in events:
                        self._apply(ev.key, ev.value if ev.kind == "put" else None, ev.mod_revision)
                    if events:
                        self._advance(events[-1].mod_revision)
                        if self.on_applied is not None:
                            self.on_applied(events[-1].mod_revision)
                    backoff = 0.1
            except Compacted:
                log.warning("watch on %s compacted; re-listing", self.prefix)
                await self._relist_until_ok()
            except StoreUnavailable as e:
                log.warning("watch on %s interrupted: %s", self.prefix, e)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            except asyncio.CancelledError:
                raise
            except Exception:
                # Never let the mirror freeze silently: log, re-list, and watch again.
                log.exception("watch on %s failed; re-listing", self.prefix)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                await self._relist_until_ok()
            else:
                return  # the store closed the watch (shutdown)

    async def _relist_until_ok(self) -> None:
        backoff = 0.1
        while True:
            try:
                await self._relist()
                return
            except StoreError:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
