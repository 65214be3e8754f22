"""A lease kept alive by meshd (etcd's own keep-alive streams are not relied upon).

Keep-alives go out every TTL/3. When the store says the lease is gone (expired while etcd
or this process was unreachable), a new lease is granted and `on_new_lease` re-attaches
whatever the owner keeps on it, so an instance record comes back by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from meshd.kv.store import KVStore, LeaseExpired, StoreError

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(
        self, store: KVStore, ttl_s: int, on_new_lease: Callable[[int], Awaitable[None]] | None = None
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.on_new_lease = on_new_lease
        self.lease_id = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        self.lease_id = await self.store.grant_lease(self.ttl_s)
        self._task = asyncio.create_task(self._keep(), name="lease keep-alive")
        return self.lease_id

    async def _keep(self) -> None:
        interval = max(self.ttl_s / 3, 0.2)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.store.keep_alive(self.lease_id)
            except LeaseExpired:
                log.warning("lease %x expired; granting a new one", self.lease_id)
                await self._regrant()
            except StoreError as e:
                log.warning("lease keep-alive failed (will retry): %s", e)

    async def _regrant(self) -> None:
        try:
            self.lease_id = await self.store.grant_lease(self.ttl_s)
            if self.on_new_lease is not None:
                await self.on_new_lease(self.lease_id)
        except StoreError as e:
            log.warning("could not replace the lease yet: %s", e)

    async def stop(self, revoke: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if revoke and self.lease_id:
            with contextlib.suppress(StoreError):
                await self.store.revoke_lease(self.lease_id)
