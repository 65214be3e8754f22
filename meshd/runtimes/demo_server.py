"""gRPC servicers of the demo runtime: the ModelMesh runtime SPI and KServe V2 inference.

This module owns the runtime's state (which models are loaded, which loads are in flight)
and the behaviour SPEC §1 and §4 describe; `demo` owns the process, flags and sockets.

- `mmesh.ModelRuntime` (management) is served through the generated servicer.
- `inference.GRPCInferenceService` is served by a raw-bytes generic handler: requests are
  parsed here, so malformed bytes answer INVALID_ARGUMENT "malformed <Message>: ..."
  rather than the INTERNAL grpc gives when its own deserializer fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc

# No protobuf stubs in the dev set; the lead may add them, hence unused-ignore.
from google.protobuf.message import DecodeError, Message  # type: ignore[import-untyped, unused-ignore]

import meshd
from meshd._proto.inference import grpc_predict_v2_pb2 as pb
from meshd._proto.meshd import disk_pb2, disk_pb2_grpc
from meshd._proto.mmesh import model_runtime_pb2 as rt
from meshd._proto.mmesh import model_runtime_pb2_grpc as rt_grpc
from meshd.decisions.placement.modelkey import key_object
from meshd.runtimes import model_work
from meshd.runtimes.model_work import Held
from meshd.runtimes.models import DemoModel, decode_infer_request, make_infer_response

log = logging.getLogger("meshd.runtimes.demo")

INFERENCE_SERVICE = "inference.GRPCInferenceService"
RUNTIME_VERSION = f"meshd-demo/{meshd.__version__}"
PLATFORM = "meshd-demo"
# Methods the runtime announces in methodInfos; ModelInfer and ModelMetadata carry the
# model name in field 1, so with --inject-id meshd writes the concrete id there.
ANNOUNCED_METHODS = ("ModelInfer", "ModelMetadata", "ModelReady", "ModelConfig", "ModelStreamInfer")
INJECTABLE_METHODS = ("ModelInfer", "ModelMetadata")
ECHO_METHODS = ("Unary", "ServerStream", "ClientStream", "Bidi")  # meshd.demo.Echo (runtimes/echo.py)
MODEL_ID_HEADER = "mm-model-id"
MODEL_ID_BIN_HEADER = "mm-model-id-bin"


@dataclass(frozen=True)
class RuntimeConfig:
    """What the runtime reports and how it misbehaves on purpose (see `demo` flags)."""

    capacity_bytes: int = 256 << 20
    max_loading_concurrency: int = 2
    loading_timeout_ms: int = 30_000
    default_model_size: int = 1 << 20
    load_delay_ms: int = 0
    startup_delay_ms: int = 0
    fail_load: re.Pattern[str] | None = None
    zero_size: bool = False
    max_concurrency: int = 0
    limit_model_concurrency: bool = False
    inject_id: bool = False
    infer_delay_ms: int = 0  # added to every inference request (concurrency and deadline tests)
    # A disk tier (meshd.disk.DiskTier, issue 42) as a runtime with the storage helper has one:
    # every entry of this folder is a model id whose files are on disk, each pulled at this
    # speed (None: no tier, diskInventory is UNIMPLEMENTED as on upstream's runtimes)
    disk_dir: Path | None = None
    disk_pull_ms_per_gib: int = 8_000


@dataclass
class LoadedModel:
    model: DemoModel
    size_bytes: int
    path: str
    held: Held | None = None  # the model's memory when its file says hold_memory


class RpcFailure(Exception):
    """An error answer: raised anywhere in a handler, turned into a status by `_answers_errors`."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass
