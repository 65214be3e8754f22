"""The per-copy concurrency gate: limit, bounded queue, FIFO, cancellation never loses a slot."""

from __future__ import annotations

import asyncio

import pytest

from meshd.core.errors import ResourceExhausted
from meshd.serving.gate import CopyGate


def test_a_gate_needs_a_limit_of_one_or_more() -> None:
    with pytest.raises(ValueError):
        CopyGate("m", 0, None)


async def test_limit_queue_and_refusal() -> None:
    gate = CopyGate("m", limit=2, max_queue=1)
    assert await gate.enter() == 0.0
    assert await gate.enter() == 0.0
    waiter = asyncio.ensure_future(gate.enter())
    await asyncio.sleep(0)
    assert gate.waiting == 1 and not waiter.done()
    with pytest.raises(ResourceExhausted, match="2 requests running and 1 queued"):
        await gate.enter()
    gate.leave(5.0)  # the slot goes to the waiter, not back to the pool
    assert await waiter >= 0.0
    assert gate.running == 2 and gate.waiting == 0
    assert gate.queued_requests == 1 and gate.completed == 1 and gate.service_ms == 5.0
    gate.leave()
    gate.leave()
    assert gate.running == 0


async def test_waiters_are_served_in_order() -> None:
    gate = CopyGate("m", limit=1, max_queue=None)
    await gate.enter()
    order: list[int] = []

    async def wait(i: int) -> None:
        await gate.enter()
        order.append(i)

    tasks = [asyncio.ensure_future(wait(i)) for i in range(5)]
    await asyncio.sleep(0)
    for _ in range(5):
        gate.leave()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]
    gate.leave()
    assert gate.running == 0


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    gate = CopyGate("m", limit=1, max_queue=1)
    await gate.enter()
    waiter = asyncio.ensure_future(gate.enter())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.waiting == 0
    second = asyncio.ensure_future(gate.enter())  # the queue has room again
    await asyncio.sleep(0)
    gate.leave()
    await second
    assert gate.running == 1


async def test_a_slot_handed_to_a_waiter_cancelled_at_that_moment_is_passed_on() -> None:
    gate = CopyGate("m", limit=1, max_queue=None)
    await gate.enter()
    first = asyncio.ensure_future(gate.enter())
    second = asyncio.ensure_future(gate.enter())
    await asyncio.sleep(0)
    gate.leave()  # the slot goes to `first`...
    first.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await first
    await second  # the slot moved on to `second`, not lost
    assert gate.running == 1 and gate.waiting == 0
    gate.leave()
    assert gate.running == 0
