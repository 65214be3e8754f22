"""The adapter's SPI servicer against a fake model server that goes down and comes back:
loads ride out an outage, a model that keeps bringing the server down fails as its own fault,
and nothing is left loaded in the server that the adapter (and so meshd) does not count."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshd._proto.mmesh import model_runtime_pb2 as rt
from meshd.adapter.layout import MLServerLayout
from meshd.adapter.server import Adapter, AdapterConfig
from meshd.adapter.supervisor import Supervisor, SupervisorConfig

FAST = SupervisorConfig(check_interval_s=0.05, failures_before_restart=3)


def unavailable() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "failed to connect"
    )


class FakeServer:
    """Up unless inside an outage; an outage that ends is a restart (it holds nothing)."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.down_until = 0.0
        self.crash_on_load: set[str] = set()
        self.loads = 0

    def down(self) -> bool:
        return time.monotonic() < self.down_until

    def outage(self, seconds: float) -> None:
        self.down_until = time.monotonic() + seconds
        self.held.clear()  # what it held is gone when it comes back

    async def live(self) -> bool:
        if self.down():
            raise unavailable()
        return True

    ready = live

    async def load(self, name: str, timeout_s: float) -> None:
        self.loads += 1
        if self.down():
            raise unavailable()
        if name in self.crash_on_load:
            self.outage(0.3)
            raise unavailable()
        self.held.add(name)

    async def unload(self, name: str) -> None:
        if self.down():
            raise unavailable()
        if name not in self.held:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(), f"Model {name} not found"
            )
        self.held.discard(name)

    async def loaded_names(self) -> set[str]:
        if self.down():
            raise unavailable()
        return set(self.held)

    async def known_names(self) -> set[str]:
        return await self.loaded_names()


class Context:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def time_remaining(self) -> float:
        return self.deadline - time.monotonic()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


@pytest.fixture
async def adapter(tmp_path: Path) -> AsyncIterator[tuple[Adapter, FakeServer, Path]]:
    for name in ("m", "poison"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.joblib").write_bytes(b"x")
    server = FakeServer()
    ad = Adapter(AdapterConfig(repository=tmp_path / "repo"), MLServerLayout(), server)  # type: ignore[arg-type]
    sup = Supervisor(server.live, ad.restore, None, None, FAST, None, ready=server.ready)
    ad.supervisor = sup
    task = asyncio.create_task(sup.run())
    assert await sup.wait_up(5)
    try:
        yield ad, server, tmp_path
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def load_request(path: Path, model_id: str) -> Any:
    return rt.LoadModelRequest(modelId=model_id, modelPath=str(path / model_id), modelType="sklearn")


async def test_a_load_rides_out_an_outage(adapter: tuple[Adapter, FakeServer, Path]) -> None:
    ad, server, path = adapter
    server.outage(0.5)
    resp = await ad.loadModel(load_request(path, "m"), Context(10))
    assert resp.sizeInBytes > 0 and server.held == {"m"}
    assert (await ad.modelSize(rt.ModelSizeRequest(modelId="m"), Context(5))).sizeInBytes == resp.sizeInBytes


async def test_a_model_that_brings_the_server_down_twice_fails_as_its_own_fault(
    adapter: tuple[Adapter, FakeServer, Path],
) -> None:
    ad, server, path = adapter
    server.crash_on_load.add("poison")
    with pytest.raises(Aborted) as e:
        await ad.loadModel(load_request(path, "poison"), Context(20))
    assert e.value.code == grpc.StatusCode.INTERNAL and "went down twice" in str(e.value)
    assert server.loads == 2  # not a third crash


async def test_an_unload_during_an_outage_leaves_nothing_uncounted(
    adapter: tuple[Adapter, FakeServer, Path],
) -> None:
    ad, server, path = adapter
    await ad.loadModel(load_request(path, "m"), Context(10))
    # Unreachable, but it keeps its models (no restart); it answers again only once the unload
    # has failed, however long that takes on a loaded machine.
    server.down_until = float("inf")
    await ad.unloadModel(rt.UnloadModelRequest(modelId="m"), Context(10))  # meshd does not retry
    assert "m" not in ad.state.loaded
    server.down_until = 0.0
    assert server.held == {"m"}  # still there once it answers again ...
    await ad.reconcile()
    assert server.held == set()  # ... until reconcile unloads what nothing counts


async def test_models_come_back_after_a_restart(adapter: tuple[Adapter, FakeServer, Path]) -> None:
    ad, server, path = adapter
    await ad.loadModel(load_request(path, "m"), Context(10))
    sup = ad.supervisor
    assert sup is not None
    server.outage(0.4)
    assert await sup.wait_recovered(0, 10)
    for _ in range(100):
        if server.held == {"m"} and not ad.state.restoring:
            break
        await asyncio.sleep(0.05)
    assert server.held == {"m"} and set(ad.state.loaded) == {"m"}


async def test_odd_model_keys_are_sized_not_crashed_on(adapter: tuple[Adapter, FakeServer, Path]) -> None:
    ad, _, path = adapter
    for key in ("not json", "[1, 2]", '{"a": ' * 100_000, '{"meshd": {"size_bytes": "x"}}'):
        req = rt.PredictModelSizeRequest(modelId="m", modelPath=str(path / "m"), modelType="sklearn", modelKey=key)
        assert (await ad.predictModelSize(req, Context(5))).sizeInBytes > 0
    bad_path = rt.LoadModelRequest(modelId="m", modelPath="", modelType="sklearn")
    with pytest.raises(Aborted) as e:
        await ad.loadModel(bad_path, Context(5))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


async def test_layout_failures_name_the_model_and_the_file(adapter: tuple[Adapter, FakeServer, Path]) -> None:
    ad, _, path = adapter
    loop = path / "loop"
    loop.mkdir()
    (loop / "model.joblib").write_bytes(b"x")
    (loop / "l1").symlink_to("l2")
    (loop / "l2").symlink_to("l1")
    with pytest.raises(Aborted) as e:
        await ad.loadModel(load_request(path, "loop"), Context(5))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'loop'" in str(e.value) and str(loop / "l1") in str(e.value)
    assert sorted(p.name for p in loop.iterdir()) == ["l1", "l2", "model.joblib"]


async def test_a_schema_path_is_applied_and_must_be_a_string(adapter: tuple[Adapter, FakeServer, Path]) -> None:
    ad, _, path = adapter
    schema = path / "schema.json"
    schema.write_text('{"inputs": [{"name": "x", "datatype": "FP64", "shape": [-1, 4]}]}')
    req = load_request(path, "m")
    req.modelKey = json.dumps({"schema_path": str(schema)})
    await ad.loadModel(req, Context(5))
    settings = json.loads((path / "repo" / "m" / "model-settings.json").read_text())
    assert settings["inputs"] == [{"name": "x", "datatype": "FP64", "shape": [-1, 4]}]
    req = load_request(path, "poison")
    req.modelKey = json.dumps({"schema_path": 3})
    with pytest.raises(Aborted) as e:
        await ad.loadModel(req, Context(5))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "schema_path" in str(e.value)
