"""The LLM runtime's engines and its ModelRuntime (SPI) servicer.

`loadModel` starts one engine process for the model (a free port, ready when it answers
`GET /v1/models`) and reports what it really takes (the resident memory of its process
group); `unloadModel` stops it; `runtimeStatus` stops every engine before answering READY
(SPI) and announces the inference methods, each with `idInjectionPath [1]`.

Every engine is supervised. Its exit is seen at once (a thread waits on the process); the
engine is started again after a doubling delay (engines.restart_delay) and, meanwhile, a
call for its model is answered at once: UNAVAILABLE, "restarting", so meshd tries another
copy or tells its client to retry. An engine that keeps failing is given up: its model is
reported gone (`modelSize` NOT_FOUND), and meshd drops the copy and loads it again where
placement says.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from meshd._proto.mmesh import model_runtime_pb2 as rt
from meshd._proto.mmesh import model_runtime_pb2_grpc as rt_grpc
from meshd.adapter import gpu, sizing, stored
from meshd.adapter.llm.engines import RestartPolicy, adapter_refusal, engine_argv, restart_delay
from meshd.adapter.llm.grpc_abort import abort
from meshd.adapter.llm.load import LoadWatch
from meshd.adapter.llm.process import EngineProcess, EngineStartError, describe_exit, free_port
from meshd.core.model_types import ADAPTER_SLOTS_FULL, LLM_MODEL_TYPES, base_model_of, is_llm_type
from meshd.storage import StorageHelper

log = logging.getLogger(__name__)

ADAPTER_TYPE = "lora"
LOAD_ADAPTER_PATH = "/v1/load_lora_adapter"  # vLLM's run-time LoRA endpoints
UNLOAD_ADAPTER_PATH = "/v1/unload_lora_adapter"


class AdapterSlotsFull(Exception):
    """The base's engine holds as many adapters as it takes (RESOURCE_EXHAUSTED): meshd
    evicts one of them and loads again."""


class BaseNotLoaded(Exception):
    """An adapter's base model is not loaded (or is restarting) here: UNAVAILABLE, so meshd
    does not count it as the adapter's failure."""


INJECTED = (
    "meshd.llm.OpenAI/Call",
    "inference.GRPCInferenceService/ModelInfer",
    "inference.GRPCInferenceService/ModelStreamInfer",
    "inference.GRPCInferenceService/ModelMetadata",
    "inference.GRPCInferenceService/ModelConfig",
    "inference.GRPCInferenceService/ModelReady",
)


@dataclass(frozen=True, slots=True)
class LlmConfig:
    engine: str  # preset name, or "custom"
    template: str  # the engine's command line (engines.PRESETS or --engine-command)
    python: str  # {python}: the engine venv's interpreter
    extra_args: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: Path = Path(".meshd-llm")
    model_root: Path | None = None
    capacity_bytes: int = 2 << 30
    default_model_size: int = 512 << 20
    max_loading_concurrency: int = 1
    loading_timeout_ms: int = 120_000
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    adapter_slots: int = 4  # LoRA adapters an engine takes at a time (vLLM's --max-loras)
    version: str = "meshd-llm-runtime"
    # --gpu-capacity on: the `pynvml` module; an engine's size is then its processes' GPU memory
    gpu: Any | None = None


class State(Enum):
    READY = "ready"
    RESTARTING = "restarting"


@dataclass
class Served:
    """One loaded model: its engine and what its supervision knows."""

    model_id: str
    model_type: str
    path: str
    engine: EngineProcess
    size_bytes: int
    state: State = State.READY
    exits_ms: list[int] = field(default_factory=list)
    last_exit: str = ""
    back_at: float = 0.0  # time.monotonic() the restarted engine is expected to answer
    watcher: asyncio.Task[None] | None = None
    started_s: float = 0.0  # how long its last start took
    base: Served | None = None  # a LoRA adapter: the base model whose engine serves it
    watch: LoadWatch = field(default_factory=LoadWatch)  # its engine's load (an adapter: its base's)

    @property
    def owner(self) -> Served:
        """Whose engine answers for this model: its own, or its base's for an adapter."""
        return self.base or self

    def restarting_message(self) -> str:
        owner = self.owner
        wait = max(0.0, owner.back_at - time.monotonic())
        return (
            f"the engine of model {self.model_id!r} is restarting (it stopped: {owner.last_exit}); "
            f"back in about {max(wait, 0.1):.1f} s"
        )


