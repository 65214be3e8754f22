"""Carrying a stream: the request side (`Relay`) and the response side (`ResponseStream`).

gRPC pulls request messages from the relay on its own task; the handler iterates the
response side and always closes it, which cancels the outbound call if it is still
running and gives back what the stream holds (a slot on a copy, an in-flight count).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from meshd.core.errors import MeshError

POLLER_CANCEL_DELAY_S = 1.0  # the client's call has long finished by then


class Relay:
    """The client's request messages, on to the next hop.

    `on_message` may rewrite each message (id injection) and may raise MeshError, which
    ends the outbound call and is what the client sees. With `hold`, nothing is sent until
    `release()`: a peer must accept the stream first, so a refusal loses no message.
    """

    def __init__(
        self,
        first: bytes | None,
        rest: AsyncIterator[bytes],
        on_message: Callable[[bytes], bytes] | None,
        hold: bool = False,
    ) -> None:
        self.first = first
        self.rest = rest
        self.on_message = on_message
        self.error: MeshError | None = None
        self.call: Any = None  # set by ResponseStream, so an error can end the call
        self._go: asyncio.Event | None = asyncio.Event() if hold else None
        self._closed = False

    def release(self) -> None:
        if self._go is not None:
            self._go.set()

    def close(self) -> None:
        """Send nothing more: a held relay ends without a message, and grpc's task pulling
        from this relay is cancelled (it would otherwise wait forever on a client that has
        nothing more to send once the call has ended)."""
        self._closed = True
        if self._go is not None:
            self._go.set()
        poller = getattr(self.call, "_async_request_poller", None)  # grpc.aio's, if any
        if poller is not None and not poller.done():
            # Later, not now: cancelling its pending read while the client's call is still
            # finishing can make grpc answer "Internal error from Core" instead of our status.
            asyncio.get_running_loop().call_later(POLLER_CANCEL_DELAY_S, poller.cancel)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[bytes]:
        if self._go is not None:
            await self._go.wait()
        if self._closed:
            return
        on_message = self.on_message
        try:
            if self.first is not None:
                yield on_message(self.first) if on_message else self.first
            async for message in self.rest:
                yield on_message(message) if on_message else message
        except MeshError as e:
            self.error = e
            if self.call is not None:
                self.call.cancel()


class ResponseStream:
    """An opened stream's responses; `close()` exactly once when done with it."""

    def __init__(
        self,
        call: Any,
        relay: Relay,
        on_close: Callable[[], None],
        on_error: Callable[[grpc.aio.AioRpcError], None] | None = None,
    ) -> None:
        """`on_error`: told of the outbound call's non-OK status (before it is relayed)."""
        self.call = call
        self.relay = relay
        relay.call = call
        self._on_close: Callable[[], None] | None = on_close
        self._on_error = on_error

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[bytes]:
        try:
            async for response in self.call:
                yield response
        except BaseException as e:
            if self.relay.error is not None:  # our own refusal of a request message ended it
                raise self.relay.error from None
            if isinstance(e, grpc.aio.AioRpcError) and self._on_error is not None:
                self._on_error(e)
            raise
        if self.relay.error is not None:
            raise self.relay.error

    def close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            self.call.cancel()  # no-op once the call has ended
            self.relay.close()
            on_close()
