"""meshd + `meshd adapter` + a real MLServer (its own venv) serving scikit-learn models:
register through meshd, infer each through meshd with evictions, kill MLServer, watch the
supervisor bring it back and meshd serve again without manual steps."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from meshd._proto.inference import grpc_predict_v2_pb2 as v2
from meshd._proto.inference import grpc_predict_v2_pb2_grpc as v2_grpc
from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc
from meshd.testing.cluster import LocalMesh
from meshd.testing.mlserver import (
    TrainedModel,
    kill_mlserver,
    mlserver_python,
    start_mlserver_adapter,
    train_sklearn_models,
)
from meshd.testing.procs import Child, free_ports, port_open, wait_until

pytestmark = pytest.mark.slow

DECLARED_SIZE = 8 << 20  # each model says it takes 8 MiB ...
CAPACITY = 20 << 20  # ... and the server has room for two: four models force evictions
OVERHEAD = 256 << 20


@dataclass
class Stack:
    meshd: Child
    adapter: Child
    grpc_port: int
    mlserver_port: int
    pid_file: Path
    models: list[TrainedModel]

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")

    def mlserver_pid(self) -> int:
        return int(self.pid_file.read_text())


@pytest.fixture(scope="module")
def mlserver_env() -> Path:
    return mlserver_python()


@pytest.fixture
def stack(mlserver_env: Path, tmp_path: Path, etcd_server: object) -> Iterator[Stack]:
    models = train_sklearn_models(mlserver_env, tmp_path / "models", 4)
    # Drawn together: separate free_port() calls may hand out one port twice.
    mlserver_port, http_port, adapter_port, grpc_port = free_ports(4)
    pid_file = tmp_path / "mlserver.pid"
    mesh = LocalMesh(tmp_path / "mesh", service="adapter-mlserver")
    mesh.etcd_url = etcd_server.url  # type: ignore[attr-defined]
    try:
        adapter = start_mlserver_adapter(
            mesh.children,
            mlserver_env,
            tmp_path,
            (adapter_port, mlserver_port, http_port),
            CAPACITY + OVERHEAD,
            pid_file,
            ["--memory-overhead-bytes", str(OVERHEAD), "--reconcile-interval-s", "1"],
        )
        wait_until(lambda: port_open(adapter_port) and port_open(mlserver_port), 120, "adapter and MLServer")
        meshd = mesh.start_meshd(
            "inst-a", adapter_port, {"serving_port": mlserver_port, "rate_check_ms": 600_000}, grpc_port=grpc_port
        )
        yield Stack(meshd, adapter, grpc_port, mlserver_port, pid_file, models)
    finally:
        mesh.stop()  # meshd, then the adapter (which stops MLServer)
        kill_mlserver(pid_file)  # and MLServer itself, had the adapter died first


def register(stack: Stack, channel: grpc.Channel, model: TrainedModel) -> None:
    key = json.dumps({"model_type": {"name": "sklearn"}, "meshd": {"size_bytes": DECLARED_SIZE}})
    info = mm.ModelInfo(type="sklearn", path=str(model.path), key=key)
    mm_grpc.ModelMeshStub(channel).registerModel(
        mm.RegisterModelRequest(modelId=model.name, modelInfo=info), timeout=30
    )


def infer(channel: grpc.Channel, model: TrainedModel, timeout: float = 60) -> list[int]:
    rows = model.inputs
    req = v2.ModelInferRequest(model_name="the-header-decides")  # meshd writes the id here
    tensor = req.inputs.add(name="x", datatype="FP64", shape=[len(rows), 4])
    tensor.contents.fp64_contents.extend(v for row in rows for v in row)
    resp = v2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
        req, metadata=(("mm-model-id", model.name),), timeout=timeout
    )
    return list(resp.outputs[0].contents.int64_contents)


def loaded_in_mlserver(stack: Stack) -> set[str]:
    with grpc.insecure_channel(f"127.0.0.1:{stack.mlserver_port}") as ch:
        resp = v2_grpc.GRPCInferenceServiceStub(ch).RepositoryIndex(v2.RepositoryIndexRequest(ready=True), timeout=10)
    return {m.name for m in resp.models}


def reported_loaded(channel: grpc.Channel, models: list[TrainedModel]) -> set[str]:
    stub = mm_grpc.ModelMeshStub(channel)
    st = mm.ModelStatusInfo
    return {
        m.name
        for m in models
        if stub.getModelStatus(mm.GetStatusRequest(modelId=m.name), timeout=10).status == st.LOADED
    }


def test_mlserver_through_meshd_with_evictions_and_a_crash(stack: Stack) -> None:
    with stack.channel() as ch:
        for m in stack.models:
            register(stack, ch, m)
        # Three rounds over four models with room for two: every request correct, many evictions.
        for _ in range(3):
            for m in stack.models:
                assert infer(ch, m) == m.expected, m.name
        wait_until(lambda: len(loaded_in_mlserver(stack)) <= 2, 10, "evicted models to be unloaded")
        wait_until(lambda: reported_loaded(ch, stack.models) == loaded_in_mlserver(stack), 10, "records to match")

        # Kill MLServer: requests fail fast with UNAVAILABLE (or already succeed again) ...
        first_pid = stack.mlserver_pid()
        os.kill(first_pid, signal.SIGKILL)
        outcomes: set[str] = set()
        deadline = time.monotonic() + 60
        recovered = False
        while time.monotonic() < deadline and not recovered:
            m = stack.models[0]
            started = time.monotonic()
            try:
                recovered = infer(ch, m, timeout=20) == m.expected
                outcomes.add("ok")
            except grpc.RpcError as e:
                outcomes.add(e.code().name)
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
                assert time.monotonic() - started < 15, "a failure while MLServer is down must come fast"
                time.sleep(0.2)
        # ... and the supervisor brings it back: requests succeed again, no manual steps.
        assert recovered, outcomes
        assert stack.mlserver_pid() != first_pid
        for m in stack.models:
            assert infer(ch, m) == m.expected, m.name
        # meshd reports loaded exactly what MLServer really holds.
        wait_until(
            lambda: reported_loaded(ch, stack.models) == loaded_in_mlserver(stack),
            20,
            "meshd's records to match MLServer",
        )
        assert stack.meshd.alive() and stack.adapter.alive()
