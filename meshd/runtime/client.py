"""The ModelRuntime SPI client: status polling, load, unload, sizing (SPEC §1).

Only I/O and protocol facts live here; what to load and when is decided elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from meshd._proto.meshd import disk_pb2, disk_pb2_grpc
from meshd._proto.mmesh import model_runtime_pb2 as rt
from meshd._proto.mmesh import model_runtime_pb2_grpc as rt_grpc
from meshd.decisions.load_deadline import PULL_POLL_MS, PullSeen, load_cut_at_ms, pull_seen
from meshd.runtime.endpoints import open_channel

log = logging.getLogger(__name__)

STATUS_POLL_INTERVAL_S = 2.0  # upstream polls runtimeStatus every ~2 s at start
STATUS_POLL_TIMEOUT_S = 180.0  # ... for up to ~3 min
PREDICT_SIZE_TIMEOUT_S = 0.5  # upstream's short deadline for the optional predictModelSize
MODEL_SIZE_TIMEOUT_S = 30.0
UNLOAD_TIMEOUT_S = 60.0
DEFAULT_LOADING_TIMEOUT_MS = 90_000  # used when the runtime reports 0
MIN_CAPACITY_BYTES = 1 << 20
DISK_INVENTORY_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class MethodInfo:
    id_injection_path: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class RuntimeInfo:
    """What the runtime reported when it became READY."""

    capacity_bytes: int
    max_loading_concurrency: int
    loading_timeout_ms: int
    default_model_size: int
    version: str
    method_infos: dict[str, MethodInfo] = field(default_factory=dict)
    limit_model_concurrency: bool = False
    allow_any_method: bool = False

    @classmethod
    def from_response(cls, r: rt.RuntimeStatusResponse) -> RuntimeInfo:
        default_size = r.defaultModelSizeInBytes or (1 << 20)
        return cls(
            capacity_bytes=max(r.capacityInBytes, MIN_CAPACITY_BYTES),
            max_loading_concurrency=max(1, r.maxLoadingConcurrency),
            loading_timeout_ms=r.modelLoadingTimeoutMs or DEFAULT_LOADING_TIMEOUT_MS,
            default_model_size=default_size,
            version=r.runtimeVersion,
            method_infos={
                name.lstrip("/"): MethodInfo(tuple(info.idInjectionPath)) for name, info in r.methodInfos.items()
            },
            limit_model_concurrency=r.limitModelConcurrency,
            allow_any_method=r.allowAnyMethod,
        )


@dataclass(frozen=True, slots=True)
class LoadedModel:
    size_bytes: int  # 0: ask modelSize later
    max_concurrency: int
    load_ms: float = 0.0  # the runtime's own time to load it (LoadQueue: no wait for a slot)


class RuntimeNotReady(Exception):
    pass


class LoadTimedOut(Exception):
    """The load ran past its time (`decisions.load_deadline`) and was cancelled."""

    def __init__(self, elapsed_s: float, pulled_s: float) -> None:
        self.elapsed_s = elapsed_s
        self.pulled_s = pulled_s
        pulling = f" ({pulled_s:.1f}s of it pulling)" if pulled_s else ""
        super().__init__(f"timed out after {elapsed_s:.1f}s{pulling}")


def _retrieve(f: asyncio.Future[rt.LoadModelResponse]) -> None:
    """Read a cut call's outcome, so asyncio does not report it as never retrieved."""
    if not f.cancelled():
        f.exception()


