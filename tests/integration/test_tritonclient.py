"""The real tritonclient (gRPC) against meshd: ModelInfer and ModelStreamInfer with mm-model-id.

tritonclient pins protobuf < 7, so it runs in its own venv (built on first use, cached under
.venvs/) through clients/triton_infer.py, never inside meshd's venv.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.runtimes.models import GeneratedModel
from meshd.testing.venvs import ensure_venv

from .conftest import NodeFactory, close_enough, expected

pytestmark = pytest.mark.slow

TRITONCLIENT = ["tritonclient[grpc]==2.73.0"]
SCRIPT = Path(__file__).resolve().parent / "clients" / "triton_infer.py"
SCRIPT_TIMEOUT_S = 120
# Several batches, of different sizes, so answers cannot be mixed up between requests.
BATCHES = [
    [[0.5, -1.0, 2.0, 0.25]],
    [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]],
    [[-2.0, 3.0, 0.125, 7.0], [0.75, 0.5, -0.25, 1.5], [4.0, -4.0, 2.0, -2.0]],
    [[0.0, 0.0, 0.0, 0.0]],
]
ST = mm.ModelStatusInfo


@pytest.fixture(scope="session")
def triton_python() -> Path:
    """The tritonclient venv's python (built by the first test session that needs it)."""
    return ensure_venv("tritonclient", TRITONCLIENT)


def run_client(python: Path, url: str, model: GeneratedModel, mode: str, *extra: str) -> dict[str, Any]:
    argv = [str(python), str(SCRIPT), "--url", url, "--model-id", model.id, "--mode", mode]
    argv += ["--batches", json.dumps(BATCHES), *extra]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S, check=False)
    assert proc.returncode == 0, f"triton_infer.py exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def assert_answers(results: Sequence[dict[str, Any]], prefix: str, model: GeneratedModel) -> None:
    assert [r["id"] for r in results] == [f"{prefix}-{i}" for i in range(len(BATCHES))]
    for r, rows in zip(results, BATCHES, strict=True):
        assert close_enough(r["outputs"], expected(model, rows)), (r, expected(model, rows))


def test_tritonclient_venv_pins_protobuf_below_7(triton_python: Path) -> None:
    proc = subprocess.run(
        [str(triton_python), "-c", "import google.protobuf; print(google.protobuf.__version__)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    version = proc.stdout.strip()
    assert int(version.split(".")[0]) < 7, version


def test_tritonclient_infer_through_meshd(
    start_node: NodeFactory, models: list[GeneratedModel], triton_python: Path
) -> None:
    c = start_node()
    m = models[3]  # bias[0] = 3: an all-zero row answers which model served it
    assert c.register(m).status == ST.NOT_LOADED
    out = run_client(triton_python, c.node.target, m, "infer")
    assert out["errors"] == []
    assert_answers(out["infer"], "infer", m)
    assert c.status(m.id).status == ST.LOADED
    assert c.runtime_loaded() == [m.id]
    # The -bin header, and a body model_name that says nothing: meshd routes on the header.
    out = run_client(triton_python, c.node.target, m, "infer", "--header-name", "mm-model-id-bin")
    assert_answers(out["infer"], "infer", m)
    out = run_client(triton_python, c.node.target, m, "infer", "--model-name", "not-a-model")
    assert_answers(out["infer"], "infer", m)


def test_tritonclient_stream_through_meshd(
    start_node: NodeFactory, models: list[GeneratedModel], triton_python: Path
) -> None:
    c = start_node()
    m = models[3]
    assert c.register(m).status == ST.NOT_LOADED
    # One stream, the header sent once when it starts, one request per batch on it.
    out = run_client(triton_python, c.node.target, m, "stream")
    assert out["errors"] == []
    assert_answers(out["stream"], "stream", m)
    assert c.runtime_loaded() == [m.id]


def test_tritonclient_health_and_metadata_without_headers(
    start_node: NodeFactory, models: list[GeneratedModel], triton_python: Path
) -> None:
    c = start_node()
    loaded, registered = models[0], models[1]
    c.register(loaded, loadNow=True, sync=True)
    c.register(registered)
    c.mm.setVModel(mm.SetVModelRequest(vModelId="vm", targetModelId=loaded.id), timeout=30)
    script = Path(__file__).parent / "clients" / "triton_health.py"
    argv = [str(triton_python), str(script), "--url", c.node.target]
    argv += ["--loaded", loaded.id, "--registered", registered.id, "--vmodel", "vm"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out == {
        "live": True,
        "ready": True,
        "server": "meshd",
        "loaded_ready": True,  # agrees with getModelStatus: LOADED somewhere in the mesh
        "registered_ready": False,
        "unknown_ready": False,
        "vmodel_ready": True,  # the body names a vmodel: its active model is loaded
        "vmodel_header_ready": True,
        "metadata_name": loaded.id,  # routed to the copy by the body's model name alone
        "metadata_inputs": ["x"],
    }
    assert c.status(loaded.id).status == ST.LOADED and c.status(registered.id).status == ST.NOT_LOADED


def test_tritonclient_repository_api_over_the_mesh(
    start_node: NodeFactory, models: list[GeneratedModel], triton_python: Path
) -> None:
    from meshd._proto.meshd import peer_pb2, peer_pb2_grpc

    b = start_node("inst-b")
    a = start_node("inst-a")
    m1, m2 = models[0], models[1]
    a.register(m1)
    a.register(m2)
    with grpc.insecure_channel(f"127.0.0.1:{b.node.peer_port}") as ch:  # m1's copy on b only
        req = peer_pb2.InternalOpRequest(modelId=m1.id, load=True, sync=True)
        assert (
            peer_pb2_grpc.MeshPeerStub(ch).InternalOperation(req, timeout=30).state
            == peer_pb2.InternalOpResponse.LOADED
        )
    script = Path(__file__).parent / "clients" / "triton_repository.py"
    steps = ["index", f"ready:{m2.id}", f"load:{m2.id}", f"ready:{m2.id}", f"unload:{m1.id}", f"ready:{m1.id}"]
    steps += ["index", "load:no-such-model"]
    proc = subprocess.run(
        [str(triton_python), str(script), "--url", a.node.target, *steps],
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out[0] == {m1.id: ["READY", ""], m2.id: ["UNAVAILABLE", "not loaded"]}
    assert out[1:6] == [False, "loaded", True, "unloaded", False]
    assert out[6] == {m1.id: ["UNAVAILABLE", "not loaded"], m2.id: ["READY", ""]}
    assert out[7]["error"] == "StatusCode.NOT_FOUND"
    # It agrees with getModelStatus, and the unload really reached b's runtime.
    assert a.status(m1.id).status == ST.NOT_LOADED and a.status(m2.id).status == ST.LOADED
    # The load was placed through the cluster (either instance); m1's copy went everywhere.
    assert sorted(a.runtime_loaded() + b.runtime_loaded()) == [m2.id]
