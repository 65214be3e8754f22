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
from meshd.adapter.llm.engines import RestartPolicy, engine_argv, restart_delay
from meshd.adapter.llm.grpc_abort import abort
from meshd.adapter.llm.process import EngineProcess, EngineStartError, describe_exit, free_port
from meshd.core.model_types import LLM_MODEL_TYPES, is_llm_type

log = logging.getLogger(__name__)

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
    version: str = "meshd-llm-runtime"


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

    def restarting_message(self) -> str:
        wait = max(0.0, self.back_at - time.monotonic())
        return (
            f"the engine of model {self.model_id!r} is restarting (it stopped: {self.last_exit}); "
            f"back in about {max(wait, 0.1):.1f} s"
        )


class Engines:
    """The engine of each loaded model, started, stopped and supervised."""

    def __init__(self, config: LlmConfig) -> None:
        self.config = config
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

    async def load(self, model_id: str, model_type: str, path: str) -> Served:
        """The model's engine, started if need be. ValueError: not a model this runtime
        takes; EngineStartError: the engine did not come up."""
        lock = self._locks.setdefault(model_id, asyncio.Lock())
        async with lock:
            served = self.served.get(model_id)
            if served is not None:
                return served
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
            served = Served(model_id, model_type, str(model_path), engine, max(1, engine.rss_bytes()))
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
        """Stop the model's engine; False if it had none."""
        served = self.served.pop(model_id, None)
        if served is None:
            return False
        if served.watcher is not None:
            served.watcher.cancel()
        await served.engine.stop()
        log.info("unloaded %s", model_id)
        return True

    async def purge(self) -> None:
        for model_id in list(self.served):
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
                    if self.served.get(served.model_id) is served:
                        del self.served[served.model_id]
                    return
                served.back_at = time.monotonic() + delay + served.started_s
                log.warning(
                    "the engine of %s stopped (%s); starting it again in %.2f s",
                    served.model_id,
                    served.last_exit,
                    delay,
                )
                await asyncio.sleep(delay)
                engine = self._engine(served.model_id, Path(served.path))
                served.engine = engine
                try:
                    await engine.start(self.http(), self.config.loading_timeout_ms / 1000)
                except EngineStartError as e:
                    served.last_exit = str(e)[:300]
                    continue
                break
            served.state = State.READY
            served.size_bytes = max(1, engine.rss_bytes())
            log.info("the engine of %s is back on port %d", served.model_id, engine.port)


class LlmRuntime(rt_grpc.ModelRuntimeServicer):  # type: ignore[misc]
    """The SPI over `Engines`."""

    def __init__(self, engines: Engines, methods: Sequence[str] = INJECTED) -> None:
        self.engines = engines
        self.methods = methods

    async def loadModel(self, request: rt.LoadModelRequest, context: Any) -> rt.LoadModelResponse:
        try:
            served = await self.engines.load(request.modelId, request.modelType, request.modelPath)
        except ValueError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except FileNotFoundError as e:
            await abort(context, grpc.StatusCode.NOT_FOUND, str(e))
        except EngineStartError as e:
            await abort(context, grpc.StatusCode.INTERNAL, f"loading {request.modelId!r} failed: {e}")
        return rt.LoadModelResponse(sizeInBytes=served.size_bytes)

    async def unloadModel(self, request: rt.UnloadModelRequest, context: Any) -> rt.UnloadModelResponse:
        if not await self.engines.unload(request.modelId):
            await abort(context, grpc.StatusCode.NOT_FOUND, f"model {request.modelId!r} is not loaded")
        return rt.UnloadModelResponse()

    async def predictModelSize(self, request: rt.PredictModelSizeRequest, context: Any) -> rt.PredictModelSizeResponse:
        return rt.PredictModelSizeResponse(sizeInBytes=self.engines.config.default_model_size)

    async def modelSize(self, request: rt.ModelSizeRequest, context: Any) -> rt.ModelSizeResponse:
        served = self.engines.served.get(request.modelId)
        if served is None:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"model {request.modelId!r} is not loaded")
        if served.state is State.READY:
            served.size_bytes = max(1, served.engine.rss_bytes())
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
