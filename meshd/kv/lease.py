"""A lease kept alive by meshd (etcd's own keep-alive streams are not relied upon).

Keep-alives go out every TTL/3, and at least every `RENEW_MAX_S`: peers read the renewals
as a heartbeat (`renew_every_s`; decisions.placement.liveness), so they must come often
whatever the TTL. When the store says the lease is gone (expired while etcd
or this process was unreachable), the lease is *lost*: `before_regrant` runs first (the
owner catches up on what changed while it was away; nothing of its own is on a lease
then, so there is nothing to keep alive), then a new lease is granted and `on_new_lease`
re-attaches whatever the owner keeps on it, so an instance record comes back by itself.
`lease_id` keeps the expired id until then: a put on it fails instead of outliving us.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from meshd.kv.store import KVStore, LeaseExpired, StoreError

log = logging.getLogger(__name__)

# before_regrant: a check that hangs must not keep the owner off a lease (out of the mesh) for good.
CHECK_TIMEOUT_S = 30.0
# A peer found unreachable is judged dead or cut off by how long ago it renewed its lease:
# this bounds how long that takes (one renewal a second per instance is nothing to etcd).
RENEW_MAX_S = 2.0


def renew_every_s(ttl_s: float) -> float:
    """How often an owner renews a lease of `ttl_s` (what peers expect of a live one)."""
    return max(min(ttl_s / 3, RENEW_MAX_S), 0.2)


class LeaseKeeper:
    def __init__(
        self,
        store: KVStore,
        ttl_s: int,
        on_new_lease: Callable[[int], Awaitable[None]] | None = None,
        before_regrant: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.on_new_lease = on_new_lease
        self.before_regrant = before_regrant
        self.lease_id = 0
        self.lost = False  # expired, and no new lease granted yet
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        self.lease_id = await self.store.grant_lease(self.ttl_s)
        self._task = asyncio.create_task(self._keep(), name="lease keep-alive")
        return self.lease_id

    def mark_lost(self, lease_id: int) -> None:
        """A put on `lease_id` found it expired: replace it at the next keep-alive tick."""
        if lease_id == self.lease_id and not self.lost:
            log.warning("lease %x expired; replacing it", lease_id)
            self.lost = True

    async def _keep(self) -> None:
        interval = renew_every_s(self.ttl_s)
        loop = asyncio.get_running_loop()
        retry = False
        while True:
            if not retry:
                await asyncio.sleep(interval)
            retry = False
            if self.lost:
                await self._regrant()
                continue
            started = loop.time()
            try:
                # At most one interval per try: a try stuck on an etcd member that went silent
                # must not outlive the lease. The store's own deadline fires first, so it moves
                # to the next member, and the next try (at once) goes there.
                async with asyncio.timeout(interval):
                    await self.store.keep_alive(self.lease_id, timeout_s=0.8 * interval)
            except LeaseExpired:
                self.mark_lost(self.lease_id)
                await self._regrant()
            except (StoreError, TimeoutError) as e:
                log.warning("lease keep-alive failed (will retry): %s", e or "no answer in time")
                # A try that waited its time out is retried at once; a refused one (etcd down:
                # answers at once) after the interval, so an outage does not spin.
                retry = loop.time() - started >= 0.75 * interval

    async def _regrant(self) -> None:
        if self.before_regrant is not None:
            try:
                async with asyncio.timeout(CHECK_TIMEOUT_S):
                    await self.before_regrant()
            except StoreError as e:
                # The check needs the store, and so does the grant: both again next tick.
                log.warning("check before replacing the lease failed (will retry): %s", e)
                return
            except TimeoutError:
                log.warning("check before replacing the lease took over %.0fs; replacing it anyway", CHECK_TIMEOUT_S)
            except Exception:
                log.exception("check before replacing the lease failed; replacing it anyway")
        try:
            lease_id = await self.store.grant_lease(self.ttl_s)
        except StoreError as e:
            log.warning("could not replace the lease yet: %s", e)
            return
        self.lease_id, self.lost = lease_id, False
        if self.on_new_lease is not None:
            try:
                await self.on_new_lease(lease_id)
            except StoreError as e:
                log.warning("could not re-attach to lease %x yet: %s", lease_id, e)

    async def stop(self, revoke: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if revoke and self.lease_id and not self.lost:
            with contextlib.suppress(StoreError):
                await self.store.revoke_lease(self.lease_id)
