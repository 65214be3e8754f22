"""The reference point: a minimal raw-bytes grpc.aio proxy (what a bare Python proxy costs).

    python bench/bare_proxy.py --port P --target 127.0.0.1:R

Any unary method is forwarded to the target unchanged, as bytes (no (de)serialisation),
and KServe's bidirectional ModelStreamInfer message by message:
the client's metadata minus grpc-*/content-type/user-agent, and the client's deadline.
The upstream status (code, details, trailing metadata) is passed back on failure.
Nothing else: no routing, no model ids, no policy. `proxy_overhead.py` compares meshd
with this to separate meshd's own cost from the cost of being a Python gRPC hop at all.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

MAX_MESSAGE_BYTES = 64 << 20
_DROP_PREFIXES = ("grpc-",)
_DROP_KEYS = frozenset({"content-type", "user-agent", ":authority", "te"})

Handler = Callable[[bytes, Any], Awaitable[bytes]]
STREAMING = frozenset({"/inference.GRPCInferenceService/ModelStreamInfer"})


def _forwarded(metadata: Sequence[tuple[str, str | bytes]] | None) -> tuple[tuple[str, str | bytes], ...]:
    if not metadata:
        return ()
    return tuple((k, v) for k, v in metadata if k not in _DROP_KEYS and not k.startswith(_DROP_PREFIXES))


class ProxyHandler(grpc.GenericRpcHandler):  # type: ignore[misc]
    """Makes one raw-bytes unary handler per method path and caches it."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel
        self._handlers: dict[str, Any] = {}

    def service(self, handler_call_details: Any) -> Any:
        method: str = handler_call_details.method
        handler = self._handlers.get(method)
        if handler is None:
            if method in STREAMING:
                handler = grpc.stream_stream_rpc_method_handler(self._stream(method))
            else:
                handler = grpc.unary_unary_rpc_method_handler(
                    self._unary(method), request_deserializer=None, response_serializer=None
                )
            self._handlers[method] = handler
        return handler

    def _stream(self, method: str) -> Callable[[AsyncIterator[bytes], Any], AsyncIterator[bytes]]:
        upstream = self._channel.stream_stream(method)

        async def handle(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            call = upstream(
                requests, metadata=_forwarded(context.invocation_metadata()), timeout=context.time_remaining()
            )
            try:
                async for response in call:
                    yield response
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details() or "")
            finally:
                call.cancel()

        return handle

    def _unary(self, method: str) -> Handler:
        # request_serializer / response_deserializer None: bytes in, bytes out.
        upstream = self._channel.unary_unary(method)

        async def handle(request: bytes, context: Any) -> bytes:
            try:
                response: bytes = await upstream(
                    request,
                    metadata=_forwarded(context.invocation_metadata()),
                    timeout=context.time_remaining(),
                )
                return response
            except grpc.aio.AioRpcError as e:
                trailing = e.trailing_metadata()
                await context.abort(e.code(), e.details() or "", _forwarded(trailing) if trailing else ())
                raise  # unreachable: abort raises

        return handle


async def serve(port: int, target: str, host: str = "127.0.0.1") -> None:
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    channel = grpc.aio.insecure_channel(target, options=options)
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers((ProxyHandler(channel),))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise SystemExit(f"bare_proxy: cannot bind {host}:{port}")
    await server.start()
    print(f"bare_proxy: {host}:{bound} -> {target}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1.0)
    await channel.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bare_proxy.py", description="Minimal raw-bytes grpc.aio unary proxy.")
    p.add_argument("--port", type=int, required=True, help="port to listen on (127.0.0.1)")
    p.add_argument("--target", required=True, help="upstream host:port (or unix:PATH)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--no-uvloop", action="store_true", help="use the default asyncio event loop")
    a = p.parse_args(argv)
    coro = serve(a.port, a.target, a.host)
    if not a.no_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            uvloop.run(coro)
            return 0
    asyncio.run(coro)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
