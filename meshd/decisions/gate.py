"""The per-copy gate's rules (`limitModelConcurrency`), pure: how many requests may wait on a
copy and what an arriving request does (run, queue, refuse). `Gate` is what a cache entry
carries; `meshd.serving.gate.CopyGate` is the asyncio gate the daemon runs, and the simulator
applies the same rules on its virtual clock.
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol

# Upstream MM_MAX_INFLIGHT_PER_MODEL_COPY "auto": max(16, 8 x maxConcurrency) may wait.
MIN_AUTO_QUEUE = 16
AUTO_QUEUE_PER_SLOT = 8


def queue_bound(max_concurrency: int, configured: int) -> int | None:
    """Waiters allowed per copy: `configured` > 0 as is, 0 upstream's auto, < 0 unbounded."""
    if configured < 0:
        return None
    if configured > 0:
        return configured
    return max(MIN_AUTO_QUEUE, AUTO_QUEUE_PER_SLOT * max_concurrency)


class Arrival(Enum):
    """What a request arriving at a copy's gate does."""

    RUN = "run"  # a slot is free and nobody waits ahead of it
    QUEUE = "queue"  # wait in line (first come, first served)
    REFUSE = "refuse"  # the line is full: RESOURCE_EXHAUSTED, try another copy


def on_arrival(running: int, waiting: int, limit: int, max_queue: int | None) -> Arrival:
    """The gate's rule for an arrival (pure: the simulator applies it too)."""
    if running < limit and not waiting:
        return Arrival.RUN
    if max_queue is not None and waiting >= max_queue:
        return Arrival.REFUSE
    return Arrival.QUEUE


class Gate(Protocol):
    """A copy's gate as the cache entry carries it: the limit, the sums copy scaling reads
    (since the copy loaded), and the slot calls the router makes."""

    limit: int
    running: int
    queued_requests: int
    queue_ms: float
    completed: int
    service_ms: float

    async def enter(self) -> float: ...

    def leave(self, service_ms: float | None = None) -> None: ...
