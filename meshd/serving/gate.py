"""A copy's concurrency gate (`limitModelConcurrency`) on asyncio: at most `limit` requests run
on a copy at once, at most `max_queue` wait, the rest are refused at once (RESOURCE_EXHAUSTED),
by the rules in `meshd.decisions.gate`.

Waiters are served first come, first served; a waiter cancelled (client gone, deadline
passed) leaves the queue, and a slot handed to it just before is passed on, never lost.
The gate also keeps the figures copy scaling reads: how long requests queued and how long
they ran, summed since the copy loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

from meshd.core.errors import ResourceExhausted
from meshd.decisions.gate import Arrival, on_arrival


class CopyGate:
    def __init__(self, model_id: str, limit: int, max_queue: int | None) -> None:
        if limit < 1:
            raise ValueError("a concurrency limit is at least 1")
        self.model_id = model_id
        self.limit = limit
        self.max_queue = max_queue
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        # Sums since the copy loaded; the scaler samples their deltas.
        self.queued_requests = 0
        self.queue_ms = 0.0
        self.completed = 0
        self.service_ms = 0.0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def enter(self) -> float:
        """Take a slot, waiting in line if need be; returns the queue delay in ms."""
        arrival = on_arrival(self.running, len(self._waiters), self.limit, self.max_queue)
        if arrival is Arrival.RUN:
            self.running += 1
            return 0.0
        if arrival is Arrival.REFUSE:
            raise ResourceExhausted(
                f"model {self.model_id!r}: {self.running} requests running and {len(self._waiters)} "
                f"queued on this copy (its limits); try again later"
            )
        started = time.monotonic()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.leave()  # the slot was handed over as we were cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):  # leave() may have popped it already
                    self._waiters.remove(fut)
            raise
        waited = (time.monotonic() - started) * 1000
        self.queued_requests += 1
        self.queue_ms += waited
        return waited

    def leave(self, service_ms: float | None = None) -> None:
        """Give the slot back (to the next waiter, if any)."""
        if service_ms is not None:
            self.completed += 1
            self.service_ms += service_ms
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot moves to that waiter; `running` is unchanged
                return
        self.running -= 1
