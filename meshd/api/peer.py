"""`meshd.peer.MeshPeer` servicer on the internal port: stats and load-here operations."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from meshd._proto.meshd import peer_pb2 as pb
from meshd._proto.meshd import peer_pb2_grpc as pb_grpc
from meshd.api.grpc_errors import statuses
from meshd.core.errors import LoadFailed
from meshd.decisions.cache import UNIT_BYTES, State
from meshd.decisions.ids import check_id
from meshd.loops.inventory import held_copies
from meshd.loops.leader import ClusterGauges
from meshd.registry.models import Registry
from meshd.serving.local import LocalModels

_STATES = {State.LOADING: pb.InternalOpResponse.LOADING, State.LOADED: pb.InternalOpResponse.LOADED}
_COPY_STATES = {**_STATES, State.FAILED: pb.InternalOpResponse.FAILED}


class PeerServicer(pb_grpc.MeshPeerServicer):  # type: ignore[misc]
    def __init__(self, instance_id: str, local: LocalModels, registry: Registry) -> None:
        self.instance_id = instance_id
        self.local = local
        self.registry = registry
        self.gauges: Callable[[], ClusterGauges | None] = lambda: None  # set once the leader exists
        self.data_plane = "python"
        self.native_carried: Callable[[], int] = lambda: 0  # set when the native data plane runs

    @statuses
    async def InternalOperation(self, request: Any, context: Any) -> Any:
        if request.unload:
            check_id(request.modelId)
            await self.local.unload_now(request.modelId)
        elif request.load:
            check_id(request.modelId)
            record = self.registry.get(request.modelId) or await self.registry.fetch(request.modelId)
            now = self.local.clock()
            # Never newer than now: a far-future date would pin the copy against eviction.
            fut = self.local.start_load(request.modelId, record, min(request.lastUsed or now, now))
            if request.sync:
                # Shielded: a caller's deadline must not cancel the load others wait on.
                with contextlib.suppress(LoadFailed):
                    await asyncio.shield(fut)
        entry = self.local.view(request.modelId)  # a load waiting for a thread is LOADING, as in its record
        if entry is None:
            state = pb.InternalOpResponse.NOT_HERE
        else:
            state = _STATES.get(entry.state, pb.InternalOpResponse.FAILED)
        return pb.InternalOpResponse(state=state, instanceId=self.instance_id)

    @statuses
    async def InstanceStats(self, request: Any, context: Any) -> Any:
        c = self.local.counters
        cache = self.local.cache
        resp = pb.InstanceStatsResponse(
            instanceId=self.instance_id,
            requests=c.requests,
            hits=c.hits,
            misses=c.misses,
            loads=c.loads,
            loadFailures=c.load_failures,
            evictions=c.evictions,
            capacityBytes=cache.capacity_units * UNIT_BYTES,
            usedBytes=cache.used_units * UNIT_BYTES,
            loadedModels=sorted(e.model_id for e in cache.entries() if e.state is State.LOADED),
            dataPlane=self.data_plane,
            nativeCarried=self.native_carried(),
        )
        if request.withCopies:
            resp.copiesIncluded = True
            for model_id, held in sorted(held_copies(cache, request.modelIds).items()):
                resp.copies.add(
                    modelId=model_id,
                    state=_COPY_STATES[held.state],
                    sizeBytes=held.size_bytes,
                    lastUsed=held.last_used_ms,
                    since=held.since_ms,
                )
        gauges = self.gauges()
        if gauges is not None:
            resp.leader = True
            resp.modelsManagedTotal = gauges.models_managed
            resp.modelsLoadedTotal = gauges.models_loaded
            resp.modelsWithFailureTotal = gauges.models_with_failure
        return resp