class RuntimeState:
    """Loaded models plus the bookkeeping that keeps cancelled or purged loads from landing."""

    config: RuntimeConfig
    started_at: float = field(default_factory=time.monotonic)
    loaded: dict[str, LoadedModel] = field(default_factory=dict)
    loads_in_flight: dict[str, int] = field(default_factory=dict)
    ready_announced: bool = False
    # Inference requests (ModelInfer, Echo): so tests can see a cancel reach the runtime;
    # "loads": models loaded so far, so tests can count loads without racing evictions.
    counters: dict[str, int] = field(
        default_factory=lambda: {
            "started": 0,
            "finished": 0,
            "cancelled": 0,
            "in_flight": 0,
            "max_in_flight": 0,
            "loads": 0,
        }
    )
    # A load only lands if no unload of its id and no purge happened while it ran.
    _unload_epochs: dict[str, int] = field(default_factory=dict)
    _purge_epoch: int = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        c = self.counters
        c["started"] += 1
        c["in_flight"] += 1
        c["max_in_flight"] = max(c["max_in_flight"], c["in_flight"])
        try:
            yield
        except asyncio.CancelledError:
            c["cancelled"] += 1
            raise
        finally:
            c["finished"] += 1
            c["in_flight"] -= 1

    def past_startup(self) -> bool:
        return (time.monotonic() - self.started_at) * 1000 >= self.config.startup_delay_ms

    def begin_load(self, model_id: str) -> tuple[int, int]:
        self.loads_in_flight[model_id] = self.loads_in_flight.get(model_id, 0) + 1
        return self._purge_epoch, self._unload_epochs.get(model_id, 0)

    def end_load(self, model_id: str) -> None:
        left = self.loads_in_flight.get(model_id, 0) - 1
        if left > 0:
            self.loads_in_flight[model_id] = left
        else:
            self.loads_in_flight.pop(model_id, None)

    def still_wanted(self, model_id: str, ticket: tuple[int, int]) -> bool:
        return ticket == (self._purge_epoch, self._unload_epochs.get(model_id, 0))

    def unload(self, model_id: str) -> bool:
        """Forget a model and void its in-flight loads; False if it was neither loaded nor loading."""
        removed = self.loaded.pop(model_id, None)
        loading = model_id in self.loads_in_flight
        if loading:
            self._unload_epochs[model_id] = self._unload_epochs.get(model_id, 0) + 1
        return removed is not None or loading

    def purge(self) -> None:
        self.loaded.clear()
        self._purge_epoch += 1

    def get(self, model_id: str) -> LoadedModel:
        loaded = self.loaded.get(model_id)
        if loaded is None:
            raise RpcFailure(grpc.StatusCode.NOT_FOUND, f"model {model_id} is not loaded")
        return loaded


class _Context(Protocol):
    async def abort(self, code: grpc.StatusCode, details: str) -> None: ...

    def invocation_metadata(self) -> Any: ...


R = TypeVar("R")
Q = TypeVar("Q")


def _answers_errors(fn: Callable[[Any, Q, _Context], Awaitable[R]]) -> Callable[[Any, Q, _Context], Awaitable[R]]:
    """Turn an RpcFailure raised by a handler into the matching gRPC status."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Q, context: _Context) -> R:
        try:
            return await fn(self, request, context)
        except RpcFailure as e:
            await context.abort(e.code, e.details)
            raise AssertionError("context.abort returned") from e  # abort always raises

    return wrapper


def parse_model_key(model_key: str) -> dict[str, Any]:
    """modelKey is JSON by convention; anything else (or a non-object) counts as empty."""
    data = key_object(model_key)
    if data is None and model_key:
        log.warning("ignoring modelKey that is not a JSON object: %r", model_key[:200])
    return data or {}


def _non_negative(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return None


def resolve_model_file(model_path: str) -> Path:
    """The model file for a modelPath: the path itself, or a directory's model.json / only *.json."""
    path = Path(model_path)
    if path.is_dir():
        if (path / "model.json").is_file():
            return path / "model.json"
        candidates = sorted(path.glob("*.json"))
        if len(candidates) != 1:
            raise ValueError(f"{path}: directory holds {len(candidates)} .json files, expected model.json or one file")
        return candidates[0]
    return path


