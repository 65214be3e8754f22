"""Upstream variables on real `meshd serve` processes: MM_PAYLOAD_PROCESSORS to a real HTTP
receiver on loopback, MM_LOG_REQUEST_HEADERS on the invoke log, MM_INFO_METRICS on /metrics,
MM_AUTO_REGISTER_MODELS at start-up, and KV_READ_ONLY."""

from __future__ import annotations

import base64
import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import pytest

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.runtimes.models import GeneratedModel, make_infer_request
from meshd.testing.procs import free_port, wait_until

from .conftest import NodeFactory

pytestmark = pytest.mark.slow

ROWS = [[0.5, -1.0, 2.0, 0.25]]


class Receiver:
    """A real HTTP endpoint on loopback keeping each POSTed JSON body."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        lock = threading.Lock()
        bodies = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with lock:
                    bodies.append(json.loads(raw))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/payloads"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_payloads_header_fields_info_metric_and_auto_registration(
    start_node: NodeFactory, models: list[GeneratedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    m = models[0]
    receiver = Receiver()
    metrics_port = free_port()
    monkeypatch.setenv("MESHD_TEST_DEPLOYMENT", "blue")  # the child inherits it
    auto = [{"modelId": m.id, "modelInfo": {"type": "demo", "path": str(m.path)}, "vModelId": "auto-vm"}]
    try:
        a = start_node(
            settings={
                "payload_processors": receiver.url,
                "log_each_invoke": "true",
                "log_request_headers": json.dumps({"X-Request-Id": "requestId"}),
                "metrics": f"prometheus:port={metrics_port};scheme=http",
                "info_metrics": "meshd_test_info;deployment=MESHD_TEST_DEPLOYMENT",
                "auto_register": json.dumps(auto),
            }
        )
        # Registered at start-up, with its vmodel.
        assert a.status(m.id).status != mm.ModelStatusInfo.NOT_FOUND
        vm = a.mm.getVModelStatus(mm.GetVModelStatusRequest(vModelId="auto-vm"), timeout=10)
        assert vm.activeModelId == m.id

        request = make_infer_request(m.id, ROWS)
        a.v2.ModelInfer(request, metadata=(("mm-model-id", m.id), ("x-request-id", "req-42")), timeout=30)
        wait_until(lambda: len(receiver.bodies) == 2, 30, "the request and response payloads")
        by_kind = {b["kind"]: b for b in receiver.bodies}
        assert set(by_kind) == {"request", "response"}
        req, resp = by_kind["request"], by_kind["response"]
        assert req["id"] == resp["id"] and req["modelid"] == m.id and resp["status"] == "OK"
        assert base64.b64decode(req["data"]) == request.SerializeToString()
        assert base64.b64decode(resp["data"])  # the runtime's answer, as sent
        assert req["metadata"]["x-request-id"] == "req-42" and req["metadata"]["mm-model-id"] == m.id

        wait_until(lambda: "requestId=req-42" in a.node.meshd.log_path.read_text(), 10, "the invoke log line")
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'meshd_test_info{deployment="blue"} 1.0' in text
        assert "meshd_payloads_dropped 0.0" in text
    finally:
        receiver.stop()


def test_kv_read_only_refuses_changes_and_still_answers(start_node: NodeFactory, models: list[GeneratedModel]) -> None:
    a = start_node(settings={"kv_read_only": "true"})
    with pytest.raises(grpc.RpcError) as e:
        a.register(models[0])
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "KV_READ_ONLY" in (e.value.details() or "")
    with pytest.raises(grpc.RpcError) as e:
        a.mm.setVModel(mm.SetVModelRequest(vModelId="v", targetModelId="x"), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert a.status(models[0].id).status == mm.ModelStatusInfo.NOT_FOUND  # reads still work


def test_register_load_now_places_by_labels_and_reports_the_peers_copy_loading(
    start_node: NodeFactory, models: list[GeneratedModel]
) -> None:
    constraints = json.dumps({"needs-gpu": {"required": ["gpu"]}})
    # b's runtime takes a while to load: its copy is mid-load when a answers.
    b = start_node(
        "inst-b", runtime_args=["--load-delay-ms", "8000"], settings={"labels": "gpu", "type_constraints": constraints}
    )
    a = start_node("inst-a", settings={"labels": "cpu", "type_constraints": constraints})
    m = models[0]
    info = mm.ModelInfo(type="needs-gpu", path=str(m.path))
    st = a.mm.registerModel(mm.RegisterModelRequest(modelId=m.id, modelInfo=info, loadNow=True), timeout=30)
    # Placed through the cluster, on the instance with the required label, not the receiver.
    assert [(c.location, c.copyStatus) for c in st.modelCopyInfos] == [("inst-b", mm.ModelStatusInfo.LOADING)]
    assert st.status == mm.ModelStatusInfo.LOADING  # asked of b: its copy is still loading
    wait_until(lambda: a.status(m.id).status == mm.ModelStatusInfo.LOADED, 60, "b's copy to load")
    assert a.runtime_loaded() == [] and b.runtime_loaded() == [m.id]
    # ensureLoaded of a loaded model places nothing more.
    a.mm.ensureLoaded(mm.EnsureLoadedRequest(modelId=m.id, sync=True), timeout=30)
    assert a.runtime_loaded() == []


def test_max_connection_age_ends_long_calls_after_the_grace(
    start_node: NodeFactory, models: list[GeneratedModel]
) -> None:
    a = start_node(settings={"max_connection_age_s": 1, "max_connection_age_grace_s": 1})
    m = models[0]
    a.register(m)
    assert a.infer(m.id, ROWS)  # loaded
    release = threading.Event()

    def requests() -> Any:
        yield make_infer_request(m.id, ROWS).SerializeToString()
        release.wait(60)  # then hold the stream open, sending nothing

    call = a.channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")(
        requests(), metadata=(("mm-model-id", m.id),), timeout=60
    )
    try:
        answers = []
        with pytest.raises(grpc.RpcError) as e:
            for answer in call:
                answers.append(answer)
        # The connection's age and its grace passed: the server ended the call (without the
        # setting it would run into its own 60 s deadline).
        assert len(answers) == 1 and e.value.code() != grpc.StatusCode.DEADLINE_EXCEEDED, e.value
    finally:
        release.set()
    assert a.infer(m.id, ROWS)  # the channel reconnects for the next call


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"MM_INFO_METRICS": "meshd_test_info;slot=MESHD_TEST_UNSET"}, "MESHD_TEST_UNSET (label slot) is not set"),
        ({"INTERNAL_GRPC_PORT": "8085", "INTERNAL_GRPC_SOCKET_PATH": "/tmp/mmesh/grpc.sock"}, "not both"),
        ({"INTERNAL_SERVING_GRPC_PORT": "8001", "INTERNAL_SERVING_GRPC_SOCKET_PATH": "/tmp/s.sock"}, "not both"),
    ],
)
def test_upstreams_start_up_refusals_are_one_line_errors(env: dict[str, str], expected: str, tmp_path: Any) -> None:
    """What upstream refuses at start-up, `meshd serve` refuses too: exit 2, one line."""
    import os
    import subprocess
    import sys

    args = [sys.executable, "-m", "meshd", "serve", "--kv-store", "etcd:127.0.0.1:1", "--data-dir", str(tmp_path)]
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=60, env={"PATH": os.environ.get("PATH", ""), **env}
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("meshd serve: ") and expected in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1