class Engines:
    """The engine of each loaded model, started, stopped and supervised."""

    def __init__(self, config: LlmConfig, storage: StorageHelper | None = None) -> None:
        self.config = config
        # Issue 42: models whose key or path names a store are pulled to local disk first
        # (LlmRuntime.loadModel); their files stay there after an unload (the disk tier)
        self.storage = storage
        self.served: dict[str, Served] = {}
        self.session: aiohttp.ClientSession | None = None
        self._loading = asyncio.Semaphore(max(1, config.max_loading_concurrency))
        self._locks: dict[str, asyncio.Lock] = {}

    async def start(self) -> None:
        # No pooled-connection limit: each engine answers many calls at once.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

    async def close(self) -> None:
        await self.purge()
        if self.session is not None:
            await self.session.close()

    def http(self) -> aiohttp.ClientSession:
        assert self.session is not None, "Engines.start() first"
        return self.session

    async def held_bytes(self, engine: EngineProcess) -> int:
        """What an engine really holds: with --gpu-capacity on, the GPU memory NVML lists for its
        process group (vLLM's workers, contexts included), else (or where NVML lists none of its
        processes: an engine on the CPU) the group's resident memory."""
        if self.config.gpu is not None:
            on_gpu = await asyncio.to_thread(gpu.processes_gpu_bytes, self.config.gpu, engine.pids())
            if on_gpu:
                return on_gpu
        return max(1, engine.rss_bytes())

    def model_path(self, path: str) -> Path:
        p = Path(path)
        if not p.is_absolute() and self.config.model_root is not None:
            p = self.config.model_root / p
        return p

    def _engine(self, model_id: str, path: Path) -> EngineProcess:
        cfg = self.config
        port = free_port(cfg.host)
        argv = engine_argv(cfg.template, cfg.python, str(path), model_id, cfg.host, port, cfg.extra_args)
        env = {**os.environ, **cfg.env}
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_id)
        return EngineProcess(argv, cfg.host, port, cfg.workdir / "logs" / f"{safe}.log", env)

    async def load(self, model_id: str, model_type: str, path: str, key: str = "") -> Served:
        """The model's engine, started if need be. ValueError: not a model this runtime
        takes; EngineStartError: the engine did not come up."""
        lock = self._locks.setdefault(model_id, asyncio.Lock())
        async with lock:
            served = self.served.get(model_id)
            if served is not None:
                return served
            if model_type.lower() == ADAPTER_TYPE:
                return await self._load_adapter(model_id, path, key)
            if not is_llm_type(model_type):
                raise ValueError(
                    f"model {model_id!r} has type {model_type!r}; this runtime serves language models "
                    f"(types {', '.join(sorted(LLM_MODEL_TYPES))})"
                )
            model_path = self.model_path(path)
            if not model_path.exists():
                raise FileNotFoundError(f"model {model_id!r}: {model_path} does not exist")
            async with self._loading:
                engine = self._engine(model_id, model_path)
                began = time.monotonic()
                try:
                    await engine.start(self.http(), self.config.loading_timeout_ms / 1000)
                except BaseException:
                    await engine.stop()  # a cancelled or failed load leaves no process behind
                    raise
            served = Served(model_id, model_type, str(model_path), engine, await self.held_bytes(engine))
            served.started_s = time.monotonic() - began
            served.watcher = asyncio.create_task(self._supervise(served), name=f"supervise {model_id}")
            self.served[model_id] = served
            log.info(
                "loaded %s: engine pid %s on port %d, %.0f MiB, ready in %.2f s",
                model_id,
                engine.child.pid if engine.child else "?",
                engine.port,
                served.size_bytes / (1 << 20),
                served.started_s,
            )
            return served

    async def unload(self, model_id: str) -> bool:
        """Stop the model's engine (an adapter: take it out of its base's); False if none."""
        served = self.served.pop(model_id, None)
        if served is None:
            return False
        self.release(model_id)
        if served.base is not None:
            try:
                await self._adapter_call(served, UNLOAD_ADAPTER_PATH, {"lora_name": model_id}, missing_ok=True)
            except EngineStartError as e:  # its engine is down or gone: the adapter went with it
                log.warning("unloading adapter %s: %s", model_id, e)
            log.info("unloaded adapter %s from %s", model_id, served.base.model_id)
            return True
        for adapter in [a for a in self.served.values() if a.base is served]:  # they go with their base
            del self.served[adapter.model_id]
            self.release(adapter.model_id)
        if served.watcher is not None:
            served.watcher.cancel()
        await served.engine.stop()
        log.info("unloaded %s", model_id)
        return True

    def _forget(self, served: Served) -> None:
        """A model given up: it and the adapters in its engine are reported gone."""
        for adapter in self.adapters_of(served):
            self.served.pop(adapter.model_id, None)
            self.release(adapter.model_id)
        if self.served.get(served.model_id) is served:
            del self.served[served.model_id]
            self.release(served.model_id)

    def release(self, model_id: str) -> None:
        """The model is not loaded here (any more): its pulled files stay, evictable."""
        if self.storage is not None:
            self.storage.release(model_id)  # its files stay on disk (the tier), evictable

    def adapters_of(self, base: Served) -> list[Served]:
        return [a for a in self.served.values() if a.base is base]

    async def _load_adapter(self, model_id: str, path: str, key: str) -> Served:
        """A LoRA adapter into its base model's engine (which must be loaded here: meshd loads
        the base first). AdapterSlotsFull when the base's engine holds as many as it takes;
        ValueError when this runtime's engine cannot load adapters at run time."""
        refusal = adapter_refusal(self.config.engine)
        if refusal is not None:
            raise ValueError(f"adapter {model_id!r}: {refusal}")
        base_id = base_model_of(key)
        if not base_id:
            raise ValueError(
                f'adapter {model_id!r} names no base model (its key needs {{"meshd": {{"base_model": ...}}}})'
            )
        async with self._locks.setdefault(f"base:{base_id}", asyncio.Lock()):  # slots counted one at a time
            return await self._load_adapter_into(model_id, path, base_id)

    async def _load_adapter_into(self, model_id: str, path: str, base_id: str) -> Served:
        base = self.served.get(base_id)
        if base is None or base.base is not None:
            raise BaseNotLoaded(f"adapter {model_id!r}: its base model {base_id!r} is not loaded here")
        if base.state is State.RESTARTING:
            raise BaseNotLoaded(f"adapter {model_id!r}: {base.restarting_message()}")
        held = self.adapters_of(base)
        if len(held) >= self.config.adapter_slots:
            names = ", ".join(sorted(a.model_id for a in held))
            slots = self.config.adapter_slots
            raise AdapterSlotsFull(
                f"{ADAPTER_SLOTS_FULL}: base model {base_id!r} holds {len(held)} of {slots} ({names})"
            )
        adapter_path = self.model_path(path)
        if not adapter_path.exists():
            raise FileNotFoundError(f"adapter {model_id!r}: {adapter_path} does not exist")
        size = max(1, sum(f.stat().st_size for f in adapter_path.rglob("*") if f.is_file()))
        served = Served(model_id, ADAPTER_TYPE, str(adapter_path), base.engine, size, base=base)
        await self._adapter_call(served, LOAD_ADAPTER_PATH, {"lora_name": model_id, "lora_path": str(adapter_path)})
        if self.served.get(base_id) is not base:  # the base went meanwhile: so did the adapter
            raise BaseNotLoaded(f"adapter {model_id!r}: its base model {base_id!r} was unloaded meanwhile")
        self.served[model_id] = served
        log.info("loaded adapter %s into the engine of %s", model_id, base_id)
        return served

    async def _adapter_call(self, adapter: Served, path: str, body: dict[str, str], missing_ok: bool = False) -> None:
        base = adapter.owner
        try:
            async with self.http().post(base.engine.base_url + path, json=body) as r:
                if r.status == 200 or (missing_ok and r.status == 404):
                    return
                text = (await r.text())[:500]
        except aiohttp.ClientError as e:
            text = f"{type(e).__name__}: {e}"
        raise EngineStartError(f"the engine of {base.model_id!r} refused {path} for {adapter.model_id!r}: {text}")

    async def purge(self) -> None:
        for model_id in [m for m, s in self.served.items() if s.base is None]:
            await self.unload(model_id)

    async def _supervise(self, served: Served) -> None:
        """Start the engine again each time it exits on its own; give it up when it keeps failing."""
        policy = self.config.restart
        while True:
            code = await served.engine.wait()
            if served.engine.stopping:
                return
            served.state = State.RESTARTING
            served.last_exit = describe_exit(code)
            while True:
                now_ms = int(time.time() * 1000)
                served.exits_ms.append(now_ms)
                delay = restart_delay(served.exits_ms, now_ms, policy)
                if delay is None:
                    log.error(
                        "the engine of %s failed %d times in %.0f s (last: %s): giving it up, the model is gone",
                        served.model_id,
                        len(served.exits_ms),
                        policy.window_s,
                        served.last_exit,
                    )
                    self._forget(served)
                    return
                served.back_at = time.monotonic() + delay + served.started_s
                log.warning(
                    "the engine of %s stopped (%s); starting it again in %.2f s",
                    served.model_id,
                    served.last_exit,
                    delay,
                )
                await served.engine.stop()  # what the leader left behind (vLLM's workers) goes too
                await asyncio.sleep(delay)
                engine = self._engine(served.model_id, Path(served.path))
                served.engine = engine
                try:
                    await engine.start(self.http(), self.config.loading_timeout_ms / 1000)
                except Exception as e:  # a failed start counts as one more exit
                    served.last_exit = str(e)[:300]
                    continue
                break
            for adapter in self.adapters_of(served):  # a new engine holds none of them
                adapter.engine = engine
                try:
                    body = {"lora_name": adapter.model_id, "lora_path": adapter.path}
                    await self._adapter_call(adapter, LOAD_ADAPTER_PATH, body)
                except EngineStartError as e:
                    log.warning("adapter %s is gone with its engine: %s", adapter.model_id, e)
                    self.served.pop(adapter.model_id, None)
            served.state = State.READY
            served.size_bytes = await self.held_bytes(engine)
            log.info("the engine of %s is back on port %d", served.model_id, engine.port)