def _read_model(model_path: str) -> DemoModel:
    if not model_path:
        raise ValueError("modelPath is empty")
    return DemoModel.load(resolve_model_file(model_path))


class ModelRuntimeServicer(rt_grpc.ModelRuntimeServicer):  # type: ignore[misc]
    """mmesh.ModelRuntime: meshd loads, sizes and unloads models through this."""

    def __init__(self, state: RuntimeState) -> None:
        self.state = state

    @property
    def config(self) -> RuntimeConfig:
        return self.state.config

    @_answers_errors
    async def loadModel(self, request: rt.LoadModelRequest, context: _Context) -> rt.LoadModelResponse:
        model_id = request.modelId
        if not model_id:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "modelId is empty")
        key_delay = _non_negative(parse_model_key(request.modelKey).get("load_delay_ms"))
        ticket = self.state.begin_load(model_id)
        try:
            try:
                model = await asyncio.to_thread(_read_model, request.modelPath)
            except (OSError, ValueError) as e:
                # An OSError names the file itself; its reason alone keeps the path said once.
                reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                raise RpcFailure(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"cannot load model {model_id} from {request.modelPath!r}: {reason}",
                ) from e
            # The modelKey wins, then the model file's own load time, then --load-delay-ms.
            delay_ms = key_delay if key_delay is not None else (model.load_ms or self.config.load_delay_ms)
            log.info("loading %s from %s (delay %.0f ms)", model_id, request.modelPath, delay_ms)
            if delay_ms > 0:
                await asyncio.sleep(delay_ms / 1000)
            if self.config.fail_load is not None and self.config.fail_load.search(model_id):
                raise RpcFailure(grpc.StatusCode.INTERNAL, f"injected load failure for {model_id}")
            # No await below this line: a cancellation can no longer leave a half-loaded model.
            if not self.state.still_wanted(model_id, ticket):
                raise RpcFailure(grpc.StatusCode.ABORTED, f"model {model_id} was unloaded or purged while loading")
            size = self.config.default_model_size if model.size_bytes is None else model.size_bytes
            # hold_memory in the file: the memory is really allocated, as model_work.load does.
            held = Held(model.work.hold_bytes) if model.work.hold_bytes else None
            self.state.loaded[model_id] = LoadedModel(model, size, request.modelPath, held)
            self.state.counters["loads"] += 1
        except asyncio.CancelledError:
            log.info("load of %s cancelled; nothing loaded", model_id)
            raise
        except RpcFailure as e:
            log.info("load of %s failed: %s", model_id, e.details)
            raise
        finally:
            self.state.end_load(model_id)
        log.info("loaded %s (%d bytes)", model_id, size)
        return rt.LoadModelResponse(
            sizeInBytes=0 if self.config.zero_size else size, maxConcurrency=self.config.max_concurrency
        )

    @_answers_errors
    async def unloadModel(self, request: rt.UnloadModelRequest, context: _Context) -> rt.UnloadModelResponse:
        if not self.state.unload(request.modelId):
            # meshd counts NOT_FOUND as success; it tells tests the model really was absent.
            raise RpcFailure(grpc.StatusCode.NOT_FOUND, f"model {request.modelId} is not loaded")
        log.info("unloaded %s", request.modelId)
        return rt.UnloadModelResponse()

    @_answers_errors
    async def predictModelSize(
        self, request: rt.PredictModelSizeRequest, context: _Context
    ) -> rt.PredictModelSizeResponse:
        try:
            model = await asyncio.to_thread(_read_model, request.modelPath)
            if model.size_bytes is not None:
                return rt.PredictModelSizeResponse(sizeInBytes=model.size_bytes)
        except (OSError, ValueError):
            pass  # fall back to what the key says
        disk = _non_negative(parse_model_key(request.modelKey).get("disk_size_bytes"))
        # In-memory models are usually somewhat larger than on disk.
        size = int(disk * 1.25) if disk is not None else self.config.default_model_size
        return rt.PredictModelSizeResponse(sizeInBytes=size)

    @_answers_errors
    async def modelSize(self, request: rt.ModelSizeRequest, context: _Context) -> rt.ModelSizeResponse:
        return rt.ModelSizeResponse(sizeInBytes=self.state.get(request.modelId).size_bytes)

    @_answers_errors
    async def runtimeStatus(self, request: rt.RuntimeStatusRequest, context: _Context) -> rt.RuntimeStatusResponse:
        cfg = self.config
        status = rt.RuntimeStatusResponse.STARTING
        if self.state.past_startup():
            status = rt.RuntimeStatusResponse.READY
            # SPEC §1: the runtime purges loaded models before answering READY. meshd asks
            # only while it starts, so a restarted meshd finds an empty runtime, never one
            # holding copies it does not know about.
            if self.state.loaded or self.state.loads_in_flight:
                log.info("purging %d loaded models before READY", len(self.state.loaded))
            self.state.purge()
            self.state.ready_announced = True
        resp = rt.RuntimeStatusResponse(
            status=status,
            capacityInBytes=cfg.capacity_bytes,
            maxLoadingConcurrency=cfg.max_loading_concurrency,
            modelLoadingTimeoutMs=cfg.loading_timeout_ms,
            defaultModelSizeInBytes=cfg.default_model_size,
            runtimeVersion=RUNTIME_VERSION,
            limitModelConcurrency=cfg.limit_model_concurrency,
            allowAnyMethod=False,
        )
        for method in ANNOUNCED_METHODS:
            info = resp.methodInfos[f"{INFERENCE_SERVICE}/{method}"]
            if cfg.inject_id and method in INJECTABLE_METHODS:
                info.idInjectionPath.append(1)
        for method in ECHO_METHODS:
            resp.methodInfos[f"meshd.demo.Echo/{method}"].SetInParent()  # allowed, no injection
        return resp


