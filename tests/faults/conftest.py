"""Fault tests: a mesh of real processes on a private etcd the test may stop, restart or
starve, and paced client traffic that keeps every failure. Every process (etcd, meshd,
runtimes) is stopped by PID when the fixture ends, whatever the test did to it."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshd._proto.meshd import admin_pb2, admin_pb2_grpc, peer_pb2, peer_pb2_grpc
from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.kv.etcd import EtcdStore
from meshd.kv.store import delete_if
from meshd.runtimes.models import GeneratedModel, generate_models
from meshd.testing.cluster import LocalMesh
from meshd.testing.etcd import start_test_etcd
from meshd.testing.observers import ClientThreads, EtcdView
from meshd.testing.observers import answers as answers  # re-exported for the fault tests

from ..conftest import data_plane_settings
from ..integration.conftest import MODEL_SIZE, Client, close_enough, expected
from ..integration.conftest import listed_instances as listed_instances  # re-exported for the fault tests

ROWS = [[1.0, 2.0, 3.0, 4.0]]
WAIT_S = 60.0  # generous: the machine is small and shared; a condition that holds comes much sooner


@dataclass
class FaultMesh:
    """A LocalMesh on its own etcd, with synchronous clients per node."""

    mesh: LocalMesh
    clients: list[Client]

    @property
    def prefix(self) -> str:
        return f"/tas-runtime/{self.mesh.service}"

    def add(
        self,
        instance_id: str,
        settings: dict[str, str | int] | None = None,
        capacity_models: int = 8,
        runtime_args: list[str] | None = None,
    ) -> Client:
        args = ["--capacity-bytes", str(capacity_models * MODEL_SIZE), *(runtime_args or [])]
        node = self.mesh.add_node(instance_id, runtime_args=args, settings=settings)
        client = Client(
            node, grpc.insecure_channel(node.target), grpc.insecure_channel(f"127.0.0.1:{node.runtime_port}")
        )
        self.clients.append(client)
        return client

    def etcd_stop(self) -> None:
        assert self.mesh.etcd is not None
        self.mesh.etcd.stop()

    def etcd_start(self) -> None:
        """Same data directory, same ports."""
        assert self.mesh.etcd is not None
        self.mesh.etcd.start()

    # ---- direct etcd access (what outside tools see) ----------------------------------
    @property
    def etcd_view(self) -> EtcdView:
        return EtcdView(self.mesh.etcd_url, self.prefix)

    def records(self, kind: str = "registry") -> dict[str, dict[str, Any]]:
        """Every record under `<prefix>/<kind>/`, decoded."""
        return self.etcd_view.records(kind)

    def put(self, kind: str, item_id: str, record: dict[str, Any]) -> None:
        key = f"{self.prefix}/{kind}/{item_id}"

        async def write(store: EtcdStore) -> None:
            await store.put(key, json.dumps(record).encode())

        self.etcd_view.call(write)

    def delete(self, kind: str, item_id: str) -> None:
        key = f"{self.prefix}/{kind}/{item_id}"

        async def remove(store: EtcdStore) -> None:
            kv = await store.get(key)
            if kv is not None:
                await delete_if(store, key, kv.mod_revision)

        self.etcd_view.call(remove)

    def leader_in_etcd(self) -> str | None:
        return self.etcd_view.leader()


@pytest.fixture
def fault_mesh(tmp_path: Path, data_plane: str, request: pytest.FixtureRequest) -> Iterator[FaultMesh]:
    """A mesh whose etcd belongs to this test alone (so stopping it harms no other test)."""
    settings = data_plane_settings(data_plane, request)
    mesh = LocalMesh(tmp_path, service=f"svc-{uuid.uuid4().hex[:8]}", settings=settings)
    fm = FaultMesh(mesh, [])
    try:
        mesh.etcd = start_test_etcd(tmp_path)
        mesh.etcd_url = mesh.etcd.url
        yield fm
    finally:
        for c in fm.clients:
            c.close()
        mesh.stop()  # every child by PID, then etcd (whether running or stopped by the test)


@pytest.fixture
def models(tmp_path: Path) -> list[GeneratedModel]:
    return generate_models(tmp_path / "models", 6, size_bytes=MODEL_SIZE)


# ---- operations on one instance ------------------------------------------------------------
def load_on(c: Client, model_id: str) -> None:
    """Place a copy on this instance explicitly (the internal load-here operation)."""
    with grpc.insecure_channel(f"127.0.0.1:{c.node.peer_port}") as ch:
        req = peer_pb2.InternalOpRequest(modelId=model_id, load=True, sync=True)
        state = peer_pb2_grpc.MeshPeerStub(ch).InternalOperation(req, timeout=30).state
    assert state == peer_pb2.InternalOpResponse.LOADED


def listed_models(c: Client) -> set[str]:
    """Registered models as this instance's mirror has them (admin listModels)."""
    resp = admin_pb2_grpc.MeshAdminStub(c.channel).listModels(admin_pb2.ListModelsRequest(), timeout=30)
    return {m.modelId for m in resp.models}


def active_of(c: Client, vmodel_id: str) -> str:
    req = mm.GetVModelStatusRequest(vModelId=vmodel_id)
    return str(c.mm.getVModelStatus(req, timeout=10).activeModelId)


class Traffic(ClientThreads[Client]):
    """Client threads sending paced requests for `models` until stopped; every failure and
    wrong answer is kept (a failure is a finding), successes counted per ingress instance
    and in order, so a test can count what succeeded between two of its own marks."""

    def __init__(self, clients: list[Client], models: list[GeneratedModel], pace_s: float = 0.02) -> None:
        super().__init__(clients, pace_s=pace_s, join_s=60, daemon=True)
        self.failures: list[str] = []
        self.failed_at: list[float] = []  # time.monotonic() of each failure, in order
        self.served: Counter[str] = Counter()
        self.successes = 0
        self._lock = threading.Lock()
        self._models = models

    def _run(self, client: Client) -> None:
        i = 0
        while self._going():
            m = self._models[i % len(self._models)]
            i += 1
            try:
                ok = close_enough(client.infer(m.id, ROWS), expected(m, ROWS))
                error = "" if ok else "wrong answer"
            except grpc.RpcError as e:
                ok, error = False, f"{e.code().name}: {e.details()}"
            with self._lock:
                if ok:
                    self.served[client.node.instance_id] += 1
                    self.successes += 1
                else:
                    self.failures.append(f"{client.node.instance_id} {m.id}: {error}")
                    self.failed_at.append(time.monotonic())
