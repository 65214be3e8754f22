"""The generic gRPC handler that carries any allowed runtime method as raw bytes.

Thin: parse the headers, hand the call to the router, map MeshError to a status.
Method handlers are made once per method path and cached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from meshd.errors import MeshError
from meshd.proxy.headers import parse_request_headers
from meshd.router import Router

# Never reachable through the inference path (SPEC §1), whatever the runtime allows.
FORBIDDEN_PREFIXES = ("/mmesh.ModelRuntime/", "/mmesh.ModelMesh/", "/meshd.peer.")
# Streaming methods are carried by the data-plane issue; until then they are refused
# rather than mangled by a unary handler.
STREAMING_METHODS = frozenset({"/inference.GRPCInferenceService/ModelStreamInfer"})
MAX_CACHED_METHODS = 1024  # bounds memory when any method is allowed


class MethodPolicy:
    """Which methods the runtime allows (its methodInfos allow-list, SPEC §1)."""

    def __init__(self, method_names: set[str], allow_any: bool) -> None:
        self.names = {"/" + m.lstrip("/") for m in method_names}
        self.allow_any = allow_any or not method_names

    def allowed(self, method: str) -> bool:
        if method.startswith(FORBIDDEN_PREFIXES) or method in STREAMING_METHODS:
            return False
        return self.allow_any or method in self.names


class RawMethodHandler(grpc.GenericRpcHandler):  # type: ignore[misc]
    """A raw-bytes unary handler per allowed method path, made once and cached."""

    def __init__(self, router: Router, policy: MethodPolicy) -> None:
        self.router = router
        self.policy = policy
        self._handlers: dict[str, Any] = {}

    def service(self, handler_call_details: Any) -> Any:
        method: str = handler_call_details.method
        handler = self._handlers.get(method)
        if handler is None:
            if not self.policy.allowed(method):
                return None  # grpc answers UNIMPLEMENTED
            handler = grpc.unary_unary_rpc_method_handler(self._unary(method))
            if len(self._handlers) < MAX_CACHED_METHODS:
                self._handlers[method] = handler
        return handler

    def _unary(self, method: str) -> Callable[[bytes, Any], Any]:
        raise NotImplementedError


class InferenceHandler(RawMethodHandler):
    """External port: client calls, routed by the model they name."""

    def _unary(self, method: str) -> Callable[[bytes, Any], Any]:
        router = self.router

        async def handle(request: bytes, context: Any) -> bytes:
            try:
                ids, forward = parse_request_headers(context.invocation_metadata())
                return await router.unary(method, request, ids, forward, context.time_remaining())
            except MeshError as e:
                await context.abort(e.code, e.message)
                raise  # unreachable: abort raises

        return handle
