"""KServe V2 over HTTP against real `meshd serve` processes and reference runtimes, and
models registered on first load from a model repository directory (over gRPC and HTTP)."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshd._proto.inference import grpc_predict_v2_pb2 as v2
from meshd._proto.meshd import peer_pb2, peer_pb2_grpc
from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.runtimes.models import GeneratedModel
from meshd.testing.venvs import ensure_venv

from .conftest import Client, NodeFactory, close_enough, expected

pytestmark = pytest.mark.slow

ST = mm.ModelStatusInfo
ROWS = [[0.5, -1.0, 2.0, 0.25], [0.0, 0.0, 0.0, 0.0]]


def http(
    client: Client, method: str, path: str, body: bytes | str | None = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """Status and decoded JSON body of one request to the node's REST port."""
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(client.node.http_url + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    return status, json.loads(raw)


def index_states(entries: list[dict[str, str]]) -> dict[str, list[str]]:
    return {e["name"]: [e["state"], e["reason"]] for e in entries}


def test_http_endpoints_over_the_mesh(start_node: NodeFactory, models: list[GeneratedModel]) -> None:
    b = start_node("inst-b")
    a = start_node("inst-a")
    m1, m2 = models[0], models[1]
    a.register(m1)
    a.register(m2)
    with grpc.insecure_channel(f"127.0.0.1:{b.node.peer_port}") as ch:  # m1's only copy is on b
        req = peer_pb2.InternalOpRequest(modelId=m1.id, load=True, sync=True)
        state = peer_pb2_grpc.MeshPeerStub(ch).InternalOperation(req, timeout=30).state
        assert state == peer_pb2.InternalOpResponse.LOADED
    a.mm.setVModel(mm.SetVModelRequest(vModelId="vm", targetModelId=m1.id), timeout=30)

    assert http(a, "GET", "/v2/health/live") == (200, {"live": True})
    assert http(a, "GET", "/v2/health/ready") == (200, {"ready": True})
    status, meta = http(a, "GET", "/v2")
    assert status == 200 and meta["name"] == "meshd" and meta["extensions"] == ["model_repository"]

    # Ready is mesh-wide: m1 is loaded on b only; a vmodel name reads its active model.
    assert http(a, "GET", f"/v2/models/{m1.id}/ready") == (200, {"name": m1.id, "ready": True})
    assert http(a, "GET", f"/v2/models/{m1.id}/versions/1/ready")[0] == 200
    assert http(a, "GET", "/v2/models/vm/ready") == (200, {"name": "vm", "ready": True})
    status, body = http(a, "GET", f"/v2/models/{m2.id}/ready")
    assert status == 503 and body["ready"] is False and "NOT_LOADED" in body["error"]
    assert http(a, "GET", "/v2/models/no-such-model/ready") == (404, {"error": "model 'no-such-model' not found"})

    status, index = http(a, "POST", "/v2/repository/index")
    assert status == 200
    assert index_states(index) == {m1.id: ["READY", ""], m2.id: ["UNAVAILABLE", "not loaded"]}
    assert http(a, "POST", "/v2/repository/index", '{"ready": true}')[1] == [
        {"name": m1.id, "version": "", "state": "READY", "reason": ""}
    ]

    assert http(a, "POST", f"/v2/repository/models/{m2.id}/load") == (200, {})
    # Placed through the cluster (either instance), loaded before the answer.
    assert a.status(m2.id).status == ST.LOADED and sorted(a.runtime_loaded() + b.runtime_loaded()) == [m1.id, m2.id]
    assert close_enough(a.infer(m2.id, ROWS), expected(m2, ROWS))
    assert http(a, "POST", f"/v2/repository/models/{m1.id}/unload", "{}") == (200, {})
    assert a.status(m1.id).status == ST.NOT_LOADED and m1.id not in b.runtime_loaded()  # b's copy went
    assert http(a, "GET", f"/v2/models/{m1.id}/ready")[0] == 503
    # The index agrees with getModelStatus after both changes.
    status, index = http(a, "POST", "/v2/repository/index", "")
    assert index_states(index) == {m1.id: ["UNAVAILABLE", "not loaded"], m2.id: ["READY", ""]}
    assert [a.status(m).status for m in (m1.id, m2.id)] == [ST.NOT_LOADED, ST.LOADED]

    # Errors: {"error": ...} with a fitting status, never a traceback.
    status, body = http(a, "POST", "/v2/repository/models/no-such-model/load")
    assert status == 404 and "no-such-model" in body["error"]
    assert http(a, "POST", "/v2/repository/models/no-such-model/unload")[0] == 404
    status, body = http(a, "POST", "/v2/repository/index", "{not json")
    assert status == 400 and "malformed JSON" in body["error"]
    status, body = http(a, "POST", "/v2/repository/index", '{"ready": 1}')
    assert status == 400 and "'ready'" in body["error"]
    status, body = http(a, "POST", f"/v2/models/{m2.id}/infer", "{}")
    assert status == 400 and "'inputs' must be a non-empty list" in body["error"]
    assert http(a, "GET", "/v2/nothing-here")[0] == 404


def test_http_load_failure_is_500_with_the_reason(start_node: NodeFactory, models: list[GeneratedModel]) -> None:
    a = start_node(runtime_args=["--fail-load", "^" + models[0].id + "$"])
    a.register(models[0])
    status, body = http(a, "POST", f"/v2/repository/models/{models[0].id}/load")
    assert status == 500 and "injected load failure" in body["error"], body
    assert http(a, "GET", f"/v2/models/{models[0].id}/ready")[0] == 503


def model_repository(root: Path, models: list[GeneratedModel]) -> Path:
    """alpha: a bare folder (default type); beta: meshd-model.json naming type and file;
    broken: an unusable meshd-model.json; and a loose file that is not a model folder."""
    repo = root / "repo"
    (repo / "alpha").mkdir(parents=True)
    shutil.copy(models[0].path, repo / "alpha" / "model.json")
    (repo / "beta").mkdir()
    shutil.copy(models[1].path, repo / "beta" / "weights.json")
    (repo / "beta" / "meshd-model.json").write_text(json.dumps({"type": "demo", "path": "weights.json"}))
    (repo / "broken").mkdir()
    (repo / "broken" / "meshd-model.json").write_text('{"type": 7}')
    (repo / "loose.json").write_text("{}")
    return repo


def test_load_from_the_model_repository_over_grpc_and_http(
    start_node: NodeFactory, models: list[GeneratedModel], tmp_path: Path
) -> None:
    repo = model_repository(tmp_path, models)
    a = start_node(settings={"model_repository": str(repo), "model_repository_type": "demo"})
    registered = models[2]
    a.register(registered)

    # Not-yet-registered folders are listed with state "" (Triton's never-loaded answer).
    entries = a.v2.RepositoryIndex(v2.RepositoryIndexRequest(), timeout=30).models
    assert {m.name: m.state for m in entries} == {registered.id: "UNAVAILABLE", "alpha": "", "beta": "", "broken": ""}
    assert a.status("alpha").status == ST.NOT_FOUND

    # gRPC: registers alpha from its folder, loads it, then inference answers with its weights.
    a.v2.RepositoryModelLoad(v2.RepositoryModelLoadRequest(model_name="alpha"), timeout=60)
    assert a.status("alpha").status == ST.LOADED
    assert close_enough(a.infer("alpha", ROWS), expected(models[0], ROWS))
    # HTTP: beta's meshd-model.json names the type and the model file.
    assert http(a, "POST", "/v2/repository/models/beta/load") == (200, {})
    assert close_enough(a.infer("beta", ROWS), expected(models[1], ROWS))
    assert a.runtime_loaded() == sorted(["alpha", "beta"])
    info = a.mm.getModelStatus(mm.GetStatusRequest(modelId="beta"), timeout=10)
    assert info.status == ST.LOADED

    # Unload keeps the registration; the index agrees with getModelStatus.
    assert http(a, "POST", "/v2/repository/models/beta/unload") == (200, {})
    a.v2.RepositoryModelUnload(v2.RepositoryModelUnloadRequest(model_name="alpha"), timeout=60)
    status, index = http(a, "POST", "/v2/repository/index")
    assert index_states(index) == {
        "alpha": ["UNAVAILABLE", "not loaded"],
        "beta": ["UNAVAILABLE", "not loaded"],
        registered.id: ["UNAVAILABLE", "not loaded"],
        "broken": ["", "not registered; in the model repository"],
    }
    assert [a.status(m).status for m in ("alpha", "beta")] == [ST.NOT_LOADED, ST.NOT_LOADED]
    assert a.runtime_loaded() == []
    # Loading again uses the registration made the first time.
    assert http(a, "POST", "/v2/repository/models/alpha/load") == (200, {})
    assert close_enough(a.infer("alpha", ROWS), expected(models[0], ROWS))

    # Names that escape the directory, unknown names, unusable folders.
    for name in ("../repo/alpha", "..", "/etc"):
        with pytest.raises(grpc.RpcError) as err:
            a.v2.RepositoryModelLoad(v2.RepositoryModelLoadRequest(model_name=name), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    status, body = http(a, "POST", "/v2/repository/models/..%2Frepo%2Falpha/load")
    assert status == 400 and "single folder name" in body["error"]
    for name in ("nope", "loose.json"):
        with pytest.raises(grpc.RpcError) as err:
            a.v2.RepositoryModelLoad(v2.RepositoryModelLoadRequest(model_name=name), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "neither registered nor in the model repository" in (err.value.details() or "")
    assert http(a, "POST", "/v2/repository/models/nope/load")[0] == 404
    with pytest.raises(grpc.RpcError) as err:
        a.v2.RepositoryModelLoad(v2.RepositoryModelLoadRequest(model_name="broken"), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'type' must be a string" in (err.value.details() or "")
    status, body = http(a, "POST", "/v2/repository/models/broken/load")
    assert status == 400 and "meshd-model.json" in body["error"]
    assert a.status("broken").status == ST.NOT_FOUND  # nothing was registered


TRITONCLIENT_HTTP = ["tritonclient[http]==2.73.0"]
TRITON_HTTP_SCRIPT = Path(__file__).resolve().parent / "clients" / "triton_http.py"


def test_tritonclient_http_against_the_rest_endpoints(
    start_node: NodeFactory, models: list[GeneratedModel], tmp_path: Path
) -> None:
    python = ensure_venv("tritonclient-http", TRITONCLIENT_HTTP)  # its own venv: pins protobuf < 7
    repo = model_repository(tmp_path, models)
    a = start_node(settings={"model_repository": str(repo), "model_repository_type": "demo"})
    m = models[2]
    a.register(m)
    steps = ["live", "ready", "server", "index", f"ready:{m.id}", f"load:{m.id}", f"ready:{m.id}"]
    steps += ["load:alpha", "ready:alpha", "unload:alpha", "ready:alpha", "index", "load:nope", "load:broken"]
    url = f"127.0.0.1:{a.node.http_port}"
    proc = subprocess.run(
        [str(python), str(TRITON_HTTP_SCRIPT), "--url", url, *steps],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out[:3] == [True, True, ["meshd", ["model_repository"]]]
    unregistered = ["", "not registered; in the model repository"]
    assert out[3] == {
        m.id: ["UNAVAILABLE", "not loaded"],
        "alpha": unregistered,
        "beta": unregistered,
        "broken": unregistered,
    }
    assert out[4:11] == [False, "loaded", True, "loaded", True, "unloaded", False]
    assert out[11] == {
        m.id: ["READY", ""],
        "alpha": ["UNAVAILABLE", "not loaded"],
        "beta": unregistered,
        "broken": unregistered,
    }
    assert out[12]["error"] == "404" and "nope" in out[12]["message"]
    assert out[13]["error"] == "400" and "meshd-model.json" in out[13]["message"]
    assert a.status(m.id).status == ST.LOADED and a.status("alpha").status == ST.NOT_LOADED
    assert a.runtime_loaded() == [m.id]
