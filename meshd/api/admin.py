"""`meshd.admin.MeshAdmin` servicer on the external port: message conversion around `Inventory`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshd._proto.meshd import admin_pb2 as pb
from meshd._proto.meshd import admin_pb2_grpc as pb_grpc
from meshd.api.grpc_errors import statuses
from meshd.core.clock import Clock, wall_ms
from meshd.core.records import InstanceRecord
from meshd.decisions.ids import check_id
from meshd.kv.table import Table
from meshd.loops.inventory import InstanceSummary, Inventory, ModelSummary, instance_summaries


def model_message(s: ModelSummary) -> Any:
    msg = pb.ModelSummary(
        modelId=s.model_id,
        type=s.type,
        path=s.path,
        status=s.status.name,
        lastUsedMs=s.last_used_ms,
        refs=s.refs,
        autoDelete=s.auto_delete,
        errors=list(s.errors),
    )
    if s.size_bytes is not None:
        msg.sizeBytes = s.size_bytes
    for c in s.copies:
        copy = msg.copies.add(
            instanceId=c.instance_id, state=c.state.name, sinceMs=c.since_ms, lastUsedMs=c.last_used_ms, error=c.error
        )
        if c.size_bytes is not None:
            copy.sizeBytes = c.size_bytes
    return msg


def instance_message(s: InstanceSummary) -> Any:
    r = s.record
    return pb.InstanceSummary(
        instanceId=s.instance_id,
        location=r.location,
        zone=r.zone,
        labels=r.labels,
        capacityBytes=s.capacity_bytes,
        usedBytes=s.used_bytes,
        modelCount=r.count,
        rpm=r.rpm,
        lruTimeMs=r.lru_time,
        shutdown=r.shutdown,
        startTimeMs=r.start_time,
        version=min(max(r.version, 0), 2**64 - 1),  # another's record may hold any number
        loadingThreads=r.loading_threads,
        loadingInProgress=r.loading_in_progress,
        leader=s.leader,
        runtimeDown=r.runtime_down,
        upstream=r.upstream,
    )


class MeshAdminServicer(pb_grpc.MeshAdminServicer):  # type: ignore[misc]
    def __init__(
        self,
        inventory: Inventory,
        instances: Table[InstanceRecord],
        leader_id: Callable[[], str | None],
        clock: Clock = wall_ms,
    ) -> None:
        self.inventory = inventory
        self.instances = instances
        self.leader_id = leader_id
        self.clock = clock

    @statuses
    async def listModels(self, request: Any, context: Any) -> Any:
        ids = list(dict.fromkeys(request.modelIds))
        for model_id in ids:
            check_id(model_id)
        models, unreachable = await self.inventory.models(ids)
        return pb.ListModelsResponse(
            models=[model_message(m) for m in models], nowMs=self.clock(), unreachable=unreachable
        )

    @statuses
    async def listInstances(self, request: Any, context: Any) -> Any:
        summaries = instance_summaries(self.instances.items(), self.leader_id())
        return pb.ListInstancesResponse(instances=[instance_message(s) for s in summaries], nowMs=self.clock())
