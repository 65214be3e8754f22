"""`mmesh.ModelMesh` servicer (SPEC §2): message conversion around `Management`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc
from meshd.api.grpc_errors import statuses
from meshd.api.management import Management
from meshd.core.errors import FailedPrecondition
from meshd.decisions.ids import ModelInfo
from meshd.decisions.status import StatusView
from meshd.registry.vmodels import SetVModel, VModels, VModelStatusView


def status_message(view: StatusView) -> Any:
    return mm.ModelStatusInfo(
        status=view.status.name,
        errors=list(view.errors),
        modelCopyInfos=[
            mm.ModelStatusInfo.ModelCopyInfo(location=c.location, copyStatus=c.status.name, time=c.time_ms)
            for c in view.copies
        ],
    )


async def vmodel_message(m: Management, view: VModelStatusView) -> Any:
    msg = mm.VModelStatusInfo(
        status=view.status.name,
        activeModelId=view.active_model_id,
        targetModelId=view.target_model_id,
        owner=view.owner,
    )
    if view.active_model_id:
        msg.activeModelStatus.CopyFrom(status_message(await m.current_status(view.active_model_id)))
    if view.target_model_id:
        msg.targetModelStatus.CopyFrom(status_message(await m.current_status(view.target_model_id)))
    return msg


class ModelMeshServicer(mm_grpc.ModelMeshServicer):  # type: ignore[misc]
    def __init__(
        self,
        management: Management,
        vmodels: VModels,
        sync_timeout_s: float,
        count_copies: Callable[[list[str]], Awaitable[None]],
        wait_loaded: Callable[[str, float], Awaitable[None]],
        read_only: bool = False,
    ) -> None:
        self.wait_loaded = wait_loaded  # until a copy of the model is loaded somewhere
        self.read_only = read_only  # KV_READ_ONLY: model and vmodel records are not changed here
        self.m = management
        self.v = vmodels
        self.sync_timeout_s = sync_timeout_s
        self.count_copies = count_copies  # refresh loaded-copy counts the switch rule reads

    def _writable(self) -> None:
        if self.read_only:
            raise FailedPrecondition(
                "the KV store is read-only here (KV_READ_ONLY=true): models and vmodels cannot be changed"
            )

    @statuses
    async def registerModel(self, request: Any, context: Any) -> Any:
        self._writable()
        info = request.modelInfo
        view = await self.m.register(
            request.modelId,
            ModelInfo(info.type, info.path, info.key),
            request.loadNow,
            request.sync,
            request.lastUsedTime,
        )
        return status_message(view)

    @statuses
    async def unregisterModel(self, request: Any, context: Any) -> Any:
        self._writable()
        await self.m.unregister(request.modelId)
        return mm.UnregisterModelResponse()

    @statuses
    async def getModelStatus(self, request: Any, context: Any) -> Any:
        return status_message(await self.m.current_status(request.modelId))

    @statuses
    async def ensureLoaded(self, request: Any, context: Any) -> Any:
        return status_message(await self.m.ensure_loaded(request.modelId, request.lastUsedTime, request.sync))

    @statuses
    async def setVModel(self, request: Any, context: Any) -> Any:
        self._writable()
        info = request.modelInfo if request.HasField("modelInfo") else None
        req = SetVModel(
            vmodel_id=request.vModelId,
            target_model_id=request.targetModelId,
            update_only=request.updateOnly,
            model_info=ModelInfo(info.type, info.path, info.key) if info is not None else None,
            auto_delete_target=request.autoDeleteTargetModel,
            load_now=request.loadNow,
            force=request.force,
            sync=request.sync,
            expected_target_model_id=request.expectedTargetModelId,
            owner=request.owner,
        )
        current = self.v.status(request.vModelId)
        await self.count_copies([m for m in (current.active_model_id, request.targetModelId) if m])
        view = await self.v.set_vmodel(req)
        if request.sync and view.active_model_id != view.target_model_id:
            view = await self.v.wait_transition(request.vModelId, request.targetModelId, self.sync_timeout_s)
        elif request.sync and request.loadNow and view.target_model_id:
            await self.wait_loaded(view.target_model_id, self.sync_timeout_s)  # a new vmodel's target
        return await vmodel_message(self.m, view)

    @statuses
    async def deleteVModel(self, request: Any, context: Any) -> Any:
        self._writable()
        await self.v.delete_vmodel(request.vModelId, request.owner)
        return mm.DeleteVModelResponse()

    @statuses
    async def getVModelStatus(self, request: Any, context: Any) -> Any:
        return await vmodel_message(self.m, self.v.status(request.vModelId, request.owner))
