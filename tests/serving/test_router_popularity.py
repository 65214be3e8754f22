"""The load queue's popularity (`LocalModels.popularity`) counts every request arriving at an
instance once: a local hit too, a hit whose copy refused and was rerouted once, never a retry.
The simulator counts the same way (sim.engine `_request`): the same requests played on one
instance of each give the same counts.

One meshd router, alone in its cluster, on in-memory records, a fake runtime for loads and an
in-process gRPC server as the runtime's serving port."""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from meshd.core.records import InstanceRecord, ModelRecord, VModelRecord
from meshd.decisions.ids import ModelInfo
from meshd.kv.memory import MemoryStore
from meshd.kv.table import Table
from meshd.registry.models import Registry
from meshd.serving.cluster import Cluster
from meshd.serving.local import LocalModels
from meshd.serving.peers import Peers
from meshd.serving.proxy.headers import RequestIds
from meshd.serving.proxy.methods import MethodSpec
from meshd.serving.router import Router
from meshd.testing.fake_runtime import FakeRuntime, runtime_info
from sim.engine import Fleet, Simulation
from sim.policies import MESHD
from sim.workloads import Catalogue, Workload

PREDICT = MethodSpec("/t.Runtime/Predict")
MODELS = ("a", "b", "c")  # all fit in the runtime (room for 4): after its first request, each hits
TRACE = ("a", "a", "b", "a", "c", "b", "a", "a")


class Serving(grpc.GenericRpcHandler):  # type: ignore[misc]
    """The runtime's serving port: answers every call, or NOT_FOUND once for a model in `lose`
    (a runtime that lost the copy, which the router confirms and reloads)."""

    def __init__(self, runtime: FakeRuntime) -> None:
        self.runtime = runtime
        self.lose: set[str] = set()
        self.served: list[str] = []

    def service(self, details: Any) -> Any:
        async def predict(request: bytes, context: Any) -> bytes:
            model_id = dict(context.invocation_metadata())["mm-model-id"]
            if model_id in self.lose:
                self.lose.discard(model_id)
                self.runtime.loaded.discard(model_id)
                await context.abort(grpc.StatusCode.NOT_FOUND, f"model {model_id} not found")
            self.served.append(model_id)
            return request

        return grpc.unary_unary_rpc_method_handler(predict) if details.method == PREDICT.path else None


@dataclasses.dataclass
class Mesh:
    router: Router
    local: LocalModels
    serving: Serving

    async def call(self, model_id: str) -> bytes:
        return await self.router.unary(PREDICT, model_id.encode(), RequestIds(model_id, None), (), 10.0)


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    store = MemoryStore()
    models = Table(store, "/t/registry/", ModelRecord.decode, ModelRecord.encode)
    vmodels = Table(store, "/t/vmodels/", VModelRecord.decode, VModelRecord.encode)
    instances = Table(store, "/t/instances/", InstanceRecord.decode, InstanceRecord.encode)
    for table in (models, vmodels, instances):
        await table.start()
    registry = Registry(models, vmodels)
    runtime = FakeRuntime()
    serving = Serving(runtime)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([serving])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    local = LocalModels("me", registry, runtime, runtime_info(4), failure_expiry_ms=900_000)  # type: ignore[arg-type]
    peers = Peers(1 << 22)
    cluster = Cluster("me", instances, peers, lambda _type: 10_000, 1)
    router = Router(local, registry, channel, cluster, peers, 900_000)
    try:
        for m in MODELS:
            await registry.register(m, ModelInfo("demo", f"/{m}"), 1)
        yield Mesh(router, local, serving)
    finally:
        await local.close(deregister=False)
        await cluster.close()
        await peers.close()
        await channel.close()
        await server.stop(None)
        for table in (models, vmodels, instances):
            await table.stop()
        await store.close()


async def test_every_arriving_request_counts_once_local_hits_included(mesh: Mesh) -> None:
    await mesh.call("a")  # a miss: loaded here
    assert mesh.local.popularity.of("a") == 1
    for n in (2, 3):
        assert await mesh.call("a") == b"a"  # served by the local copy (Router._serve's fast path)
        assert mesh.local.popularity.of("a") == n
    assert mesh.local.counters.hits == 2
    # A hit whose copy refuses (the runtime lost it): rerouted and loaded again, one arrival.
    mesh.serving.lose.add("a")
    assert await mesh.call("a") == b"a"
    assert mesh.local.popularity.of("a") == 4
    assert mesh.serving.served == ["a"] * 4 and mesh.local.counters.hits == 3
    assert mesh.local.popularity.of("b") == 0


async def test_the_daemon_and_the_simulator_count_the_same_popularity(mesh: Mesh) -> None:
    for m in TRACE:
        await mesh.call(m)
    cat = Catalogue(ids=MODELS, units=(1,) * len(MODELS), load_ms=(1.0,) * len(MODELS), service_ms=(0.0,) * 3)
    times = array("q", range(0, 1000 * len(TRACE), 1000))  # a second apart: each load is done by the next
    workload = Workload("t", cat, times, array("q", [MODELS.index(m) for m in TRACE]))
    sim = Simulation(workload, Fleet(1, 4, load_jitter=0.0, service_time=False), MESHD)
    result = sim.run()
    assert result.requests == len(TRACE) and result.local_hits == len(TRACE) - len(MODELS)
    daemon = {m: mesh.local.popularity.of(m) for m in MODELS}
    simulated = {m: sim.insts[0].popularity.of(m) for m in MODELS}
    assert daemon == simulated == {m: float(TRACE.count(m)) for m in MODELS}
