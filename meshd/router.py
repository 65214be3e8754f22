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

from meshd.errors import DataLoss, InvalidArgument, NotFound, RuntimeStatusError, Unavailable
from meshd.kv.records import ModelRecord
from meshd.local import LocalModels
from meshd.proxy.headers import Metadata, RequestIds, runtime_metadata
from meshd.registry import Registry

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 8  # upstream's routing iterations per request (SPEC §6)

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

    def record(self, model_id: str) -> ModelRecord:
        rec = self.registry.get(model_id)
        if rec is None:
            corrupt = self.registry.corrupt_reason(model_id)
            if corrupt is not None:
                raise DataLoss(f"stored record for model {model_id!r} is corrupt and was left untouched: {corrupt}")
            raise NotFound(f"model {model_id!r} not found")
        return rec

    def _callable(self, method: str) -> UnaryCall:
        call = self._unary.get(method)
        if call is None:
            # Raw bytes both ways: no (de)serializer, the request is never parsed.
            call = self.channel.unary_unary(method, request_serializer=None, response_deserializer=None)
            self._unary[method] = call
        return call

    async def unary(
        self, method: str, request: bytes, ids: RequestIds, forward: Metadata, remaining_s: float | None
    ) -> bytes:
        """Forward one unary call; `remaining_s` is the client's deadline (None: none)."""
        self.local.counters.requests += 1
        model_id = self.resolve(ids)
        record = self.record(model_id)
        metadata = runtime_metadata(forward, model_id)
        call = self._callable(method)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            entry = await self.local.ensure(model_id, record)
            self.local.acquire(entry)
            try:
                response: bytes = await call(request, metadata=metadata, timeout=remaining_s)
                return response
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code == grpc.StatusCode.NOT_FOUND and attempt < MAX_ATTEMPTS:
                    # The runtime no longer has the copy (lost in a restart): reload and retry.
                    self.local.lost(model_id, entry)
                    continue
                if code == grpc.StatusCode.INTERNAL and "deserializ" in (e.details() or "").lower():
                    raise InvalidArgument(f"the runtime could not parse the request: {e.details()}") from None
                raise RuntimeStatusError(code, e.details() or code.name) from None
            finally:
                self.local.release(entry)
        raise Unavailable(f"model {model_id!r}: the runtime lost its copy on all {MAX_ATTEMPTS} attempts")
