"""A load's deadline does not count its pull (`decisions.load_deadline`), through the real
RuntimeClient over gRPC to a runtime of the test's own: `loadModel` takes as long as the test
says, `diskInventory` lists the model's pull as running for part of it. (The whole path, meshd
and an adapter pulling from a slow store, is in tests/integration/test_adapter_storage.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from meshd._proto.meshd import disk_pb2, disk_pb2_grpc
from meshd._proto.mmesh import model_runtime_pb2 as rt
from meshd._proto.mmesh import model_runtime_pb2_grpc as rt_grpc
from meshd.core.errors import LoadFailed
from meshd.runtime.client import RuntimeClient
from meshd.runtime.loader import LoadQueue
from meshd.testing.fake_runtime import runtime_info


class Runtime(rt_grpc.ModelRuntimeServicer, disk_pb2_grpc.DiskTierServicer):  # type: ignore[misc]
    """loadModel: pulls for `pull_s` (listed by diskInventory as running), then loads for `load_s`."""

    def __init__(self, pull_s: float, load_s: float, disk_tier: bool = True) -> None:
        self.pull_s, self.load_s, self.disk_tier = pull_s, load_s, disk_tier
        self.pull_started: float | None = None
        self.cancelled = asyncio.Event()

    async def loadModel(self, request: rt.LoadModelRequest, context: Any) -> rt.LoadModelResponse:
        try:
            self.pull_started = time.monotonic()
            await asyncio.sleep(self.pull_s)
            await asyncio.sleep(self.load_s)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return rt.LoadModelResponse(sizeInBytes=1 << 20)

    async def diskInventory(self, request: disk_pb2.DiskInventoryRequest, context: Any) -> Any:
        if not self.disk_tier:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no disk tier")
        pulls, models = [], []
        if self.pull_started is not None:
            ran_ms = int((time.monotonic() - self.pull_started) * 1000)
            if ran_ms < self.pull_s * 1000:
                total = int(self.pull_s * 1000)
                pulls.append(disk_pb2.Pull(model_id="m", bytes_done=ran_ms, bytes_total=total, elapsed_ms=ran_ms))
            else:
                models.append(disk_pb2.DiskModel(model_id="m", size_bytes=1 << 20, pull_ms=int(self.pull_s * 1000)))
        return disk_pb2.DiskInventoryResponse(models=models, pulls=pulls)


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    servers: list[grpc.aio.Server] = []
    clients: list[RuntimeClient] = []

    async def start(runtime: Runtime, timeout_ms: int, pull_deadline_ms: int) -> LoadQueue:
        server = grpc.aio.server()
        rt_grpc.add_ModelRuntimeServicer_to_server(runtime, server)
        disk_pb2_grpc.add_DiskTierServicer_to_server(runtime, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        client = RuntimeClient(f"127.0.0.1:{port}", 4 << 20)
        clients.append(client)
        info = dataclasses.replace(runtime_info(), loading_timeout_ms=timeout_ms)
        return LoadQueue(client, info, lambda model_id: None, pull_deadline_ms=pull_deadline_ms)

    yield start
    for c in clients:
        await c.close()
    for s in servers:
        await s.stop(None)


async def test_a_load_pulling_past_its_timeout_is_not_cut(serve: Any) -> None:
    runtime = Runtime(pull_s=3.0, load_s=0.5)
    queue = await serve(runtime, timeout_ms=1_000, pull_deadline_ms=60_000)
    loaded = await queue.load("m", "demo", "/m", "")
    assert loaded.size_bytes == 1 << 20 and loaded.load_ms > 3_000
    assert not runtime.cancelled.is_set()


async def test_the_runtime_part_still_has_only_the_timeout(serve: Any) -> None:
    runtime = Runtime(pull_s=2.5, load_s=3.0)  # a pull, then a load longer than the timeout
    queue = await serve(runtime, timeout_ms=1_000, pull_deadline_ms=60_000)
    started = time.monotonic()
    with pytest.raises(LoadFailed, match=r"load of m timed out after .* of it pulling"):
        await queue.load("m", "demo", "/m", "")
    # Cut about a timeout after the pull's 2.5 s (it was seen running, then its length read).
    assert 3.3 < time.monotonic() - started < 5.4
    await asyncio.wait_for(runtime.cancelled.wait(), 5)  # the runtime's call was cancelled


async def test_the_longest_bounds_a_pull(serve: Any) -> None:
    runtime = Runtime(pull_s=30.0, load_s=0.0)
    queue = await serve(runtime, timeout_ms=1_000, pull_deadline_ms=2_500)
    started = time.monotonic()
    with pytest.raises(LoadFailed, match="timed out"):
        await queue.load("m", "demo", "/m", "")
    assert 2.4 < time.monotonic() - started < 4.0
    await asyncio.wait_for(runtime.cancelled.wait(), 5)


@pytest.mark.parametrize("disk_tier", [True, False])
async def test_without_a_pull_seen_the_timeout_is_the_timeout(serve: Any, disk_tier: bool) -> None:
    runtime = Runtime(pull_s=0.0, load_s=5.0, disk_tier=disk_tier)
    queue = await serve(runtime, timeout_ms=1_000, pull_deadline_ms=60_000 if disk_tier else 0)
    started = time.monotonic()
    with pytest.raises(LoadFailed, match="timed out after 1"):
        await queue.load("m", "demo", "/m", "")
    assert time.monotonic() - started < 2.5
    await asyncio.wait_for(runtime.cancelled.wait(), 5)


async def test_a_runtime_without_a_disk_tier_is_asked_once(serve: Any) -> None:
    runtime = Runtime(pull_s=0.0, load_s=3.0, disk_tier=False)
    queue = await serve(runtime, timeout_ms=1_000, pull_deadline_ms=60_000)
    with pytest.raises(LoadFailed, match="timed out"):
        await queue.load("m", "demo", "/m", "")
    assert queue.client.disk_tier is False  # the next load takes the flat deadline