def engine_file(path: Path) -> Path:
    """What an engine is given for a pulled model: the GGUF file when the model is a folder
    holding exactly one (llama.cpp takes a file, not a folder); else the path as it is."""
    if path.is_dir():
        ggufs = [f for f in path.rglob("*.gguf") if f.is_file()]
        if len(ggufs) == 1:
            return ggufs[0]
    return path


class LlmRuntime(rt_grpc.ModelRuntimeServicer):  # type: ignore[misc]
    """The SPI over `Engines`."""

    def __init__(self, engines: Engines, methods: Sequence[str] = INJECTED) -> None:
        self.engines = engines
        self.methods = methods

    async def loadModel(self, request: rt.LoadModelRequest, context: Any) -> rt.LoadModelResponse:
        path, key = request.modelPath, request.modelKey
        try:
            pulled = await stored.pull(self.engines.storage, request.modelId, path, key)
        except stored.Failure as e:
            await abort(context, e.code, e.details)
        if pulled is not None:
            path, key = pulled.local_path, pulled.key
            if request.modelType.lower() != ADAPTER_TYPE:
                path = str(engine_file(Path(path)))
        try:
            served = await self._load(request, context, path, key)
        except BaseException:
            if pulled is not None and request.modelId not in self.engines.served:
                self.engines.release(request.modelId)  # not loaded: its files may be evicted
            raise
        return rt.LoadModelResponse(sizeInBytes=served.size_bytes)

    async def _load(self, request: rt.LoadModelRequest, context: Any, path: str, key: str) -> Served:
        """The engine's load, its failures as gRPC statuses."""
        try:
            return await self.engines.load(request.modelId, request.modelType, path, key)
        except AdapterSlotsFull as e:
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except BaseNotLoaded as e:  # not the adapter's fault: meshd loads it again, the base first
            await abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        except ValueError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except FileNotFoundError as e:
            await abort(context, grpc.StatusCode.NOT_FOUND, str(e))
        except EngineStartError as e:
            await abort(context, grpc.StatusCode.INTERNAL, f"loading {request.modelId!r} failed: {e}")

    async def unloadModel(self, request: rt.UnloadModelRequest, context: Any) -> rt.UnloadModelResponse:
        if not await self.engines.unload(request.modelId):
            await abort(context, grpc.StatusCode.NOT_FOUND, f"model {request.modelId!r} is not loaded")
        return rt.UnloadModelResponse()

    async def predictModelSize(self, request: rt.PredictModelSizeRequest, context: Any) -> rt.PredictModelSizeResponse:
        try:
            listed = await stored.listed_size(
                self.engines.storage, request.modelId, request.modelPath, request.modelKey
            )
        except stored.Failure as e:
            await abort(context, e.code, e.details)
        if listed is not None:  # a stored model: its files' size (an engine maps a GGUF whole)
            default = self.engines.config.default_model_size
            return rt.PredictModelSizeResponse(sizeInBytes=sizing.model_size(request.modelKey, listed, 1.0, default))
        if request.modelType.lower() == ADAPTER_TYPE:  # its files: an adapter adds little to its engine
            path = self.engines.model_path(request.modelPath)
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0
            return rt.PredictModelSizeResponse(sizeInBytes=max(1, size))
        return rt.PredictModelSizeResponse(sizeInBytes=self.engines.config.default_model_size)

    async def modelSize(self, request: rt.ModelSizeRequest, context: Any) -> rt.ModelSizeResponse:
        served = self.engines.served.get(request.modelId)
        if served is None:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"model {request.modelId!r} is not loaded")
        if served.state is State.READY and served.base is None:
            served.size_bytes = await self.engines.held_bytes(served.engine)
        return rt.ModelSizeResponse(sizeInBytes=served.size_bytes)

    async def runtimeStatus(self, request: rt.RuntimeStatusRequest, context: Any) -> rt.RuntimeStatusResponse:
        cfg = self.engines.config
        await self.engines.purge()  # SPI: nothing is loaded when it answers READY
        resp = rt.RuntimeStatusResponse(
            status=rt.RuntimeStatusResponse.READY,
            capacityInBytes=cfg.capacity_bytes,
            maxLoadingConcurrency=cfg.max_loading_concurrency,
            modelLoadingTimeoutMs=cfg.loading_timeout_ms,
            defaultModelSizeInBytes=cfg.default_model_size,
            runtimeVersion=cfg.version,
        )
        for method in self.methods:
            resp.methodInfos[method].idInjectionPath.append(1)
        return resp
