"""Channels to peer instances' internal ports, one per live instance, made on first use.

A channel is replaced when the instance's advertised location changes and let go when its
record disappears (lease gone). Calls in flight on a channel let go are not cancelled: a lost
lease does not mean a stopped process (cut off from etcd only, starved past its TTL), and
cancelling would run the request twice. The channel's keepalive (meshd.runtime.endpoints)
fails them with UNAVAILABLE if the peer is truly frozen or unreachable; the channel closes
once its last call ends. Raw-bytes callables are cached per method. How a channel is opened
(plaintext, or mTLS from meshd.security.tls) is the assembly's choice.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from meshd.core.hostport import dial_target
from meshd.runtime.endpoints import peer_channel_options

MAX_CACHED_METHODS = 1024

Dial = Callable[[str, Sequence[tuple[str, Any]]], grpc.aio.Channel]


def dial_plaintext(location: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(location, options=options)


class RawCalls:
    """Raw-bytes callables on one channel, made once per method path: no (de)serializer,
    requests and responses are never parsed. Bounded, as method names may be client-chosen."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self._unary: dict[str, Callable[..., Any]] = {}
        self._streams: dict[str, Callable[..., Any]] = {}
        self._unary_streams: dict[str, Callable[..., Any]] = {}

    def unary(self, method: str) -> Callable[..., Any]:
        call = self._unary.get(method)
        if call is None:
            call = self.channel.unary_unary(method, request_serializer=None, response_deserializer=None)
            if len(self._unary) < MAX_CACHED_METHODS:
                self._unary[method] = call
        return call

    def unary_stream(self, method: str) -> Callable[..., Any]:
        """One request, answers streamed: cheaper in grpc.aio than a stream-stream call."""
        call = self._unary_streams.get(method)
        if call is None:
            call = self.channel.unary_stream(method, request_serializer=None, response_deserializer=None)
            if len(self._unary_streams) < MAX_CACHED_METHODS:
                self._unary_streams[method] = call
        return call

    def stream(self, method: str) -> Callable[..., Any]:
        call = self._streams.get(method)
        if call is None:
            call = self.channel.stream_stream(method, request_serializer=None, response_deserializer=None)
            if len(self._streams) < MAX_CACHED_METHODS:
                self._streams[method] = call
        return call


class PeerChannel(RawCalls):
    def __init__(self, location: str, max_message_bytes: int, dial: Dial = dial_plaintext) -> None:
        # `[v6]:port`, also for a record that wrote an IPv6 address without brackets
        super().__init__(dial(dial_target(location), peer_channel_options(max_message_bytes)))
        self.location = location
        self._calls: set[Any] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def track(self, call: Any) -> Any:
        """Remember a call in flight, so the channel outlives it once let go; returns the call."""
        self._calls.add(call)
        self._idle.clear()
        call.add_done_callback(self._done)
        return call

    def _done(self, call: Any) -> None:
        self._calls.discard(call)
        if not self._calls:
            self._idle.set()

    async def close_when_idle(self) -> None:
        await self._idle.wait()
        await self.channel.close()


class Peers:
    def __init__(self, max_message_bytes: int, dial: Dial = dial_plaintext) -> None:
        self.max_message_bytes = max_message_bytes
        self.dial = dial
        self._channels: dict[str, PeerChannel] = {}
        self._let_go: set[PeerChannel] = set()  # still carrying calls
        self._closing: set[asyncio.Task[None]] = set()

    def get(self, instance_id: str, location: str) -> PeerChannel:
        peer = self._channels.get(instance_id)
        if peer is None or peer.location != location:
            if peer is not None:
                self._let_go_of(peer)
            peer = self._channels[instance_id] = PeerChannel(location, self.max_message_bytes, self.dial)
        return peer

    def forget(self, instance_id: str) -> None:
        peer = self._channels.pop(instance_id, None)
        if peer is not None:
            self._let_go_of(peer)

    def _let_go_of(self, peer: PeerChannel) -> None:
        """No new calls; the channel closes when its calls end (answered, failed by keepalive,
        or past their deadline)."""
        self._let_go.add(peer)
        task = asyncio.get_running_loop().create_task(peer.close_when_idle())
        self._closing.add(task)

        def closed(t: asyncio.Task[None]) -> None:
            self._closing.discard(t)
            self._let_go.discard(peer)

        task.add_done_callback(closed)

    async def close(self) -> None:
        """Shutting down: every channel closes now, cancelling what it still carries."""
        for peer in [*self._channels.values(), *self._let_go]:
            with contextlib.suppress(Exception):
                await peer.channel.close()
        self._channels.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)
