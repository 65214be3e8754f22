"""The ModelMesh management operations (SPEC §2) on one core object.

The gRPC servicer only converts messages; validation, registry writes and loading
decisions happen here, so other transports (CLI, HTTP) can share them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from collections.abc import Set as AbstractSet

from meshd.core.clock import Clock, wall_ms
from meshd.core.errors import LoadFailed, MeshError
from meshd.core.records import ModelRecord
from meshd.decisions.ids import ModelInfo, check_id
from meshd.decisions.status import ModelStatus, StatusView, model_status
from meshd.registry.models import Registry, default_last_used
from meshd.serving.local import LocalModels


class Management:
    def __init__(
        self,
        instance_id: str,
        registry: Registry,
        local: LocalModels,
        failure_expiry_ms: int,
        clock: Clock = wall_ms,
        live_instances: Callable[[], AbstractSet[str]] | None = None,
    ) -> None:
        self.live_instances = live_instances
        self.instance_id = instance_id
        self.registry = registry
        self.local = local
        self.failure_expiry_ms = failure_expiry_ms
        self.clock = clock

    def status(self, model_id: str) -> StatusView:
        check_id(model_id)
        record = self.registry.get(model_id)
        if record is None and self.registry.corrupt_reason(model_id) is not None:
            self.registry.require(model_id)  # raises DATA_LOSS naming the problem
        return model_status(
            record,
            self.local.view(model_id),
            self.instance_id,
            self.clock(),
            self.failure_expiry_ms,
            self.live_instances() if self.live_instances is not None else None,
        )

    async def register(
        self, model_id: str, info: ModelInfo, load_now: bool, sync: bool, last_used_ms: int
    ) -> StatusView:
        check_id(model_id)
        info.check()
        last_used = last_used_ms or default_last_used(self.clock(), load_now)
        record = await self.registry.register(model_id, info, last_used)
        if load_now:
            await self._load(model_id, record, last_used, sync)
        return self.status(model_id)

    async def unregister(self, model_id: str) -> None:
        check_id(model_id)
        if await self.registry.unregister(model_id) is not None:
            self.local.drop(model_id)

    async def ensure_loaded(self, model_id: str, last_used_ms: int, sync: bool) -> StatusView:
        check_id(model_id)
        record = self.registry.require(model_id)
        await self._load(model_id, record, last_used_ms or self.clock(), sync)
        return self.status(model_id)

    def model_ids(self) -> list[str]:
        """Every registered model (the KServe repository index)."""
        return [model_id for model_id, _ in self.registry.models.items()]

    async def load(self, model_id: str) -> StatusView:
        """KServe RepositoryModelLoad: loaded somewhere already, or loaded here now (waits)."""
        view = self.status(model_id)
        if view.status is ModelStatus.NOT_FOUND:
            self.registry.require(model_id)  # NOT_FOUND (or DATA_LOSS) naming the model
        if view.status is ModelStatus.LOADED:
            return view
        return await self.ensure_loaded(model_id, self.clock(), sync=True)

    async def _load(self, model_id: str, record: ModelRecord, last_used_ms: int, sync: bool) -> None:
        fut = self.local.start_load(model_id, record, last_used_ms)
        if sync:
            # A failed load is reported in the returned status (LOADING_FAILED), not as an error.
            with contextlib.suppress(LoadFailed):
                await asyncio.shield(fut)
        elif fut.done() and not fut.cancelled():
            exc = fut.exception()
            if isinstance(exc, MeshError) and not isinstance(exc, LoadFailed):
                raise exc
