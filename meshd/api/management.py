"""The ModelMesh management operations (SPEC §2) on one core object.

The gRPC servicer only converts messages; validation, registry writes and loading
decisions happen here, so other transports (CLI, HTTP) can share them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from collections.abc import Set as AbstractSet

from meshd.core.clock import Clock, wall_ms
from meshd.core.errors import LoadFailed, MeshError, Unavailable
from meshd.core.records import ModelRecord
from meshd.decisions.ids import ModelInfo, check_id
from meshd.decisions.status import CopyState, ModelStatus, StatusView, model_status
from meshd.registry.models import Registry, default_last_used
from meshd.serving.local import LocalModels

PlaceFn = Callable[[str, int], Awaitable[str | None]]
SYNC_POLL_S = 0.1
PLACE_VISIBLE_S = 5.0  # at most this long for a placed copy to show in the mirror


class Management:
    def __init__(
        self,
        instance_id: str,
        registry: Registry,
        local: LocalModels,
        failure_expiry_ms: int,
        clock: Clock = wall_ms,
        live_instances: Callable[[], AbstractSet[str]] | None = None,
        place: PlaceFn | None = None,
        peer_states: Callable[[str], Awaitable[Mapping[str, CopyState]]] | None = None,
        no_home: Callable[[str], str | None] | None = None,
        sync_timeout_s: float = 60.0,
    ) -> None:
        """`place`: start a load where placement chooses (the cluster's pick, type
        constraints honoured; None: load here); `peer_states`: ask holders of a model how
        their copies are; `no_home`: upstream's message when no running instance may load a
        model type; `sync_timeout_s`: how long a `sync` load is waited for."""
        self.place = place
        self.peer_states = peer_states
        self.no_home = no_home
        self.sync_timeout_s = sync_timeout_s
        self.live_instances = live_instances
        self.instance_id = instance_id
        self.registry = registry
        self.local = local
        self.failure_expiry_ms = failure_expiry_ms
        self.clock = clock

    def status(self, model_id: str, peers: Mapping[str, CopyState] | None = None) -> StatusView:
        """From the mirrors (`peers`: what holders said of their copies, when asked)."""
        check_id(model_id)
        record = self.registry.get(model_id)
        if record is None and self.registry.corrupt_reason(model_id) is not None:
            self.registry.require(model_id)  # raises DATA_LOSS naming the problem
        no_home = self.no_home(record.type) if record is not None and self.no_home is not None else None
        return model_status(
            record,
            self.local.view(model_id),
            self.instance_id,
            self.clock(),
            self.failure_expiry_ms,
            self.live_instances() if self.live_instances is not None else None,
            peers,
            no_home,
        )

    async def current_status(self, model_id: str) -> StatusView:
        """getModelStatus: the holders asked how their copies are (a copy still loading on a
        peer says LOADING, as upstream reports it)."""
        view = self.status(model_id)
        if self.peer_states is None or not any(c.location != self.instance_id for c in view.copies):
            return view
        return self.status(model_id, await self.peer_states(model_id))

    async def register(
        self, model_id: str, info: ModelInfo, load_now: bool, sync: bool, last_used_ms: int
    ) -> StatusView:
        check_id(model_id)
        info.check()
        last_used = last_used_ms or default_last_used(self.clock(), load_now)
        record = await self.registry.register(model_id, info, last_used, by_default=not last_used_ms)
        if load_now:
            await self._load(model_id, record, last_used, sync)
        return await self.current_status(model_id)

    async def unregister(self, model_id: str) -> None:
        check_id(model_id)
        if await self.registry.unregister(model_id) is not None:
            self.local.drop(model_id)

    async def ensure_loaded(self, model_id: str, last_used_ms: int, sync: bool) -> StatusView:
        check_id(model_id)
        record = self.registry.require(model_id)
        await self._load(model_id, record, last_used_ms or self.clock(), sync)
        return await self.current_status(model_id)

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
        if self.place is not None:
            await self._place(model_id, last_used_ms, sync)
            return
        fut = self.local.start_load(model_id, record, last_used_ms)
        if sync:
            # A failed load is reported in the returned status (LOADING_FAILED), not as an error.
            with contextlib.suppress(LoadFailed):
                await asyncio.shield(fut)
        elif fut.done() and not fut.cancelled():
            exc = fut.exception()
            if isinstance(exc, MeshError) and not isinstance(exc, LoadFailed):
                raise exc

    async def _place(self, model_id: str, last_used_ms: int, sync: bool) -> None:
        """Through the cluster: a copy where placement chooses, unless one is loaded or
        loading already; with `sync`, until it is loaded or failed (or the sync timeout)."""
        assert self.place is not None
        view = await self.current_status(model_id)
        if view.status in (ModelStatus.LOADED, ModelStatus.LOADING):
            placed: str | None = "already"
        else:
            placed = await self.place(model_id, last_used_ms)  # None: nowhere
        if placed is None:
            view = await self.current_status(model_id)
            if view.status is ModelStatus.LOADING_FAILED:
                return  # the status says why (e.g. no instance meets the type's labels)
            # Nowhere to put a copy now (every cache too small, every instance refusing): a
            # load asked for must not look accepted.
            why = "; ".join(view.errors) or "no instance has room for it or accepted the load"
            raise Unavailable(f"model {model_id!r} is registered but could not be loaded anywhere: {why}")
        loop = asyncio.get_running_loop()
        if placed != "already":
            # The answer should show the copy: wait (briefly) until this mirror has the
            # holder's record write, which comes as its load starts.
            visible_by = loop.time() + PLACE_VISIBLE_S
            while loop.time() < visible_by:
                rec = self.registry.get(model_id)
                if rec is None or placed in rec.instance_ids or placed in rec.failed_in:
                    break
                await asyncio.sleep(SYNC_POLL_S / 2)
        if not sync:
            return
        # Until loaded or failed: the holder's record write may reach this mirror a moment
        # after it was asked, so NOT_LOADED only means "not yet" here.
        deadline = loop.time() + self.sync_timeout_s
        while loop.time() < deadline:
            view = await self.current_status(model_id)
            if view.status in (ModelStatus.LOADED, ModelStatus.LOADING_FAILED):
                return
            await asyncio.sleep(SYNC_POLL_S)
