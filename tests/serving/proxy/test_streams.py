"""Relaying a stream: messages held until a peer accepts, a refused message ends the call
with that error, close() gives back what the stream holds exactly once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from meshd.core.errors import InvalidArgument
from meshd.serving.proxy.streams import Relay, ResponseStream


async def messages(*items: bytes) -> AsyncIterator[bytes]:
    for item in items:
        yield item


class FakeCall:
    """Stands in for a grpc.aio stream call: pulls the relay, answers each message upper-cased."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.cancelled = 0
        self._answers: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._pump = asyncio.ensure_future(self._consume())

    async def _consume(self) -> None:
        try:
            async for m in self.relay:
                await self._answers.put(m.upper())
        finally:
            await self._answers.put(None)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[bytes]:
        while (answer := await self._answers.get()) is not None:
            yield answer
        if self.cancelled:
            raise asyncio.CancelledError

    def cancel(self) -> bool:
        self.cancelled += 1
        return True


async def test_first_message_then_the_rest_rewritten() -> None:
    relay = Relay(b"a", messages(b"b", b"c"), lambda m: m + b"!")
    call = FakeCall(relay)
    closed: list[int] = []
    stream = ResponseStream(call, relay, lambda: closed.append(1))
    assert [r async for r in stream] == [b"A!", b"B!", b"C!"]
    stream.close()
    stream.close()
    assert closed == [1] and call.cancelled == 1


async def test_a_held_relay_sends_nothing_until_released() -> None:
    relay = Relay(None, messages(b"x"), None, hold=True)
    call = FakeCall(relay)
    await asyncio.sleep(0.01)
    assert call._answers.empty()  # nothing pulled yet
    relay.release()
    stream = ResponseStream(call, relay, lambda: None)
    assert [r async for r in stream] == [b"X"]


async def test_a_refused_message_ends_the_call_with_that_error() -> None:
    def refuse(m: bytes) -> bytes:
        if m == b"bad":
            raise InvalidArgument("request body is not valid protobuf")
        return m

    relay = Relay(None, messages(b"ok", b"bad", b"never"), refuse)
    call = FakeCall(relay)
    stream = ResponseStream(call, relay, lambda: None)
    got: list[bytes] = []
    with pytest.raises(InvalidArgument, match="not valid protobuf"):
        async for r in stream:
            got.append(r)
    assert got == [b"OK"] and call.cancelled == 1


async def test_a_closed_held_relay_ends_without_sending() -> None:
    relay = Relay(b"first", messages(b"x"), None, hold=True)
    pulled: list[bytes] = []

    async def pull() -> None:
        async for m in relay:
            pulled.append(m)

    task = asyncio.ensure_future(pull())
    await asyncio.sleep(0.01)
    relay.close()  # the peer refused: nothing of the client's may have been sent
    await asyncio.wait_for(task, 1)
    assert pulled == []
