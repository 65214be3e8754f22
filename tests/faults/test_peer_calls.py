"""Calls forwarded to a peer that stops answering or leaves the mesh: a frozen peer's calls
fail with UNAVAILABLE by keepalive (a stream's reaches the client, no hang to its deadline);
a peer whose record goes while it still runs keeps its calls (no request run twice)."""

from __future__ import annotations

import json
import queue
import signal
import threading
from typing import Any

import grpc
import pytest

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.runtimes.echo import SERVICE, dataplane_streaming
from meshd.runtimes.models import GeneratedModel
from meshd.testing.procs import wait_until

from ..conftest import stream_error_codes
from ..integration.conftest import Client, close_enough, expected
from .conftest import ROWS, WAIT_S, FaultMesh, answers, listed_instances

pytestmark = [pytest.mark.slow, pytest.mark.both_data_planes]

ECHO = f"/{SERVICE}"
# Only inst-b may load "demo-gpu" models: what is asked at inst-a is forwarded to inst-b.
GPU_ONLY: dict[str, str | int] = {
    "dataplane_config": json.dumps({"rpcConfigs": dataplane_streaming()}),
    "type_constraints": json.dumps({"demo-gpu": {"required": ["gpu"]}}),
}
STREAM_DEADLINE_S = 120  # far longer than keepalive takes to see a frozen peer


def load_gpu(c: Client, model: GeneratedModel) -> None:
    info = mm.ModelInfo(type="demo-gpu", path=str(model.path))
    req = mm.RegisterModelRequest(modelId=model.id, modelInfo=info, loadNow=True, sync=True)
    assert c.mm.registerModel(req, timeout=30).status == mm.ModelStatusInfo.LOADED


def runtime_counters(c: Client) -> dict[str, int]:
    counters: dict[str, int] = json.loads(c.runtime_channel.unary_unary(f"{ECHO}/Stats")(b"", timeout=10))
    return counters


class Conversation:
    """A bidirectional Echo stream driven one message at a time."""

    def __init__(self, c: Client, model_id: str) -> None:
        self._outbox: queue.Queue[bytes | None] = queue.Queue()
        bidi = c.channel.stream_stream(f"{ECHO}/Bidi")
        md = (("mm-model-id", model_id),)
        self._call = bidi(iter(self._outbox.get, None), metadata=md, timeout=STREAM_DEADLINE_S)

    def ask(self, message: bytes) -> bytes:
        self._outbox.put(message)
        answer: bytes = next(self._call)
        return answer

    def close(self) -> None:
        self._outbox.put(None)
        self._call.cancel()


def test_stream_to_a_frozen_peer_ends_unavailable_not_at_its_deadline(
    fault_mesh: FaultMesh, models: list[GeneratedModel], data_plane: str
) -> None:
    # A long lease: the peer stays in the mesh, so only the channel's keepalive can tell.
    settings = {**GPU_ONLY, "instance_ttl_s": 600}
    b = fault_mesh.add("inst-b", settings={**settings, "labels": "gpu"})
    a = fault_mesh.add("inst-a", settings=settings)
    m = models[0]
    load_gpu(b, m)
    talk = Conversation(a, m.id)
    assert talk.ask(b"before") == m.id.encode() + b"|before"
    b.node.meshd.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(grpc.RpcError) as e:
            talk.ask(b"while frozen")
    finally:
        b.node.meshd.send_signal(signal.SIGCONT)
        talk.close()
    unavailable = stream_error_codes(data_plane, grpc.StatusCode.UNAVAILABLE)
    assert e.value.code() in unavailable, (e.value.code(), e.value.details())
    assert "inst-b" in listed_instances(a)  # the lease never ran out: keepalive ended the stream

    # Resumed: the next stream through a reaches b again.
    def fresh_stream_works() -> bool:
        again = Conversation(a, m.id)
        try:
            return again.ask(b"after") == m.id.encode() + b"|after"
        finally:
            again.close()

    wait_until(answers(fresh_stream_works), WAIT_S, "a stream through a to reach b again")


def test_call_in_flight_on_a_peer_whose_record_goes_is_run_once(
    fault_mesh: FaultMesh, models: list[GeneratedModel]
) -> None:
    # b's runtime takes 5 s per request; meanwhile b's instance record is deleted (as when
    # its lease is lost while the process runs on). a must not cancel and re-send the call.
    b = fault_mesh.add("inst-b", settings={**GPU_ONLY, "labels": "gpu"}, runtime_args=["--infer-delay-ms", "5000"])
    a = fault_mesh.add("inst-a", settings=GPU_ONLY)
    m = models[0]
    load_gpu(b, m)
    wait_until(answers(lambda: "inst-b" in listed_instances(a)), WAIT_S, "a to see b")
    before = runtime_counters(b)
    result: dict[str, Any] = {}

    def call() -> None:
        try:
            result["rows"] = a.infer(m.id, ROWS)
        except grpc.RpcError as err:
            result["error"] = f"{err.code().name}: {err.details()}"

    caller = threading.Thread(target=call)
    caller.start()
    try:
        wait_until(lambda: runtime_counters(b)["in_flight"] == 1, WAIT_S, "the request to reach b's runtime")
        fault_mesh.delete("instances", "inst-b")
    finally:
        caller.join(60)
    assert "error" not in result, result["error"]
    assert close_enough(result["rows"], expected(m, ROWS))
    after = runtime_counters(b)
    assert after["started"] - before["started"] == 1, (before, after)  # run once, never re-sent
    assert after["cancelled"] == before["cancelled"], (before, after)
