"""An in-memory stand-in for `RuntimeClient`, for hermetic tests of the local-copy logic.

It records every call in order, can hold a load open until released, fail loads of chosen
models, be down (connections refused) or busy (no answer in time), and answers like the SPI
(NOT_FOUND-free unloads, sizes, a purge when runtimeStatus answers READY). Real-runtime behaviour is
tested against the reference runtime process; this fake only makes races reproducible.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from meshd.runtime.client import LoadedModel, RuntimeInfo, RuntimeNotReady

MIB = 1 << 20


class FakeRpcError(grpc.aio.AioRpcError):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def runtime_info(capacity_models: int = 4, model_size: int = MIB, loading_timeout_ms: int = 2000) -> RuntimeInfo:
    return RuntimeInfo(
        capacity_bytes=capacity_models * model_size,
        max_loading_concurrency=4,
        loading_timeout_ms=loading_timeout_ms,
        default_model_size=model_size,
        version="fake",
    )


@dataclass
class FakeRuntime:
    size: int = MIB
    log: list[tuple[str, str]] = field(default_factory=list)
    loaded: set[str] = field(default_factory=set)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)  # hold loads of these ids
    fail: set[str] = field(default_factory=set)
    unload_delay_s: float = 0.0  # a slow unload makes an untracked one race a later load
    down: bool = False  # every call fails UNAVAILABLE (a refused connection)
    busy: bool = False  # probes fail DEADLINE_EXCEEDED (connected, too loaded to answer in time)
    endpoint: str = "fake"

    def hold(self, model_id: str) -> asyncio.Event:
        gate = self.gates[model_id] = asyncio.Event()
        return gate

    async def predict_size(self, model_id: str, model_type: str, path: str, key: str) -> int | None:
        return None

    async def model_size(self, model_id: str) -> int | None:
        return self.size

    def _answer(self) -> None:
        if self.down:
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")

    async def probe(self, model_id: str, timeout_s: float) -> None:
        self.log.append(("probe", model_id))
        self._answer()
        if self.busy:
            raise FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if model_id and model_id not in self.loaded:
            raise FakeRpcError(grpc.StatusCode.NOT_FOUND, f"{model_id} not loaded")

    async def has_model(self, model_id: str) -> bool | None:
        return None if self.down else model_id in self.loaded

    async def wait_ready(self, timeout_s: float = 0, interval_s: float = 0) -> RuntimeInfo:
        if self.down:
            raise RuntimeNotReady("fake runtime down")
        self.log.append(("purge", ""))
        self.loaded.clear()  # a runtime answering READY has purged its models (SPEC §1)
        return runtime_info()

    async def load(
        self, model_id: str, model_type: str, path: str, key: str, timeout_s: float, longest_s: float = 0.0
    ) -> LoadedModel:
        self.log.append(("load", model_id))
        gate = self.gates.get(model_id)
        if gate is not None:
            await gate.wait()
        self._answer()
        if model_id in self.fail:
            raise FakeRpcError(grpc.StatusCode.INTERNAL, f"injected failure for {model_id}")
        self.loaded.add(model_id)
        return LoadedModel(self.size, 0)

    async def unload(self, model_id: str) -> None:
        self.log.append(("unload-start", model_id))
        await asyncio.sleep(self.unload_delay_s)
        self.log.append(("unload", model_id))
        self.loaded.discard(model_id)

    async def close(self) -> None:
        return None
