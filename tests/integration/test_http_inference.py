"""KServe V2 inference over HTTP (`POST /v2/models/{name}/infer`) against a real `meshd
serve` and the reference runtime: tritonclient's HTTP client, curl with JSON, and the
binary-data extension by hand."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.runtimes.models import GeneratedModel, write_echo_model
from meshd.testing.venvs import ensure_venv

from .conftest import Client, NodeFactory, close_enough, expected
from .test_http_api import TRITONCLIENT_HTTP

pytestmark = pytest.mark.slow

ROWS = [[0.5, -1.0, 2.0, 0.25], [1.0, 0.0, 0.0, 3.0]]
SCRIPT = Path(__file__).resolve().parent / "clients" / "triton_http_infer.py"


def node_with_models(start_node: NodeFactory, models: list[GeneratedModel], tmp_path: Path) -> Client:
    a = start_node("inst-a")
    a.register(models[0])
    echo = write_echo_model(tmp_path / "echo.json")
    a.mm.registerModel(mm.RegisterModelRequest(modelId="echo", modelInfo=mm.ModelInfo(type="demo", path=str(echo))))
    a.mm.setVModel(mm.SetVModelRequest(vModelId="vm", targetModelId=models[0].id), timeout=30)
    return a


def curl(url: str, *args: str) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one curl call (the body raw)."""
    proc = subprocess.run(["curl", "-sS", "-i", *args, url], capture_output=True, timeout=60, check=True)
    head, _, body = proc.stdout.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def test_tritonclient_http_infers_through_meshd(
    start_node: NodeFactory, models: list[GeneratedModel], tmp_path: Path
) -> None:
    python = ensure_venv("tritonclient-http", TRITONCLIENT_HTTP)
    a = node_with_models(start_node, models, tmp_path)
    m = models[0]
    argv = [str(python), str(SCRIPT), "--url", f"127.0.0.1:{a.node.http_port}", "--linear", m.id]
    argv += ["--echo", "echo", "--vmodel", "vm", "--rows", json.dumps(ROWS)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout)
    want = expected(m, ROWS)
    for how in ("binary", "json", "vmodel"):
        assert close_enough(out[how]["y"], want), (how, out[how], want)
    assert out["binary"]["id"] == "r-True" and out["json"]["id"] == "r-False"
    assert out["echo_binary"] == dict.fromkeys(out["echo_binary"], True) and len(out["echo_binary"]) == 8
    assert out["echo_json"] == dict.fromkeys(out["echo_json"], True) and len(out["echo_json"]) == 8
    assert out["missing"]["status"] == "404" and "no-such-model" in out["missing"]["message"]
    for how in ("metadata", "vmodel_metadata"):
        meta = out[how]
        assert meta["name"] == m.id and meta["versions"] == ["1"], meta  # the runtime's answer
        assert [(t["name"], t["datatype"]) for t in meta["inputs"]] == [("x", "FP32")]
        assert meta["inputs"][0]["shape"][1] == len(ROWS[0])
        assert [(t["name"], t["datatype"]) for t in meta["outputs"]] == [("y", "FP32")]
    assert a.runtime_loaded() == sorted(["echo", m.id])


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_json_and_binary_inference(start_node: NodeFactory, models: list[GeneratedModel], tmp_path: Path) -> None:
    a = node_with_models(start_node, models, tmp_path)
    m = models[0]
    url = f"{a.node.http_url}/v2/models/{m.id}/infer"
    doc = {"id": "c1", "inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": ROWS}]}
    status, headers, body = curl(url, "-H", "Content-Type: application/json", "-d", json.dumps(doc))
    assert status == 200 and headers["content-type"].startswith("application/json"), body
    answer = json.loads(body)
    assert answer["id"] == "c1" and answer["model_name"] == m.id
    (y,) = answer["outputs"]
    assert (y["name"], y["datatype"], y["shape"]) == ("y", "FP32", [2, 2])
    assert close_enough([y["data"][0:2], y["data"][2:4]], expected(m, ROWS))
    # The binary-data extension: FP32 rows after the JSON header, the output asked for as binary.
    header = json.dumps(
        {
            "inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "parameters": {"binary_data_size": 32}}],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    ).encode()
    (tmp_path / "body.bin").write_bytes(header + struct.pack("<8f", *ROWS[0], *ROWS[1]))
    args = ["-H", f"Inference-Header-Content-Length: {len(header)}", "-H", "Content-Type: application/octet-stream"]
    status, headers, body = curl(url, *args, "--data-binary", f"@{tmp_path / 'body.bin'}")
    assert status == 200 and headers["content-type"] == "application/octet-stream", body
    n = int(headers["inference-header-content-length"])
    (y,) = json.loads(body[:n])["outputs"]
    assert y["parameters"] == {"binary_data_size": 16}
    values = struct.unpack("<4f", body[n:])
    assert close_enough([list(values[0:2]), list(values[2:4])], expected(m, ROWS))
    # A vmodel header routes to its active model whatever the path names.
    status, _, body = curl(
        f"{a.node.http_url}/v2/models/anything/infer", "-H", "mm-vmodel-id: vm", "-d", json.dumps(doc)
    )
    assert status == 200 and json.loads(body)["model_name"] == m.id
    # Errors are {"error": ...}: bad tensors 400, an unknown model 404, the runtime's refusal 400.
    bad = {"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": [1.0]}]}
    status, _, body = curl(url, "-d", json.dumps(bad))
    assert status == 400 and "needs 8 elements" in json.loads(body)["error"]
    status, _, body = curl(f"{a.node.http_url}/v2/models/nope/infer", "-d", json.dumps(doc))
    assert status == 404 and "nope" in json.loads(body)["error"]
    wrong = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1.0, 2.0, 3.0]}]}
    status, _, body = curl(url, "-d", json.dumps(wrong))
    assert status == 400 and "shape" in json.loads(body)["error"], body


def test_a_model_that_cannot_load_says_why_once(start_node: NodeFactory, tmp_path: Path) -> None:
    """Every attempt failing alike is one reason, said once, with how many instances tried."""
    a = start_node()
    missing = tmp_path / "no-such-model.json"
    a.mm.registerModel(
        mm.RegisterModelRequest(modelId="ghost", modelInfo=mm.ModelInfo(type="demo", path=str(missing))), timeout=30
    )
    doc = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    url = f"{a.node.http_url}/v2/models/ghost/infer"
    status, _, body = curl(url, "-H", "Content-Type: application/json", "-d", json.dumps(doc))
    assert status == 500, body
    message = json.loads(body)["error"]
    assert message.count(str(missing)) == 1, message
    assert message.endswith("(model 'ghost' failed to load on 1 instance recently: inst-a)"), message