# ---------------------------------------------------------------------------------------------
# KServe V2 inference


def header_model_id(context: _Context) -> str | None:
    """The model id from mm-model-id-bin (UTF-8) or mm-model-id, the -bin form winning."""
    plain: str | None = None
    for key, value in context.invocation_metadata() or ():
        if key == MODEL_ID_BIN_HEADER:
            try:
                return bytes(value).decode("utf-8")
            except UnicodeDecodeError:
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"{MODEL_ID_BIN_HEADER} is not UTF-8") from None
        if key == MODEL_ID_HEADER and plain is None:
            plain = str(value)
    return plain


def _model_id(context: _Context, body_name: str) -> str:
    model_id = header_model_id(context) or body_name
    if not model_id:
        raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"no model named: set {MODEL_ID_HEADER} or the model name")
    return model_id


M = TypeVar("M", bound=Message)


def _parse(message_type: type[M], raw: bytes) -> M:
    try:
        message: M = message_type.FromString(raw)
    except DecodeError as e:
        raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {message_type.DESCRIPTOR.name}: {e}") from None
    return message


def infer(model_id: str, loaded: LoadedModel, req: pb.ModelInferRequest) -> pb.ModelInferResponse:
    """Run one request through a loaded model; RpcFailure(INVALID_ARGUMENT) on bad tensors."""
    model = loaded.model
    if model.kind == "echo":
        resp = pb.ModelInferResponse(model_name=model_id, id=req.id)
        for tensor in req.inputs:
            resp.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape, contents=tensor.contents)
        resp.raw_output_contents.extend(req.raw_input_contents)
        return resp
    try:
        rows = decode_infer_request(req, model.inputs)
    except ValueError as e:
        raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"model {model_id}: {e}") from None
    resp = make_infer_response(model_id, model.predict(rows), model.outputs)
    resp.id = req.id
    return resp


