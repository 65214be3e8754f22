"""Token metrics of language models (gen_ai_*), read from a real meshd's /metrics after real
calls: etcd, meshd with metrics on, `meshd llm-runtime` and an engine of our own
(meshd.testing.fake_llm: one token a word, a usage when asked, as vLLM)."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc
from meshd.testing.cluster import LocalMesh, Node
from meshd.testing.llm import LlmRuntimeArgs, add_llm_node
from meshd.testing.procs import free_ports

pytestmark = pytest.mark.slow  # real processes: etcd, meshd, the runtime and its engine

FAKE = f"{sys.executable} -m meshd.testing.fake_llm --port {{port}} --name {{name}} --token-interval-ms 5"


@pytest.fixture
def node(tmp_path: Path, etcd_server: Any) -> Iterator[tuple[Node, int]]:
    mesh = LocalMesh(tmp_path / "mesh", service=f"llm-metrics-{tmp_path.name}")
    mesh.etcd_url = etcd_server.url
    (metrics_port,) = free_ports(1)
    try:
        args = LlmRuntimeArgs(Path(sys.executable), engine_command=FAKE, engine_args=())
        n = add_llm_node(mesh, "m", args, {"metrics": f"prometheus:port={metrics_port}"})
        with grpc.insecure_channel(n.target) as ch:
            info = mm.ModelInfo(type="llm", path=str(tmp_path))
            mm_grpc.ModelMeshStub(ch).registerModel(mm.RegisterModelRequest(modelId="echo", modelInfo=info), timeout=30)
        yield n, metrics_port
    finally:
        mesh.stop()


def complete(node: Node, body: dict[str, Any]) -> bytes:
    request = urllib.request.Request(
        node.http_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.status == 200
        return bytes(r.read())


def samples(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("gen_ai_") and not s.name.endswith("_bucket")
    }


def test_streamed_and_json_calls_count_tokens_and_their_times(node: tuple[Node, int]) -> None:
    n, port = node
    streamed = complete(n, {"model": "echo", "prompt": "one two three four", "stream": True})
    assert streamed.count(b"data: {") == 4
    complete(n, {"model": "echo", "prompt": "a b", "repeat": 3, "stream": True})  # 6 tokens
    # With the engine's usage (vLLM's last event), its count is the one taken; the input too.
    asked = {"model": "echo", "prompt": "x y z", "stream": True, "stream_options": {"include_usage": True}}
    complete(n, asked)
    complete(n, {"model": "echo", "prompt": "p q", "repeat": 5})  # JSON: 10 tokens, 2 in
    got = samples(port)
    op = (("gen_ai_operation_name", "text_completion"), ("gen_ai_request_model", "echo"))
    out, inp = (*op, ("gen_ai_token_type", "output")), (*op, ("gen_ai_token_type", "input"))
    assert got[("gen_ai_client_token_usage_count", tuple(sorted(out)))] == 4
    assert got[("gen_ai_client_token_usage_sum", tuple(sorted(out)))] == 4 + 6 + 3 + 10
    assert got[("gen_ai_client_token_usage_count", tuple(sorted(inp)))] == 2
    assert got[("gen_ai_client_token_usage_sum", tuple(sorted(inp)))] == 3 + 2
    # Time to first token: streams only; time per output token: streams of 2 tokens or more.
    ttft = got[("gen_ai_server_time_to_first_token_seconds_count", op)]
    tpot = got[("gen_ai_server_time_per_output_token_seconds_count", op)]
    assert (ttft, tpot) == (3, 3)
    assert got[("gen_ai_server_time_to_first_token_seconds_sum", op)] > 0
    assert got[("gen_ai_server_time_per_output_token_seconds_sum", op)] > 0


def test_a_refused_call_counts_no_tokens(node: tuple[Node, int]) -> None:
    n, port = node
    request = urllib.request.Request(
        n.http_url + "/v1/completions", b'{"model": "absent"}', {"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    assert e.value.code == 404
    assert not [k for k in samples(port) if k[0].endswith("_count")]
