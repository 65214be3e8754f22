"""The load queue: at most `maxLoadingConcurrency` loads at once, each under the runtime's
`modelLoadingTimeoutMs` counted from load start (not from queueing), and an `unloadModel`
after every cancelled, timed-out or failed load (the runtime expects it, SPEC §1).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from meshd.errors import LoadFailed
from meshd.runtime.client import LoadedModel, RuntimeClient, RuntimeInfo

log = logging.getLogger(__name__)


class LoadQueue:
    def __init__(self, client: RuntimeClient, info: RuntimeInfo) -> None:
        self.client = client
        self.timeout_s = info.loading_timeout_ms / 1000
        self.threads = info.max_loading_concurrency
        self._slots = asyncio.Semaphore(self.threads)
        self.waiting = 0
        self.in_progress = 0
        self._cleanup: set[asyncio.Task[None]] = set()

    async def load(self, model_id: str, model_type: str, path: str, key: str) -> LoadedModel:
        """Load through the queue; raises LoadFailed with the runtime's reason."""
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.in_progress += 1
        started = time.monotonic()
        try:
            return await self.client.load(model_id, model_type, path, key, self.timeout_s)
        except grpc.aio.AioRpcError as e:
            self._unload_after_failure(model_id)
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise LoadFailed(f"load of {model_id} timed out after {time.monotonic() - started:.1f}s") from None
            raise LoadFailed(f"runtime failed to load {model_id}: {e.code().name}: {e.details()}") from None
        except BaseException:
            self._unload_after_failure(model_id)  # cancelled: the runtime may hold a half-loaded model
            raise
        finally:
            self.in_progress -= 1
            self._slots.release()

    def _unload_after_failure(self, model_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._quiet_unload(model_id))
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    async def _quiet_unload(self, model_id: str) -> None:
        try:
            await self.client.unload(model_id)
        except grpc.aio.AioRpcError as e:
            log.warning("unload after failed load of %s failed: %s", model_id, e.details())

    async def drain(self) -> None:
        """Wait for pending post-failure unloads (shutdown)."""
        if self._cleanup:
            with contextlib.suppress(Exception):
                await asyncio.gather(*self._cleanup, return_exceptions=True)
