"""Following the runtime's disk tier (issue 42): what it keeps on its local disk, for the
instance record.

A runtime with a disk tier (meshd's adapters with the storage helper, docs/storage.md)
answers `meshd.disk.DiskTier/diskInventory` on its management endpoint. `DiskWatch` asks it
on a timer and keeps the record's `meshdDisk` value (`placement.disk.disk_value`: a Bloom
filter of the ids and the pull time per GiB), kicking the publisher when the set of models
changes (the answer's `version`). A runtime that answers UNIMPLEMENTED has no tier: the
watch stops asking and the record carries no key, as with upstream runtimes. A failed call
keeps the last value (the files do not leave a disk because one call failed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

import grpc

from meshd._proto.meshd import disk_pb2
from meshd.decisions.placement.disk import disk_value

log = logging.getLogger(__name__)

DISK_POLL_S = 5.0  # files change with pulls and evictions: seconds, not the request path


class DiskSource(Protocol):
    async def disk_inventory(self) -> disk_pb2.DiskInventoryResponse | None: ...


class DiskWatch:
    def __init__(self, runtime: DiskSource, interval_s: float = DISK_POLL_S) -> None:
        self.runtime = runtime
        self.interval_s = interval_s
        self.value: dict[str, Any] | None = None  # the record's meshdDisk (None: no tier, or not known yet)
        self.implemented: bool | None = None  # None: not asked yet
        self.on_change: Callable[[], None] | None = None
        self._version: int | None = None

    async def check(self) -> None:
        """Ask once; a changed answer updates the value and kicks the publisher."""
        try:
            resp = await self.runtime.disk_inventory()
        except grpc.aio.AioRpcError as e:
            log.debug("diskInventory failed (%s): keeping the last answer", e.code().name)
            return
        if resp is None:
            if self.implemented is not False:
                log.info("the runtime has no disk tier (diskInventory unimplemented)")
            self.implemented = False
            changed = self.value is not None
            self.value, self._version = None, None
        else:
            self.implemented = True
            if self._version is not None and resp.version == self._version and resp.version:
                return  # the runtime says its set of models is as it was
            value = disk_value((m.model_id, m.size_bytes, m.pull_ms) for m in resp.models)
            changed = value != self.value
            self.value, self._version = value, resp.version
        if changed and self.on_change is not None:
            self.on_change()

    async def run(self) -> None:
        while True:
            await self.check()
            if self.implemented is False:
                return  # no tier: nothing to follow
            await asyncio.sleep(self.interval_s)
