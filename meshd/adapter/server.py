"""The adapter's ModelRuntime (SPI) servicer: meshd's loads become repository loads.

`loadModel` lays the model out in the server's repository and asks the server to load it
(`RepositoryModelLoad`); `unloadModel` asks it to unload and removes the folder; sizes come
from `sizing`; `runtimeStatus` purges the server and reports what meshd needs, including
`methodInfos` with `idInjectionPath [1]` for the KServe methods that name the model in
field 1 (the servers route by the body's model name).

The adapter remembers what it loaded. `modelSize` answers only for models the server really
holds now, so meshd's check after a "model not found" drops exactly the lost copies. When
the server comes back after a crash (a new supervisor generation) or is found to have lost
models (periodic reconcile), the adapter loads them again; those it cannot are forgotten.
While the server is down, SPI calls wait for it up to their deadline, then fail UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from meshd._proto.inference import grpc_predict_v2_pb2 as v2
from meshd._proto.inference import grpc_predict_v2_pb2_grpc as v2_grpc
from meshd._proto.mmesh import model_runtime_pb2 as rt
from meshd._proto.mmesh import model_runtime_pb2_grpc as rt_grpc
from meshd.adapter import layout, sizing, stored
from meshd.adapter.layout import Layout, LayoutError, ModelSource
from meshd.adapter.stored import Failure
from meshd.adapter.supervisor import Supervisor
from meshd.core.errors import means_model_missing
from meshd.decisions.placement.modelkey import key_object
from meshd.storage import StorageHelper

log = logging.getLogger(__name__)

INFERENCE = "inference.GRPCInferenceService"
# KServe methods whose request names the model in field 1 (ModelInferRequest.model_name,
# ModelMetadataRequest.name, ...): meshd writes the concrete id there. MLServer has no
# ModelConfig, and its ModelStreamInfer answers ModelInferResponse messages where Triton's
# (and KServe clients') answer ModelStreamInferResponse, so it is not announced for MLServer.
INJECTED_METHODS = {
    "triton": ("ModelInfer", "ModelMetadata", "ModelReady", "ModelStreamInfer", "ModelConfig"),
    "mlserver": ("ModelInfer", "ModelMetadata", "ModelReady"),
}
SERVER_CALL_TIMEOUT_S = 10.0
# DEFAULT_MODELSIZE: upstream adapters' default (model-mesh-*-adapter/server/config.go),
# 1,000,000 bytes. LOADTIME_TIMEOUT: the 90,000 ms modelmesh-serving sets on every adapter (the
# ServingRuntime default), not the adapters' own 30,000: a load here includes its pull, and
# outside modelmesh-serving nobody sets it.
DEFAULT_MODEL_SIZE_BYTES = 1_000_000
DEFAULT_LOADING_TIMEOUT_MS = 90_000


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    repository: Path
    model_root: Path | None = None  # relative model paths are under it
    capacity_bytes: int = 1 << 30
    default_model_size: int = DEFAULT_MODEL_SIZE_BYTES
    size_multiplier: float = sizing.DEFAULT_MULTIPLIER
    max_loading_concurrency: int = 1
    loading_timeout_ms: int = DEFAULT_LOADING_TIMEOUT_MS
    max_concurrency: int = 0  # per copy; > 0 turns on limitModelConcurrency
    version: str = "meshd-adapter"


@dataclass
class Loaded:
    size_bytes: int
    directory: Path


@dataclass
class AdapterState:
    loaded: dict[str, Loaded] = field(default_factory=dict)
    restoring: set[str] = field(default_factory=set)
    unwanted: set[str] = field(default_factory=set)  # let go of while the server could not unload them
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def lock(self, model_id: str) -> asyncio.Lock:
        lock = self.locks.get(model_id)
        if lock is None:
            lock = self.locks[model_id] = asyncio.Lock()
        return lock


class ModelServer:
    """The model server's KServe V2 gRPC API (health and the repository extension)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub = v2_grpc.GRPCInferenceServiceStub(channel)

    async def ready(self) -> bool:
        resp = await self.stub.ServerReady(v2.ServerReadyRequest(), timeout=2.0)
        return bool(resp.ready)

    async def live(self) -> bool:
        # Liveness, not readiness: servers report not-ready while any model loads. A generous
        # timeout: a server whose event loop a model load blocks answers late, not never.
        resp = await self.stub.ServerLive(v2.ServerLiveRequest(), timeout=5.0)
        return bool(resp.live)

    async def load(self, name: str, timeout_s: float) -> None:
        await self.stub.RepositoryModelLoad(v2.RepositoryModelLoadRequest(model_name=name), timeout=timeout_s)

    async def unload(self, name: str) -> None:
        await self.stub.RepositoryModelUnload(
            v2.RepositoryModelUnloadRequest(model_name=name), timeout=SERVER_CALL_TIMEOUT_S
        )

    async def loaded_names(self) -> set[str]:
        resp = await self.stub.RepositoryIndex(v2.RepositoryIndexRequest(ready=True), timeout=SERVER_CALL_TIMEOUT_S)
        # Triton says "READY"; MLServer "State.READY" (and "State.UNAVAILABLE" when not loaded).
        return {m.name for m in resp.models if m.state.upper().removeprefix("STATE.") in ("READY", "")}

    async def known_names(self) -> set[str]:
        """Every model the server lists, in any state (a load cut short may leave one half-made)."""
        resp = await self.stub.RepositoryIndex(v2.RepositoryIndexRequest(ready=False), timeout=SERVER_CALL_TIMEOUT_S)
        return {m.name for m in resp.models}


