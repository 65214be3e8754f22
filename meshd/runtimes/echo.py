"""`meshd.demo.Echo`: one method of each gRPC shape, on raw bytes, for any loaded model.

It lets tests and benchmarks drive every RPC shape through meshd: each answer starts with
the model id the runtime was asked for (header `mm-model-id[-bin]`), so a test sees which
model served it. `Stats` (not announced, so not reachable through meshd) reports how many
requests started, finished and were cancelled, so tests can see a cancel reach the runtime;
`LastTrace` (not announced either) the W3C trace headers (`traceparent`, `tracestate`) of
the last Echo call, so tests can see which trace context reached the runtime.

    Unary          body               -> b"<model>|<body>"
    ServerStream   body               -> b"<model>|<body>|0", ...|1, ...|2
    ClientStream   bodies...          -> b"<model>|<b1>,<b2>,..."
    Bidi           body, body, ...    -> b"<model>|<body>" for each, as it arrives;
                   a body b"abort:<STATUS>" ends the stream with that status (e.g. abort:INVALID_ARGUMENT)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc

from meshd.runtimes.demo_server import RpcFailure, RuntimeState, header_model_id

SERVICE = "meshd.demo.Echo"
STREAMING = ("ServerStream", "ClientStream", "Bidi")
SERVER_STREAM_REPLIES = 3
TRACE_HEADERS = ("traceparent", "tracestate")


def dataplane_streaming() -> dict[str, dict[str, bool]]:
    """meshd's dataplane rpcConfigs declaring the streaming Echo methods."""
    return {f"{SERVICE}/{m}": {"streaming": True} for m in STREAMING}


class EchoService:
    def __init__(self, state: RuntimeState) -> None:
        self.state = state
        self.last_trace: dict[str, str] = {}  # trace headers of the last call, for LastTrace

    async def _model(self, context: Any) -> bytes:
        """The loaded model the call names; aborts (INVALID_ARGUMENT, NOT_FOUND) otherwise."""
        self.last_trace = {k: v for k, v in context.invocation_metadata() if k in TRACE_HEADERS}
        try:
            model_id = header_model_id(context)
            if not model_id:
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "no model named: set mm-model-id")
            self.state.get(model_id)  # NOT_FOUND unless loaded
        except RpcFailure as e:
            await context.abort(e.code, e.details)
            raise AssertionError("abort returned") from e
        return model_id.encode()

    async def _delay(self) -> None:
        if self.state.config.infer_delay_ms:
            await asyncio.sleep(self.state.config.infer_delay_ms / 1000)

    async def Unary(self, body: bytes, context: Any) -> bytes:
        with self.state.counting():
            model = await self._model(context)
            await self._delay()
            return model + b"|" + body

    async def ServerStream(self, body: bytes, context: Any) -> AsyncIterator[bytes]:
        model = await self._model(context)
        with self.state.counting():
            for i in range(SERVER_STREAM_REPLIES):
                await self._delay()
                yield model + b"|" + body + b"|" + str(i).encode()

    async def ClientStream(self, bodies: AsyncIterator[bytes], context: Any) -> bytes:
        model = await self._model(context)
        with self.state.counting():
            received = [b async for b in bodies]
            await self._delay()
            return model + b"|" + b",".join(received)

    async def Bidi(self, bodies: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        model = await self._model(context)
        with self.state.counting():
            async for body in bodies:
                if body.startswith(b"abort:"):
                    name = body[6:].decode(errors="replace")
                    code = grpc.StatusCode.__members__.get(name)
                    if code is None or code is grpc.StatusCode.OK:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no status {name!r} to fail with")
                    else:
                        await context.abort(code, f"asked to fail with {code.name}")
                await self._delay()
                yield model + b"|" + body

    async def Stats(self, body: bytes, context: Any) -> bytes:
        return json.dumps(self.state.counters).encode()

    async def LastTrace(self, body: bytes, context: Any) -> bytes:
        return json.dumps(self.last_trace).encode()

    def handler(self) -> Any:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Unary": grpc.unary_unary_rpc_method_handler(self.Unary),
                "ServerStream": grpc.unary_stream_rpc_method_handler(self.ServerStream),
                "ClientStream": grpc.stream_unary_rpc_method_handler(self.ClientStream),
                "Bidi": grpc.stream_stream_rpc_method_handler(self.Bidi),
                "Stats": grpc.unary_unary_rpc_method_handler(self.Stats),
                "LastTrace": grpc.unary_unary_rpc_method_handler(self.LastTrace),
            },
        )
