"""Routes one inference call to a copy of its model and forwards the raw bytes.

On this (single-instance) path: resolve vmodel to model, find the record, make sure a
local copy is loaded (loading on a miss), forward, and reload when the runtime says the
copy is gone. The mesh issue adds peers, reroute and retry across instances here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc

from meshd.errors import InvalidArgument, NotFound, RuntimeStatusError, Unavailable
from meshd.local import LocalModels
from meshd.proxy.headers import Metadata, RequestIds, runtime_metadata
from meshd.registry import Registry

log = logging.getLogger(__name__)

MAX_CACHED_METHODS = 1024  # bounds memory when any method is allowed

UnaryCall = Callable[..., Any]


class Router:
    def __init__(self, local: LocalModels, registry: Registry, serving_channel: grpc.aio.Channel) -> None:
        self.local = local
        self.registry = registry
        self.channel = serving_channel
        self._unary: dict[str, UnaryCall] = {}

    def resolve(self, ids: RequestIds) -> str:
        if ids.model_id is not None:
            return ids.model_id
        assert ids.vmodel_id is not None
        vrec = self.registry.vmodels.get(ids.vmodel_id)
        if vrec is None:
            raise NotFound(f"vmodel {ids.vmodel_id!r} not found")
        if not vrec.active_model:
            raise Unavailable(f"vmodel {ids.vmodel_id!r} has no active model yet")
        return vrec.active_model

    def _callable(self, method: str) -> UnaryCall:
        call = self._unary.get(method)
        if call is None:
            # Raw bytes both ways: no (de)serializer, the request is never parsed.
            call = self.channel.unary_unary(method, request_serializer=None, response_deserializer=None)
            if len(self._unary) < MAX_CACHED_METHODS:  # method names may be client-chosen
                self._unary[method] = call
        return call

    async def unary(
        self, method: str, request: bytes, ids: RequestIds, forward: Metadata, remaining_s: float | None
    ) -> bytes:
        """Forward one unary call; `remaining_s` is the client's deadline (None: none)."""
        self.local.counters.requests += 1
        model_id = self.resolve(ids)
        record = self.registry.require(model_id)
        metadata = runtime_metadata(forward, model_id)
        call = self._callable(method)
        reloaded = False
        while True:
            entry = await self.local.ensure(model_id, record)
            self.local.acquire(entry)
            try:
                response: bytes = await call(request, metadata=metadata, timeout=remaining_s)
                return response
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code == grpc.StatusCode.NOT_FOUND and not reloaded:
                    # The runtime may have lost the copy (it restarted): reload once and retry.
                    # A NOT_FOUND from a fresh copy is the runtime's own answer (an unknown
                    # version, say) and goes to the client unchanged.
                    self.local.lost(model_id, entry)
                    reloaded = True
                    continue
                if code == grpc.StatusCode.INTERNAL and "deserializ" in (e.details() or "").lower():
                    raise InvalidArgument(f"the runtime could not parse the request: {e.details()}") from None
                raise RuntimeStatusError(code, e.details() or code.name) from None
            finally:
                self.local.release(entry)
