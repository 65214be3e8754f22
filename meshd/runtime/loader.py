"""The load queue: at most `maxLoadingConcurrency` loads at once, each under the runtime's
`modelLoadingTimeoutMs` counted from load start (not from queueing).

A free loading thread goes to the waiting load of highest value (`value`, read when the
thread frees; the earliest queued among equals: first come, first served when every value is
the same), the rule of `meshd.decisions.placement.loading.next_load`. A caller may hold a
thread before it loads (`slot`, then `load(..., slot_held=True)`): meshd's load path takes
its room in the cache only once a thread is its own (issue 24).

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
from dataclasses import dataclass

import grpc

from meshd.core.errors import LoadFailed, Unavailable
from meshd.decisions.placement.loading import DEFAULT_MEAN_LOAD_MS, next_load, update_mean_load_ms
from meshd.decisions.placement.serving import AssumeLoaded, assume_loaded_ms
from meshd.observability.metrics import NO_METRICS, Metrics
from meshd.runtime.client import LoadedModel, LoadTimedOut, RuntimeClient, RuntimeInfo

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Waiter:
    model_id: str
    granted: asyncio.Future[None]
    since: int  # when it was queued (monotonic ms)
    value: Callable[[], float]


class LoadQueue:
    def __init__(
        self,
        client: RuntimeClient,
        info: RuntimeInfo,
        after_failure: Callable[[str], None],
        metrics: Metrics = NO_METRICS,
        *,
        pull_deadline_ms: int = 0,
    ) -> None:
        """`pull_deadline_ms`: a load may run past the loading timeout while the runtime's disk
        tier shows its model's pull running, up to this long (`decisions.load_deadline`; 0: never)."""
        self.client = client
        self.metrics = metrics
        self.timeout_s = info.loading_timeout_ms / 1000
        self.longest_s = pull_deadline_ms / 1000
        self.threads = info.max_loading_concurrency
        self.after_failure = after_failure
        self._free = self.threads
        self._waiters: dict[int, _Waiter] = {}
        self._order = 0
        self.in_progress = 0
        self.mean_load_ms = DEFAULT_MEAN_LOAD_MS  # of the loads that finished here
        self.finished = 0  # loads that finished here (the mean's weight follows it)
        # When a copy is probably loaded, learnt per model type from the loads finished here;
        # routing, the scaler and the native plane read it at each decision.
        self.assume_loaded = AssumeLoaded(assume_loaded_ms(info.loading_timeout_ms))

    @property
    def waiting(self) -> int:
        """Loads waiting for a loading thread."""
        return len(self._waiters)

    @property
    def busy(self) -> int:
        """Loading threads taken (loading, or held by a load about to start)."""
        return self.threads - self._free

    def waiting_models(self) -> list[tuple[str, int]]:
        """The loads waiting for a thread: (model, when queued, monotonic ms)."""
        return [(w.model_id, w.since) for w in self._waiters.values()]

    def displace(self, model_id: str, error: BaseException) -> bool:
        """Refuse a load still waiting for a thread (a more valuable one takes its place)."""
        for order, w in list(self._waiters.items()):
            if w.model_id == model_id and not w.granted.done():
                del self._waiters[order]
                w.granted.set_exception(error)
                w.granted.exception()  # retrieved here: the waiter sees it through its await
                return True
        return False

    async def slot(self, model_id: str, value: Callable[[], float] = lambda: 0.0) -> None:
        """Wait for a loading thread (the most valuable waiter gets the next one); the caller
        must then `load(..., slot_held=True)` or `release()`."""
        queued = time.monotonic()
        if self._free > 0 and not self._waiters:
            self._free -= 1
        else:
            self._order += 1
            order = self._order
            granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters[order] = _Waiter(model_id, granted, int(queued * 1000), value)
            try:
                await granted
            except asyncio.CancelledError:
                self._waiters.pop(order, None)
                if granted.done() and not granted.cancelled() and granted.exception() is None:
                    self.release()  # the thread was handed over as this waiter was cancelled
                raise
        self.metrics.loading_queue_delay((time.monotonic() - queued) * 1000, model_id)

    def release(self) -> None:
        """Give a loading thread back: to the most valuable waiter, else to the pool."""
        now_ms = int(time.monotonic() * 1000)
        # A waiter whose future is already done was cancelled and has not yet run its own
        # clean-up (it leaves the table on its next step): it cannot take the thread. Handing
        # it one raised InvalidStateError here, in a load's `finally`, and turned a load the
        # runtime had done into a failure (CI, 2026-11-29: a max-one model then loaded twice).
        live = ((w.value(), w.since, k) for k, w in self._waiters.items() if not w.granted.done())
        order = next_load(live, now_ms)
        if order is None:
            self._free += 1
            return
        self._waiters.pop(order).granted.set_result(None)

    async def load(self, model_id: str, model_type: str, path: str, key: str, slot_held: bool = False) -> LoadedModel:
        """Load through the queue (`slot_held`: the caller already holds a thread from
        `slot`); raises LoadFailed with the runtime's reason."""
        if not slot_held:
            await self.slot(model_id)
        self.in_progress += 1
        started = time.monotonic()
        try:
            loaded = await self.client.load(model_id, model_type, path, key, self.timeout_s, self.longest_s)
            took_ms = (time.monotonic() - started) * 1000
            self.metrics.load(took_ms, model_id)
            self.mean_load_ms = update_mean_load_ms(self.mean_load_ms, took_ms, self.finished)
            self.finished += 1
            self.assume_loaded.record(model_type, took_ms)
            return dataclasses.replace(loaded, load_ms=took_ms)
        except LoadTimedOut as e:
            self.after_failure(model_id)
            raise LoadFailed(f"load of {model_id} {e}") from None
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
            self.release()