class InferenceService:
    """inference.GRPCInferenceService over raw bytes; `handler()` gives the generic handler."""

    def __init__(self, state: RuntimeState) -> None:
        self.state = state

    @_answers_errors
    async def ModelInfer(self, raw: bytes, context: _Context) -> pb.ModelInferResponse:
        req = _parse(pb.ModelInferRequest, raw)
        model_id = self._body_model_id(context, req.model_name)
        with self.state.counting():
            if self.state.config.infer_delay_ms:
                await asyncio.sleep(self.state.config.infer_delay_ms / 1000)
            loaded = self.state.get(model_id)
            await model_work.serve(loaded.model.work)  # the model file's service_ms
            return infer(model_id, loaded, req)

    def _body_model_id(self, context: _Context, body_name: str) -> str:
        # With idInjectionPath announced, the body names the model (as with Triton): meshd
        # wrote the concrete id there. Otherwise the header wins, as upstream runtimes do.
        if self.state.config.inject_id and body_name:
            return body_name
        return _model_id(context, body_name)

    async def ModelStreamInfer(
        self, requests: AsyncIterator[bytes], context: _Context
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        # Triton semantics: one response per request; a bad request is an error_message, not the end.
        try:
            header_id = header_model_id(context)
        except RpcFailure as e:
            await context.abort(e.code, e.details)
            return
        async for raw in requests:
            try:
                req = _parse(pb.ModelInferRequest, raw)
                model_id = header_id or req.model_name
                if not model_id:
                    raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "no model named in the request")
                yield pb.ModelStreamInferResponse(infer_response=infer(model_id, self.state.get(model_id), req))
            except RpcFailure as e:
                yield pb.ModelStreamInferResponse(error_message=e.details)

    @_answers_errors
    async def ModelMetadata(self, raw: bytes, context: _Context) -> pb.ModelMetadataResponse:
        req = _parse(pb.ModelMetadataRequest, raw)
        model_id = self._body_model_id(context, req.name)
        model = self.state.get(model_id).model
        resp = pb.ModelMetadataResponse(name=model_id, versions=["1"], platform=PLATFORM)
        if model.kind == "linear":
            resp.inputs.add(name="x", datatype="FP32", shape=[-1, model.inputs])
            resp.outputs.add(name="y", datatype="FP32", shape=[-1, model.outputs])
        return resp

    @_answers_errors
    async def ModelReady(self, raw: bytes, context: _Context) -> pb.ModelReadyResponse:
        req = _parse(pb.ModelReadyRequest, raw)
        # Like Triton: an unknown model is "not ready", not an error.
        return pb.ModelReadyResponse(ready=_model_id(context, req.name) in self.state.loaded)

    @_answers_errors
    async def ModelConfig(self, raw: bytes, context: _Context) -> pb.ModelConfigResponse:
        req = _parse(pb.ModelConfigRequest, raw)
        model_id = _model_id(context, req.name)
        self.state.get(model_id)
        return pb.ModelConfigResponse(config=pb.ModelConfig(name=model_id, platform=PLATFORM, backend=PLATFORM))

    @_answers_errors
    async def ServerLive(self, raw: bytes, context: _Context) -> pb.ServerLiveResponse:
        _parse(pb.ServerLiveRequest, raw)
        return pb.ServerLiveResponse(live=True)

    @_answers_errors
    async def ServerReady(self, raw: bytes, context: _Context) -> pb.ServerReadyResponse:
        _parse(pb.ServerReadyRequest, raw)
        return pb.ServerReadyResponse(ready=self.state.past_startup())

    @_answers_errors
    async def ServerMetadata(self, raw: bytes, context: _Context) -> pb.ServerMetadataResponse:
        _parse(pb.ServerMetadataRequest, raw)
        return pb.ServerMetadataResponse(
            name=PLATFORM, version=meshd.__version__, extensions=["model_repository", "model_configuration"]
        )

    @_answers_errors
    async def RepositoryIndex(self, raw: bytes, context: _Context) -> pb.RepositoryIndexResponse:
        _parse(pb.RepositoryIndexRequest, raw)
        resp = pb.RepositoryIndexResponse()
        for model_id in sorted(self.state.loaded):
            resp.models.add(name=model_id, version="1", state="READY")
        return resp

    @_answers_errors
    async def RepositoryModelLoad(self, raw: bytes, context: _Context) -> pb.RepositoryModelLoadResponse:
        raise RpcFailure(grpc.StatusCode.UNIMPLEMENTED, "models are loaded through mmesh.ModelRuntime/loadModel")

    @_answers_errors
    async def RepositoryModelUnload(self, raw: bytes, context: _Context) -> pb.RepositoryModelUnloadResponse:
        raise RpcFailure(grpc.StatusCode.UNIMPLEMENTED, "models are unloaded through mmesh.ModelRuntime/unloadModel")

    def handler(self) -> Any:
        """The generic handler for the service; methods not listed answer UNIMPLEMENTED."""
        unary: dict[str, Callable[..., Any]] = {
            "ModelInfer": self.ModelInfer,
            "ModelMetadata": self.ModelMetadata,
            "ModelReady": self.ModelReady,
            "ModelConfig": self.ModelConfig,
            "ServerLive": self.ServerLive,
            "ServerReady": self.ServerReady,
            "ServerMetadata": self.ServerMetadata,
            "RepositoryIndex": self.RepositoryIndex,
            "RepositoryModelLoad": self.RepositoryModelLoad,
            "RepositoryModelUnload": self.RepositoryModelUnload,
        }
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(fn, request_deserializer=None, response_serializer=_serialize)
            for name, fn in unary.items()
        }
        handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
            self.ModelStreamInfer, request_deserializer=None, response_serializer=_serialize
        )
        return grpc.method_handlers_generic_handler(INFERENCE_SERVICE, handlers)