class RuntimeClient:
    def __init__(self, mgmt_endpoint: str, max_message_bytes: int) -> None:
        self.endpoint = mgmt_endpoint
        self.channel = open_channel(mgmt_endpoint, max_message_bytes)
        self.stub = rt_grpc.ModelRuntimeStub(self.channel)
        self.disk_stub = disk_pb2_grpc.DiskTierStub(self.channel)
        self.disk_tier: bool | None = None  # None until diskInventory answers or is UNIMPLEMENTED

    async def close(self) -> None:
        await self.channel.close()

    async def wait_ready(
        self, timeout_s: float = STATUS_POLL_TIMEOUT_S, interval_s: float = STATUS_POLL_INTERVAL_S
    ) -> RuntimeInfo:
        """Poll runtimeStatus until READY (the runtime purges its models first)."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while True:
            try:
                resp = await self.stub.runtimeStatus(rt.RuntimeStatusRequest(), timeout=max(1.0, interval_s))
                if resp.status == rt.RuntimeStatusResponse.READY:
                    return RuntimeInfo.from_response(resp)
                last = rt.RuntimeStatusResponse.Status.Name(resp.status)
            except grpc.aio.AioRpcError as e:
                last = f"{e.code().name}: {e.details()}"
            if time.monotonic() >= deadline:
                raise RuntimeNotReady(f"runtime at {self.endpoint} not READY after {timeout_s:.0f}s ({last})")
            log.info("waiting for runtime at %s (%s)", self.endpoint, last)
            await asyncio.sleep(interval_s)

    async def load(
        self, model_id: str, model_type: str, path: str, key: str, timeout_s: float, longest_s: float = 0.0
    ) -> LoadedModel:
        """loadModel within `timeout_s`, not counting the time the runtime's disk tier shows the
        model's pull taking, up to `longest_s` in all (`decisions.load_deadline`; 0 or a runtime
        without a tier: `timeout_s` flat). Raises LoadTimedOut when cut, AioRpcError otherwise."""
        req = rt.LoadModelRequest(modelId=model_id, modelType=model_type, modelPath=path, modelKey=key)
        if longest_s <= timeout_s or self.disk_tier is False:
            started = time.monotonic()
            try:
                resp = await self.stub.loadModel(req, timeout=timeout_s)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise LoadTimedOut(time.monotonic() - started, 0.0) from None
                raise
        else:
            resp = await self._load_watching_pull(req, int(timeout_s * 1000), int(longest_s * 1000))
        return LoadedModel(resp.sizeInBytes, resp.maxConcurrency)

    async def _load_watching_pull(
        self, req: rt.LoadModelRequest, timeout_ms: int, longest_ms: int
    ) -> rt.LoadModelResponse:
        loop = asyncio.get_running_loop()
        started = loop.time()
        # The call's own deadline only backs meshd's cut up (a month at most: gRPC's clock overflows).
        call = self.stub.loadModel(req, timeout=min(longest_ms / 1000, 30 * 86_400) + 1)
        answer: asyncio.Future[rt.LoadModelResponse] = asyncio.ensure_future(call)
        seen = PullSeen()
        try:
            while True:
                elapsed_ms = int((loop.time() - started) * 1000)
                cut_ms = load_cut_at_ms(timeout_ms, longest_ms, seen, elapsed_ms, PULL_POLL_MS)
                if elapsed_ms >= cut_ms:
                    raise LoadTimedOut(elapsed_ms / 1000, seen.pulled_ms / 1000)
                wait_ms = cut_ms - elapsed_ms if self.disk_tier is False else min(cut_ms - elapsed_ms, PULL_POLL_MS)
                done, _ = await asyncio.wait({answer}, timeout=wait_ms / 1000)
                if done:
                    return answer.result()
                if self.disk_tier is not False:
                    seen = await self._look_at_pull(req.modelId, seen)
        finally:
            if not answer.done():
                call.cancel()  # cut, or this load was cancelled: the runtime stops loading
                answer.add_done_callback(_retrieve)

    async def _look_at_pull(self, model_id: str, seen: PullSeen) -> PullSeen:
        try:
            inv = await self.disk_inventory()
        except grpc.aio.AioRpcError:
            return seen  # no answer this time: what was seen holds until the next look
        if inv is None:
            return seen
        running = next((p.elapsed_ms for p in inv.pulls if p.model_id == model_id), None)
        finished = next((m.pull_ms for m in inv.models if m.model_id == model_id), None)
        return pull_seen(seen, running, finished)

    async def unload(self, model_id: str) -> None:
        """Unload; NOT_FOUND counts as success (SPEC §1)."""
        try:
            await self.stub.unloadModel(rt.UnloadModelRequest(modelId=model_id), timeout=UNLOAD_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise

    async def predict_size(self, model_id: str, model_type: str, path: str, key: str) -> int | None:
        """Predicted size, or None when the runtime does not predict (UNIMPLEMENTED) or is slow."""
        req = rt.PredictModelSizeRequest(modelId=model_id, modelType=model_type, modelPath=path, modelKey=key)
        try:
            resp = await self.stub.predictModelSize(req, timeout=PREDICT_SIZE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            if e.code() not in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.DEADLINE_EXCEEDED):
                log.warning("predictModelSize(%s) failed: %s", model_id, e.details())
            return None
        return int(resp.sizeInBytes) or None

    async def has_model(self, model_id: str) -> bool | None:
        """Whether the runtime holds the model, by asking modelSize: NOT_FOUND means no;
        None when it cannot tell (modelSize unimplemented or failing)."""
        try:
            await self.stub.modelSize(rt.ModelSizeRequest(modelId=model_id), timeout=PREDICT_SIZE_TIMEOUT_S * 4)
        except grpc.aio.AioRpcError as e:
            return False if e.code() == grpc.StatusCode.NOT_FOUND else None
        return True

    async def probe(self, model_id: str, timeout_s: float) -> None:
        """Ask modelSize and let any error through: the caller reads the runtime's health
        from it (any answer: there; UNAVAILABLE: not). runtimeStatus would purge it."""
        await self.stub.modelSize(rt.ModelSizeRequest(modelId=model_id), timeout=timeout_s)

    async def disk_inventory(self) -> disk_pb2.DiskInventoryResponse | None:
        """What the runtime keeps on its disk tier (ours, `meshd.disk.DiskTier`, issue 42);
        None when it has no tier (UNIMPLEMENTED). Other failures raise AioRpcError."""
        try:
            resp: disk_pb2.DiskInventoryResponse = await self.disk_stub.diskInventory(
                disk_pb2.DiskInventoryRequest(), timeout=DISK_INVENTORY_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.disk_tier = False
                return None
            raise
        self.disk_tier = True
        return resp

    async def model_size(self, model_id: str) -> int | None:
        try:
            resp = await self.stub.modelSize(rt.ModelSizeRequest(modelId=model_id), timeout=MODEL_SIZE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.warning("modelSize(%s) failed: %s", model_id, e.details())
            return None
        return int(resp.sizeInBytes) or None
