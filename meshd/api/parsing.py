"""Registration of meshd's protobuf servicers so a request that does not parse is INVALID_ARGUMENT.

grpc's generated `add_*Servicer_to_server` deserializes each request before the servicer
runs; bytes that are not the request message (malformed protobuf, or a string field that is
not UTF-8) then end as UNKNOWN "Unexpected DecodeError" with a traceback in the log. Here each
method's deserializer turns such bytes into a `Malformed` value instead, and the call is
refused with INVALID_ARGUMENT naming the message type, before the servicer sees it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError  # type: ignore[import-untyped, unused-ignore]
from google.protobuf.message_factory import GetMessageClass  # type: ignore[import-untyped, unused-ignore]

__all__ = ["Malformed", "add_servicer", "tolerant_parser"]


class Malformed:
    """Stands for a request whose bytes did not parse; `reason` says what they should have been."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def tolerant_parser(message_class: Any) -> Callable[[bytes], Any]:
    """A request deserializer that never raises: bytes that do not parse give `Malformed`."""
    name = message_class.DESCRIPTOR.full_name

    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError:
            # upb's message carries no position; say what the usual causes are instead.
            return Malformed(
                f"request is not a valid {name} message (malformed protobuf, or a string field that is not UTF-8)"
            )

    return parse


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


def _checked(behaviour: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
    async def call(request: Any, context: Any) -> Any:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return await behaviour(request, context)

    return call


def add_servicer(server: grpc.aio.Server, service: Any, servicer: object) -> None:
    """Serve every method of `service` (a protobuf ServiceDescriptor, all methods unary) from
    the servicer's method of the same name.

    Replaces the generated `add_*Servicer_to_server`; the servicer still inherits the
    generated base class, which answers UNIMPLEMENTED for a method it does not override."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        if method.client_streaming or method.server_streaming:
            raise ValueError(f"{method.full_name} is streaming; add_servicer serves unary methods only")
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _checked(getattr(servicer, method.name)),
            request_deserializer=tolerant_parser(GetMessageClass(method.input_type)),
            response_serializer=_serialize,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