def _serialize(message: Message) -> bytes:
    data: bytes = message.SerializeToString()
    return data


class DiskTierServicer(disk_pb2_grpc.DiskTierServicer):  # type: ignore[misc]
    """`--disk-dir`: the folder's entries are the models on this runtime's disk, each file's
    or folder's size at the configured pull speed (the demo has no store to pull from; a test
    puts files there as pulls would)."""

    def __init__(self, folder: Path, pull_ms_per_gib: int) -> None:
        self.folder = folder
        self.pull_ms_per_gib = pull_ms_per_gib

    @_answers_errors
    async def diskInventory(
        self, request: disk_pb2.DiskInventoryRequest, context: _Context
    ) -> disk_pb2.DiskInventoryResponse:
        models = []
        try:
            entries = sorted(self.folder.iterdir())
        except OSError as e:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, f"cannot list the disk tier {self.folder}: {e}") from None
        for entry in entries:
            try:
                size = _tree_size(entry)
                mtime_ms = int(entry.stat().st_mtime * 1000)
            except OSError:
                continue  # removed meanwhile
            pull_ms = max(1, size * self.pull_ms_per_gib >> 30)
            models.append(
                disk_pb2.DiskModel(model_id=entry.name, size_bytes=size, pull_ms=pull_ms, last_used_ms=mtime_ms)
            )
        version = hash(tuple((m.model_id, m.size_bytes) for m in models)) & ((1 << 63) - 1)
        used = sum(m.size_bytes for m in models)
        return disk_pb2.DiskInventoryResponse(models=models, used_bytes=used, version=version)


def _tree_size(path: Path) -> int:
    if not path.is_dir():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def add_runtime_servicer(server: Any, state: RuntimeState) -> None:
    rt_grpc.add_ModelRuntimeServicer_to_server(ModelRuntimeServicer(state), server)
    cfg = state.config
    if cfg.disk_dir is not None:
        disk_pb2_grpc.add_DiskTierServicer_to_server(DiskTierServicer(cfg.disk_dir, cfg.disk_pull_ms_per_gib), server)
