"""This instance's record in `instances/` (SPEC §5), on its lease, republished on SPEC §6's
cadence: when it changed materially, at most every 2 s, at least every 40 s while
changed, and right after loads; and written back when the stored value is no longer
the one published (overwritten or deleted behind meshd's back: peers would stop seeing
this instance), judged only once the instances mirror has caught up with the last put.
A record left by another process with the same instance id is reported, not fought.
After a lost lease the record returns only once the rejoin check has run.
What the record says and when it is due are decided in `meshd.decisions.publishing`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from meshd.core.clock import Clock, wall_ms
from meshd.core.records import InstanceRecord
from meshd.decisions.publishing import Stored, judge_stored, publish_due
from meshd.kv.lease import LeaseKeeper
from meshd.kv.store import KVStore, LeaseExpired, StoreError
from meshd.kv.table import Table

log = logging.getLogger(__name__)

PUBLISH_TICK_S = 0.5
INSTANCE_LEASE_TTL_S = 20  # upstream etcd session TTL


class InstancePublisher:
    """Keeps `instances/<id>` current on the instance's lease."""

    def __init__(
        self,
        store: KVStore,
        key: str,
        build: Callable[[], InstanceRecord],
        ttl_s: int,
        clock: Clock = wall_ms,
        mirror: Table[InstanceRecord] | None = None,
    ) -> None:
        """`mirror`: the instances table (`key` lies under its prefix), to write the record
        back when it goes missing or is overwritten."""
        if mirror is not None and not key.startswith(mirror.prefix):
            raise ValueError(f"{key} is not under {mirror.prefix}")
        self.store = store
        self.key = key
        self.build = build
        self.mirror = mirror
        self._mirror_id = key[len(mirror.prefix) :] if mirror is not None else ""
        self._restoring = False
        self._foreign_seen: set[tuple[int, str]] = set()
        self.clock = clock
        self.lease = LeaseKeeper(store, ttl_s, on_new_lease=self._republish, before_regrant=self._before_rejoin)
        # Run before the record returns after a lost lease (the instance was gone for peers).
        self.before_rejoin: Callable[[], Awaitable[object]] | None = None
        self.last: InstanceRecord | None = None
        self.last_ms = 0
        self._put_revision = 0
        self._lock = asyncio.Lock()  # one put at a time: `last` and its revision stay paired
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.lease.start()
        await self._put(self.build())
        self._task = asyncio.create_task(self._run(), name="instance record")

    def kick(self) -> None:
        """Publish soon (after a load or an eviction), still at most every 2 s."""
        self._kick.set()

    async def _run(self) -> None:
        # A plain ticker: a kick is honoured at the next tick once 2 s have passed since
        # the last publish. (Waiting on the kick event instead spun while a kick was not
        # yet due, and 3.11's wait_for can swallow a cancellation that races its event.)
        while True:
            await asyncio.sleep(PUBLISH_TICK_S)
            if self.lease.lost:
                continue  # the record returns with the new lease, after the rejoin check
            async with self._lock:
                forced = self._kick.is_set() or self._write_back_due()
                record = self.build()
                if publish_due(self.last, record, self.last_ms, self.clock(), forced):
                    self._kick.clear()
                    await self._publish(record)

    def _write_back_due(self) -> bool:
        """Whether the stored record must be written again (gone, or changed behind our back)."""
        if self.mirror is None or self.last is None:
            return False
        stored = self.mirror.get(self._mirror_id)
        verdict = judge_stored(self.last, self._put_revision, self.mirror.revision, stored)
        if verdict is Stored.LAGGING:
            return False
        if verdict is Stored.FOREIGN and stored is not None:
            who = (stored.start_time, stored.location)
            if who not in self._foreign_seen:
                self._foreign_seen.add(who)
                log.error(
                    "instance record at %s was written by another process with this instance id "
                    "(at %s, started %d); not writing it back: give each instance its own id",
                    self.key,
                    stored.location,
                    stored.start_time,
                )
        restoring = verdict in (Stored.GONE, Stored.CHANGED)
        if restoring and not self._restoring:
            how = "deleted" if verdict is Stored.GONE else "overwritten"
            log.warning("instance record at %s was %s; writing it again", self.key, how)
        self._restoring = restoring
        return restoring

    async def publish_now(self) -> None:
        """Publish at once, outside the cadence (the shutdown flag must reach peers now)."""
        if self.lease.lost:
            return  # no record to update; it returns after the rejoin check
        async with self._lock:
            await self._put(self.build())

    async def _publish(self, record: InstanceRecord) -> None:
        lease_id = self.lease.lease_id
        try:
            await self._put(record)
        except LeaseExpired:
            self.lease.mark_lost(lease_id)
            if not self.lease.lost:
                self.last = None  # the lease was replaced meanwhile: publish on the new one
        except StoreError as e:
            log.warning("could not publish the instance record: %s", e)
            self.last = None  # publish again as soon as the store answers

    async def _put(self, record: InstanceRecord) -> None:
        revision = await self.store.put(self.key, record.encode(), lease=self.lease.lease_id)
        self.last, self.last_ms, self._put_revision = record, self.clock(), revision

    async def _before_rejoin(self) -> None:
        if self.before_rejoin is not None:
            await self.before_rejoin()

    async def _republish(self, lease_id: int) -> None:
        async with self._lock:
            await self._put(self.build())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        # Revoking the lease deletes the record at once: peers stop routing here.
        await self.lease.stop(revoke=True)
