"""The load queue: at most `maxLoadingConcurrency` loads at once, each under the runtime's
`modelLoadingTimeoutMs` counted from load start (not from queueing).

Every cancelled, timed-out or failed load is followed by an `unloadModel` (the runtime
expects it, SPEC §1). The queue does not send it itself: it calls `after_failure`, so the
owner can order that unload with any later load of the same model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import grpc

from meshd.core.errors import LoadFailed, Unavailable
from meshd.observability.metrics import NO_METRICS, Metrics
from meshd.runtime.client import LoadedModel, RuntimeClient, RuntimeInfo

log = logging.getLogger(__name__)


class LoadQueue:
    def __init__(
        self,
        client: RuntimeClient,
        info: RuntimeInfo,
        after_failure: Callable[[str], None],
        metrics: Metrics = NO_METRICS,
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.timeout_s = info.loading_timeout_ms / 1000
        self.threads = info.max_loading_concurrency
        self.after_failure = after_failure
        self._slots = asyncio.Semaphore(self.threads)
        self.waiting = 0
        self.in_progress = 0

    async def load(self, model_id: str, model_type: str, path: str, key: str) -> LoadedModel:
        """Load through the queue; raises LoadFailed with the runtime's reason."""
        self.waiting += 1
        queued = time.monotonic()
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.in_progress += 1
        started = time.monotonic()
        self.metrics.loading_queue_delay((started - queued) * 1000, model_id)
        try:
            loaded = await self.client.load(model_id, model_type, path, key, self.timeout_s)
            took_ms = (time.monotonic() - started) * 1000
            self.metrics.load(took_ms, model_id)
            return dataclasses.replace(loaded, load_ms=took_ms)
        except grpc.aio.AioRpcError as e:
            self.after_failure(model_id)
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise LoadFailed(f"load of {model_id} timed out after {time.monotonic() - started:.1f}s") from None
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                # The runtime (or the server behind an adapter) is down, not the model at
                # fault: not recorded as the model's failure, so it loads once it is back.
                raise Unavailable(f"the runtime could not load {model_id} now: {e.details()}") from None
            raise LoadFailed(f"runtime failed to load {model_id}: {e.code().name}: {e.details()}") from None
        except BaseException:
            self.after_failure(model_id)  # cancelled: the runtime may hold a half-loaded model
            raise
        finally:
            self.in_progress -= 1
            self._slots.release()