T = TypeVar("T")


class Adapter(rt_grpc.ModelRuntimeServicer):  # type: ignore[misc]
    def __init__(
        self, config: AdapterConfig, model_layout: Layout, server: ModelServer, storage: StorageHelper | None = None
    ) -> None:
        self.config = config
        self.layout = model_layout
        self.server = server
        self.state = AdapterState()
        self.supervisor: Supervisor | None = None
        # Issue 42: models whose key or path names a store are pulled to local disk first,
        # and their files stay there after an unload (the disk tier); None: paths are local
        self.storage = storage

    # ---- plumbing --------------------------------------------------------------------
    async def _server_up(self, context: Any) -> None:
        if self.supervisor is None:
            return
        remaining = context.time_remaining()
        if not await self.supervisor.wait_up(min(remaining, 60.0) if remaining else 60.0):
            raise Failure(grpc.StatusCode.UNAVAILABLE, f"the {self.layout.server} model server is not up")

    async def _answer(self, context: Any, work: Callable[[], Awaitable[T]]) -> T:
        try:
            return await work()
        except Failure as e:
            await context.abort(e.code, e.details)
            raise AssertionError("context.abort returned") from e
        except grpc.aio.AioRpcError as e:
            code = e.code()
            details = f"{self.layout.server}: {e.details()}"
            await context.abort(code, details)
            raise AssertionError("context.abort returned") from e
        except (OSError, ValueError) as e:  # the file system, or a path no file can have
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"adapter: {e}")
            raise AssertionError("context.abort returned") from e

    def _source(self, request: Any, pulled: tuple[str, str] | None = None) -> ModelSource:
        """The model's files as the layout installs them; `pulled`: the local path and the
        rewritten key of a model the storage helper pulled (issue 42)."""
        model_path, model_key = pulled or (request.modelPath, request.modelKey)
        key = key_object(model_key) or {}
        if not model_path or "\0" in model_path:
            raise Failure(grpc.StatusCode.INVALID_ARGUMENT, f"model {request.modelId!r}: modelPath is empty or invalid")
        try:
            schema = layout.schema_path_of(key)
        except LayoutError as e:
            raise Failure(grpc.StatusCode.INVALID_ARGUMENT, f"model {request.modelId!r}: {e}") from None
        if schema is not None and "\0" in schema:
            raise Failure(grpc.StatusCode.INVALID_ARGUMENT, f"model {request.modelId!r}: schema_path is invalid")
        model_type = layout.model_type_of(request.modelType, key)
        schema_file = self._local(schema) if schema is not None else None
        return ModelSource(request.modelId, model_type, self._local(model_path), key, schema_file)

    def _local(self, path_text: str) -> Path:
        """A model or schema path: relative ones are under --model-root (the pulled ones are absolute)."""
        path = Path(path_text)
        if not path.is_absolute() and self.config.model_root is not None:
            path = self.config.model_root / path
        return path

    async def _pull(self, request: Any) -> tuple[str, str] | None:
        """Pull the model onto local disk when its key or path names a store (or find it on
        the disk tier): its local path and rewritten key (`disk_size_bytes` measured, the
        storage fields gone); None when its path is local. A failed pull is the load's failure,
        naming the model, the store and the object."""
        pulled = await stored.pull(self.storage, request.modelId, request.modelPath, request.modelKey)
        if pulled is None:
            return None
        return pulled.local_path, pulled.key

    def _size(self, request: Any, source: ModelSource) -> int:
        disk = sizing.disk_usage(source.path) if source.path.exists() else None
        return sizing.model_size(request.modelKey, disk, self.config.size_multiplier, self.config.default_model_size)

    async def _listed_size(self, request: Any) -> int | None:
        """A stored model's size from its store's listing (or the disk tier), before a byte
        moves, as the runtime's load would count it; None: its path is local."""
        listed = await stored.listed_size(self.storage, request.modelId, request.modelPath, request.modelKey)
        if listed is None:
            return None
        cfg = self.config
        return sizing.model_size(request.modelKey, listed, cfg.size_multiplier, cfg.default_model_size)

    # ---- the SPI ---------------------------------------------------------------------
    async def loadModel(self, request: rt.LoadModelRequest, context: Any) -> rt.LoadModelResponse:
        async def work() -> rt.LoadModelResponse:
            if not request.modelId:
                raise Failure(grpc.StatusCode.INVALID_ARGUMENT, "modelId is empty")
            await self._server_up(context)
            async with self.state.lock(request.modelId):
                known = self.state.loaded.get(request.modelId)
                if known is not None and request.modelId not in self.state.restoring:
                    return rt.LoadModelResponse(
                        sizeInBytes=known.size_bytes, maxConcurrency=self.config.max_concurrency
                    )
                source = self._source(request, await self._pull(request))
                try:
                    directory = await asyncio.to_thread(layout.install, self.layout, self.config.repository, source)
                except (LayoutError, OSError) as e:
                    raise Failure(
                        grpc.StatusCode.FAILED_PRECONDITION, f"cannot prepare {request.modelId!r}: {e}"
                    ) from None
                timeout = context.time_remaining() or self.config.loading_timeout_ms / 1000
                try:
                    await self._load_when_up(request.modelId, timeout)
                except BaseException:
                    # A load cut short (deadline, cancel, crash) may leave the model half-made
                    # in the server, which then reports itself not ready: unload it too.
                    await asyncio.shield(self._discard(request.modelId))
                    raise
                size = await asyncio.to_thread(self._size, request, source)
                self.state.loaded[request.modelId] = Loaded(size, directory)
                self.state.restoring.discard(request.modelId)
                log.info("loaded %s (%d bytes) from %s", request.modelId, size, source.path)
                return self._loaded_response(size)

        return await self._answer(context, work)

    async def _discard(self, model_id: str) -> None:
        if self.storage is not None:
            self.storage.release(model_id)  # its files stay on disk, evictable
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.server.unload(model_id)
        with contextlib.suppress(OSError):
            await asyncio.to_thread(layout.uninstall, self.layout, self.config.repository, model_id)

    async def _load_when_up(self, model_id: str, timeout_s: float) -> None:
        """Ask the server to load. If it goes down meanwhile, wait for the supervisor to bring
        it back (a new generation) and ask once more, within the load's time; if no restart
        is seen in time, the UNAVAILABLE goes on (meshd does not hold it against the model).
        Brought down again while loading this model: the model may be what does it, so that
        is the model's failure and the server is not crashed a third time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        supervisor = self.supervisor
        generation = supervisor.generation if supervisor else 0
        retried = False
        while True:
            try:
                await self.server.load(model_id, max(0.1, deadline - loop.time()))
                return
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or supervisor is None:
                    raise
                if not await supervisor.wait_recovered(generation, deadline - loop.time()):
                    raise
                if retried:
                    raise Failure(
                        grpc.StatusCode.INTERNAL,
                        f"the {self.layout.server} model server went down twice while loading {model_id} "
                        f"({e.details()}); not retried, in case the model brings it down",
                    ) from None
                retried = True
                generation = supervisor.generation
                log.info("the model server restarted while loading %s; asking again", model_id)

    def _loaded_response(self, size: int) -> rt.LoadModelResponse:
        return rt.LoadModelResponse(sizeInBytes=size, maxConcurrency=self.config.max_concurrency)

    async def unloadModel(self, request: rt.UnloadModelRequest, context: Any) -> rt.UnloadModelResponse:
        async def work() -> rt.UnloadModelResponse:
            async with self.state.lock(request.modelId):
                if self.supervisor is not None and not self.supervisor.up:
                    # Forget it now, so no restore loads what meshd let go of; if the server
                    # comes back still holding it, reconcile unloads it then.
                    self._forget(request.modelId)
                    self.state.unwanted.add(request.modelId)
                else:
                    await self._unload(request.modelId)
                return rt.UnloadModelResponse()

        return await self._answer(context, work)

    async def _unload(self, model_id: str) -> None:
        try:
            await self.server.unload(model_id)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                # meshd does not retry unloads: forget it here and let reconcile unload it
                # once the server answers (the folder stays until then).
                self._forget(model_id)
                self.state.unwanted.add(model_id)
                return
            if not means_model_missing(e.code(), e.details() or ""):
                raise  # the folder stays, so a retry can still unload it
        self._forget(model_id)
        self.state.unwanted.discard(model_id)
        await asyncio.to_thread(layout.uninstall, self.layout, self.config.repository, model_id)
        log.info("unloaded %s", model_id)

    def _forget(self, model_id: str) -> None:
        self.state.loaded.pop(model_id, None)
        self.state.restoring.discard(model_id)
        if self.storage is not None:
            self.storage.release(model_id)  # unloaded: its files stay on disk (the tier), evictable

    async def predictModelSize(self, request: rt.PredictModelSizeRequest, context: Any) -> rt.PredictModelSizeResponse:
        async def work() -> rt.PredictModelSizeResponse:
            listed = await self._listed_size(request)
            if listed is not None:
                return rt.PredictModelSizeResponse(sizeInBytes=listed)
            source = self._source(request)
            return rt.PredictModelSizeResponse(sizeInBytes=await asyncio.to_thread(self._size, request, source))

        return await self._answer(context, work)

    async def modelSize(self, request: rt.ModelSizeRequest, context: Any) -> rt.ModelSizeResponse:
        async def work() -> rt.ModelSizeResponse:
            known = self.state.loaded.get(request.modelId)
            up = self.supervisor is None or self.supervisor.up
            if known is None or request.modelId in self.state.restoring or not up:
                # meshd drops its copy on this answer (without an unload): stop restoring it,
                # or the server would hold a model nobody counts.
                self._forget(request.modelId)
                raise Failure(grpc.StatusCode.NOT_FOUND, f"model {request.modelId} is not loaded")
            return rt.ModelSizeResponse(sizeInBytes=known.size_bytes)

        return await self._answer(context, work)

    async def runtimeStatus(self, request: rt.RuntimeStatusRequest, context: Any) -> rt.RuntimeStatusResponse:
        async def work() -> rt.RuntimeStatusResponse:
            cfg = self.config
            resp = rt.RuntimeStatusResponse(
                status=rt.RuntimeStatusResponse.STARTING,
                capacityInBytes=cfg.capacity_bytes,
                maxLoadingConcurrency=cfg.max_loading_concurrency,
                modelLoadingTimeoutMs=cfg.loading_timeout_ms,
                defaultModelSizeInBytes=cfg.default_model_size,
                runtimeVersion=cfg.version,
                limitModelConcurrency=cfg.max_concurrency > 0,
            )
            if self.supervisor is not None and not self.supervisor.up:
                return resp
            try:
                if not await self.server.ready():
                    return resp
            except grpc.aio.AioRpcError:
                return resp
            await self.purge()  # SPI: the runtime holds nothing when it first answers READY
            resp.status = rt.RuntimeStatusResponse.READY
            for method in INJECTED_METHODS[self.layout.server]:
                resp.methodInfos[f"{INFERENCE}/{method}"].idInjectionPath.append(1)
            return resp

        return await self._answer(context, work)

    # ---- keeping the server and our records in step ---------------------------------------
    async def purge(self) -> None:
        for name in await self.server.known_names() | set(self.state.loaded):
            try:
                await self.server.unload(name)
            except grpc.aio.AioRpcError as e:
                if not means_model_missing(e.code(), e.details() or ""):
                    raise
        self.state.loaded.clear()
        self.state.restoring.clear()
        await asyncio.to_thread(layout.clear, self.config.repository)
        log.info("purged the %s model server", self.layout.server)

    async def restore(self, only: set[str] | None = None) -> None:
        """Load again what the server lost (all after a restart, or `only` those)."""
        lost = set(self.state.loaded) if only is None else only & set(self.state.loaded)
        self.state.restoring |= lost
        for model_id in sorted(lost):
            async with self.state.lock(model_id):
                if model_id not in self.state.restoring:
                    continue  # unloaded, forgotten or loaded again meanwhile
                try:
                    await self.server.load(model_id, self.config.loading_timeout_ms / 1000)
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.UNAVAILABLE:
                        return  # down again: the next generation restores what is left
                    log.warning("cannot restore %s (%s); forgetting it", model_id, e.details())
                    self._forget(model_id)
                    await asyncio.shield(self._discard(model_id))
                    continue
                if model_id in self.state.restoring:
                    self.state.restoring.discard(model_id)
                    log.info("restored %s after the model server lost it", model_id)
                else:  # meshd let it go (or a purge ran) while it loaded
                    await asyncio.shield(self._discard(model_id))

    async def reconcile(self) -> None:
        """Find models the server no longer holds (a restart between health checks) and
        restore them."""
        if self.supervisor is not None and (not self.supervisor.up or self.supervisor.restoring):
            return
        held = await self.server.loaded_names()
        lost = {m for m in self.state.loaded if m not in held and m not in self.state.restoring}
        if lost:
            log.warning("the model server lost %s; loading them again", sorted(lost))
            await self.restore(lost)
        # Models the server holds that nobody counts (let go of while it could not unload
        # them, or loaded by someone else): unload them, meshd's capacity does not cover them.
        extra = (held | self.state.unwanted) - set(self.state.loaded)
        for model_id in sorted(extra):
            lock = self.state.lock(model_id)
            if lock.locked():
                continue  # being loaded or unloaded right now
            async with lock:
                if model_id in self.state.loaded:
                    continue
                log.warning("unloading %s: the model server holds it but nothing counts it", model_id)
                await self._unload(model_id)
