"""Real processes for integration tests: meshd instances and reference runtimes on loopback,
sharing the session's etcd. Every process is stopped by PID when its fixture ends."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshd._proto.inference import grpc_predict_v2_pb2 as v2
from meshd._proto.inference import grpc_predict_v2_pb2_grpc as v2_grpc
from meshd._proto.meshd import admin_pb2, admin_pb2_grpc, peer_pb2, peer_pb2_grpc
from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc
from meshd.kv.embedded import EmbeddedEtcd
from meshd.runtimes.models import DemoModel, GeneratedModel, decode_infer_response, generate_models, make_infer_request
from meshd.testing.cluster import LocalMesh, Node
from meshd.testing.observers import ClientThreads

from ..conftest import data_plane_settings

MODEL_SIZE = 1 << 20


# A test that restarts what listens on a port (HAProxy, a runtime) waits for the client's next
# connection attempt; gRPC's default backoff (1 s, x1.6 per failure) puts it seconds apart.
PROMPT_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]


@dataclass
class Client:
    """Synchronous stubs for one node (tests read better without awaits)."""

    node: Node
    channel: grpc.Channel
    runtime_channel: grpc.Channel

    @property
    def mm(self) -> Any:
        return mm_grpc.ModelMeshStub(self.channel)

    @property
    def v2(self) -> Any:
        return v2_grpc.GRPCInferenceServiceStub(self.channel)

    def register(self, model: GeneratedModel, **kw: Any) -> Any:
        info = mm.ModelInfo(type="demo", path=str(model.path))
        return self.mm.registerModel(mm.RegisterModelRequest(modelId=model.id, modelInfo=info, **kw), timeout=30)

    def status(self, model_id: str) -> Any:
        return self.mm.getModelStatus(mm.GetStatusRequest(modelId=model_id), timeout=10)

    def infer(self, model_id: str, rows: list[list[float]], header: str = "mm-model-id") -> list[list[float]]:
        value: str | bytes = model_id.encode() if header.endswith("-bin") else model_id
        resp = self.v2.ModelInfer(make_infer_request(model_id, rows), metadata=((header, value),), timeout=30)
        return decode_infer_response(resp)

    def raw(self, method: str) -> Any:
        return self.channel.unary_unary(method)

    def stats(self) -> Any:
        with grpc.insecure_channel(f"127.0.0.1:{self.node.peer_port}") as ch:
            return peer_pb2_grpc.MeshPeerStub(ch).InstanceStats(peer_pb2.InstanceStatsRequest(), timeout=10)

    def runtime_loaded(self) -> list[str]:
        """What the runtime really holds (its RepositoryIndex), not what meshd believes."""
        stub = v2_grpc.GRPCInferenceServiceStub(self.runtime_channel)
        return sorted(m.name for m in stub.RepositoryIndex(v2.RepositoryIndexRequest(), timeout=10).models)

    def close(self) -> None:
        self.channel.close()
        self.runtime_channel.close()


@pytest.fixture
def mesh(
    etcd_server: EmbeddedEtcd, tmp_path: Path, data_plane: str, request: pytest.FixtureRequest
) -> Iterator[LocalMesh]:
    """A LocalMesh on the session etcd, with its own service name so tests never share records."""
    settings = data_plane_settings(data_plane, request)
    m = LocalMesh(tmp_path, service=f"svc-{uuid.uuid4().hex[:8]}", settings=settings)
    m.etcd_url = etcd_server.url
    try:
        yield m
    finally:
        m.stop()


NodeFactory = Callable[..., Client]


@pytest.fixture
def start_node(mesh: LocalMesh) -> Iterator[NodeFactory]:
    clients: list[Client] = []

    def start(
        instance_id: str = "inst-a",
        capacity_models: int = 8,
        runtime_args: list[str] | None = None,
        settings: dict[str, str | int] | None = None,
    ) -> Client:
        args = ["--capacity-bytes", str(capacity_models * MODEL_SIZE), *(runtime_args or [])]
        node = mesh.add_node(instance_id, runtime_args=args, settings=settings)
        client = Client(
            node,
            grpc.insecure_channel(node.target, options=PROMPT_RECONNECT),
            grpc.insecure_channel(f"127.0.0.1:{node.runtime_port}", options=PROMPT_RECONNECT),
        )
        clients.append(client)
        return client

    try:
        yield start
    finally:
        for c in clients:
            c.close()


@pytest.fixture
def models(tmp_path: Path) -> list[GeneratedModel]:
    return generate_models(tmp_path / "models", 6, size_bytes=MODEL_SIZE)


def expected(model: GeneratedModel, rows: list[list[float]]) -> list[list[float]]:
    return DemoModel.load(model.path).predict(rows)


def close_enough(a: list[list[float]], b: list[list[float]]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(abs(p - q) < 1e-4 for p, q in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


class Traffic(ClientThreads[Client]):
    """Client threads sending requests for `models` in turn until stopped; every failure
    and wrong answer is kept (a failure is a finding), successes counted per instance."""

    def __init__(self, clients: list[Client], models: list[GeneratedModel], rows: list[list[float]]) -> None:
        super().__init__(clients, join_s=30)
        self.failures: list[str] = []
        self.served: Counter[str] = Counter()
        self._rows = rows
        self._models = models

    def _run(self, client: Client) -> None:
        i = 0
        while self._going():
            m = self._models[i % len(self._models)]
            i += 1
            try:
                if close_enough(client.infer(m.id, self._rows), expected(m, self._rows)):
                    self.served[client.node.instance_id] += 1
                else:
                    self.failures.append(f"{client.node.instance_id} {m.id}: wrong answer")
            except Exception as e:
                self.failures.append(f"{client.node.instance_id} {m.id}: {e}")


def listed_instances(c: Client) -> set[str]:
    """Instances this one sees live (admin listInstances, from its mirror)."""
    resp = admin_pb2_grpc.MeshAdminStub(c.channel).listInstances(admin_pb2.ListInstancesRequest(), timeout=10)
    return {i.instanceId for i in resp.instances}
