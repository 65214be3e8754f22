"""What the benchmark scripts share: the event loop they drive load with, and stopping
every child they started even when interrupted (SIGTERM is taken as Ctrl-C)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from types import FrameType
from typing import Any, TypeVar

from meshd.testing.cluster import LocalMesh

T = TypeVar("T")


def asyncio_run(coro: Coroutine[Any, Any, T]) -> T:
    """uvloop when available: the load generator should not be the bottleneck it can avoid being."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    result: T = uvloop.run(coro)
    return result


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def sigterm_as_interrupt() -> None:
    """SIGTERM takes the same path as Ctrl-C, so the finally blocks stop every child."""
    signal.signal(signal.SIGTERM, _raise_interrupt)


def stop_uninterrupted(mesh: LocalMesh) -> None:
    """mesh.stop() with SIGINT/SIGTERM held back until it is done.

    A second Ctrl-C (or the SIGTERM after one) arriving while children are being stopped
    would otherwise abort the stop half-way and leave the rest running; the held signal
    is delivered (as KeyboardInterrupt) once every child is gone.
    """
    held = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        mesh.stop()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
