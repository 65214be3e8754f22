"""A language model that cannot be loaded, asked at meshd's OpenAI port: its own status and code
(502 `model_load_failed`, docs/llm.md), the runtime's reason in the message, the record kept.
Real processes: etcd, meshd, `meshd llm-runtime` with an engine of our own (meshd.testing.fake_llm)."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc
from meshd.testing.cluster import LocalMesh, Node
from meshd.testing.llm import LlmRuntimeArgs, add_llm_node

pytestmark = pytest.mark.slow  # real processes

FAKE = f"{sys.executable} -m meshd.testing.fake_llm --port {{port}} --name {{name}}"


@pytest.fixture
def node(tmp_path: Path, etcd_server: Any) -> Iterator[Node]:
    mesh = LocalMesh(tmp_path / "mesh", service=f"llm-load-failures-{tmp_path.name}")
    mesh.etcd_url = etcd_server.url
    try:
        yield add_llm_node(mesh, "m", LlmRuntimeArgs(Path(sys.executable), engine_command=FAKE, engine_args=()))
    finally:
        mesh.stop()


def post(node: Node, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(
        node.http_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_model_whose_file_is_missing_is_a_failed_load_not_a_server_error(node: Node, tmp_path: Path) -> None:
    missing = tmp_path / "gone.gguf"
    with grpc.insecure_channel(node.target) as ch:
        info = mm.ModelInfo(type="llm", path=str(missing))
        mm_grpc.ModelMeshStub(ch).registerModel(mm.RegisterModelRequest(modelId="gone", modelInfo=info), timeout=30)
        for _ in range(2):  # the load, then the recorded failure: the same answer
            status, answer = post(node, {"model": "gone", "prompt": "x"})
            assert (status, answer["error"]["code"]) == (502, "model_load_failed"), answer
            assert str(missing) in answer["error"]["message"] and "does not exist" in answer["error"]["message"]
        got = mm_grpc.ModelMeshStub(ch).getModelStatus(mm.GetStatusRequest(modelId="gone"), timeout=10)
        assert got.status == mm.ModelStatusInfo.LOADING_FAILED  # still registered, its failure recorded
