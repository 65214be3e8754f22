"""One trace across two meshd instances and the runtime hop.

The two instances run in this process (meshd.mesh.Instance), so each can have its own
TracerProvider with an in-memory exporter; etcd and the reference runtimes are real
processes, and the calls between the instances and to the runtimes go over real gRPC.
A request arrives at `a`, which may not load the model (only `b` has the label its type
needs), so `a` forwards it to `b`, which loads it and calls its runtime.
"""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc
from meshd.config import env_for, load_config
from meshd.kv.embedded import EmbeddedEtcd
from meshd.mesh import Instance
from meshd.observability.tracing import Tracing
from meshd.runtimes.echo import SERVICE, dataplane_streaming
from meshd.runtimes.models import GeneratedModel, generate_models
from meshd.testing.cluster import LocalMesh
from meshd.testing.procs import free_port

from .conftest import NodeFactory

pytestmark = pytest.mark.slow

ECHO = f"/{SERVICE}"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
WAIT_S = 30.0


@dataclass
class Node:
    instance: Instance
    exporter: InMemorySpanExporter | None
    runtime_port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.instance.grpc_port}"

    def spans(self) -> list[ReadableSpan]:
        assert self.exporter is not None
        return list(self.exporter.get_finished_spans())


@dataclass
class Pair:
    a: Node
    b: Node
    model_id: str
    channel: grpc.aio.Channel  # the client's, to a

    async def last_trace(self, node: Node) -> dict[str, str]:
        """The trace headers node's runtime received last (Echo's LastTrace)."""
        async with grpc.aio.insecure_channel(f"127.0.0.1:{node.runtime_port}") as ch:
            raw = await ch.unary_unary(f"{ECHO}/LastTrace")(b"", timeout=10)
        headers: dict[str, str] = json.loads(raw)
        return headers


PairFactory = Callable[..., Awaitable[Pair]]


@pytest.fixture
async def start_pair(
    etcd_server: EmbeddedEtcd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[PairFactory]:
    """Start b (label gpu) then a, with in-memory tracing (True) or as the environment says
    with no OTEL_* variables (False: off); register a `demo-gpu` model at a."""
    for var in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    procs = LocalMesh(tmp_path)
    procs.etcd_url = etcd_server.url
    instances: list[Instance] = []
    channels: list[grpc.aio.Channel] = []

    async def start(traced: bool, runtime_args: list[str] | None = None) -> Pair:
        service = f"svc-{uuid.uuid4().hex[:8]}"
        settings: dict[str, str | int] = {
            "service_name": service,
            "kv_store": f"etcd:{etcd_server.url}",
            "type_constraints": json.dumps({"demo-gpu": {"required": ["gpu"]}}),
            "dataplane_config": json.dumps({"rpcConfigs": dataplane_streaming()}),
        }
        nodes: list[Node] = []
        for iid, labels in (("inst-b", "gpu"), ("inst-a", "")):
            _, runtime_port = await asyncio.to_thread(procs.start_runtime, f"{iid}-runtime", runtime_args)
            env = env_for(
                {
                    **settings,
                    "instance_id": iid,
                    "labels": labels,
                    "grpc_port": free_port(),
                    "peer_port": free_port(),
                    "runtime_port": runtime_port,
                    "data_dir": str(tmp_path / iid),
                    "http_port": 0,  # two instances in one process: no fixed ports
                    "probe_port": "disabled",
                    "prestop_port": "disabled",
                    "metrics": f"prometheus:port={free_port()}",
                }
            )
            exporter = InMemorySpanExporter() if traced else None
            tracing = None
            if exporter is not None:
                provider = TracerProvider()
                provider.add_span_processor(SimpleSpanProcessor(exporter))
                tracing = Tracing(provider)
            instance = Instance(load_config(env=env), tracing=tracing)
            instances.append(instance)
            await instance.start()
            nodes.append(Node(instance, exporter, runtime_port))
        b, a = nodes
        await _until(lambda: a.instance.router is not None and a.instance.router.cluster.view().live("inst-b"))
        (model,) = generate_models(tmp_path / "models", 1, size_bytes=1 << 20)
        channel = grpc.aio.insecure_channel(a.target)
        channels.append(channel)
        info = mm.ModelInfo(type="demo-gpu", path=str(model.path))
        await mm_grpc.ModelMeshStub(channel).registerModel(
            mm.RegisterModelRequest(modelId=model.id, modelInfo=info), timeout=30
        )
        return Pair(a, b, model.id, channel)

    try:
        yield start
    finally:
        for ch in channels:
            await ch.close()
        for instance in reversed(instances):
            await instance.stop(drain=False)
        await asyncio.to_thread(procs.stop)  # the runtimes, by PID


async def _until(check: Callable[[], bool]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not check():
        if loop.time() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.05)


def _id(span_id: int) -> str:
    return f"{span_id:016x}"


def _one(spans: list[ReadableSpan], kind: SpanKind, **attrs: str) -> ReadableSpan:
    found = [
        s
        for s in spans
        if s.kind is kind and all((s.attributes or {}).get(k.replace("_", ".")) == v for k, v in attrs.items())
    ]
    assert len(found) == 1, [(s.name, s.kind, dict(s.attributes or {})) for s in spans]
    return found[0]


def _child_of(span: ReadableSpan, parent: ReadableSpan) -> bool:
    return span.parent is not None and span.parent.span_id == parent.context.span_id


def _sample(node: Node, name: str) -> float:
    """The sum of a sample over its label sets in the instance's own /metrics text."""
    text = node.instance.metrics.exposition().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split("{")[0] == name)


async def test_one_trace_across_two_instances_and_the_runtime(start_pair: PairFactory) -> None:
    pair: Pair = await start_pair(True)
    a, b = pair.a, pair.b
    md = (("mm-model-id", pair.model_id), ("traceparent", TRACEPARENT), ("tracestate", "client=1"))
    answer = await pair.channel.unary_unary(f"{ECHO}/Unary")(b"hi", metadata=md, timeout=30)
    assert answer == pair.model_id.encode() + b"|hi"

    # a: the server span continues the client's trace; the forward to b is its child.
    a_server = _one(a.spans(), SpanKind.SERVER)
    assert a_server.name == "meshd.demo.Echo/Unary"
    assert f"{a_server.context.trace_id:032x}" == TRACE_ID
    assert a_server.parent is not None and _id(a_server.parent.span_id) == CLIENT_SPAN
    assert (a_server.attributes or {})["meshd.model_id"] == pair.model_id
    assert (a_server.attributes or {})["rpc.grpc.status_code"] == 0
    hop = _one(a.spans(), SpanKind.CLIENT, meshd_hop="peer")
    assert _child_of(hop, a_server)
    assert (hop.attributes or {})["meshd.peer"] == "inst-b" and (hop.attributes or {})["meshd.mode"] == "load"
    assert not [s for s in a.spans() if (s.attributes or {}).get("meshd.hop") == "runtime"]

    # b: its server span is the child of a's forward; it loads (a miss), then calls its runtime.
    b_server = _one(b.spans(), SpanKind.SERVER)
    assert _child_of(b_server, hop)
    load = _one(b.spans(), SpanKind.INTERNAL)
    assert load.name == "meshd.load" and _child_of(load, b_server)
    runtime = _one(b.spans(), SpanKind.CLIENT, meshd_hop="runtime")
    assert _child_of(runtime, b_server) and runtime.name == "meshd.demo.Echo/Unary"
    every = a.spans() + b.spans()
    assert {f"{s.context.trace_id:032x}" for s in every} == {TRACE_ID}

    # The runtime got the trace context of b's call to it: one trace, end to end.
    received = await pair.last_trace(b)
    assert received["traceparent"] == f"00-{TRACE_ID}-{_id(runtime.context.span_id)}-01"
    assert received["tracestate"] == "client=1"

    # Metrics and traces together: b recorded its runtime call, a (the edge) the request.
    assert _sample(b, "modelmesh_invoke_model_milliseconds_count") == 1
    assert _sample(a, "modelmesh_api_request_milliseconds_count") == 1
    assert _sample(a, "modelmesh_invoke_model_milliseconds_count") == 0

    # Once loaded, the next call is forwarded to serve: no load span this time.
    for node in (a, b):
        assert node.exporter is not None
        node.exporter.clear()
    await pair.channel.unary_unary(f"{ECHO}/Unary")(b"again", metadata=md, timeout=30)
    assert (_one(a.spans(), SpanKind.CLIENT).attributes or {})["meshd.mode"] == "serve"
    assert not [s for s in b.spans() if s.kind is SpanKind.INTERNAL]


async def test_waiting_on_a_concurrency_limited_copy_is_a_queue_span(start_pair: PairFactory) -> None:
    pair = await start_pair(True, ["--limit-model-concurrency", "--max-concurrency", "1", "--infer-delay-ms", "200"])
    md = (("mm-model-id", pair.model_id), ("traceparent", TRACEPARENT))
    call = pair.channel.unary_unary(f"{ECHO}/Unary")
    await call(b"load", metadata=md, timeout=30)  # the copy is loaded on b
    for node in (pair.a, pair.b):
        assert node.exporter is not None
        node.exporter.clear()
    # Two at once on a copy that runs one at a time: one of them waits for the other.
    await asyncio.gather(call(b"1", metadata=md, timeout=30), call(b"2", metadata=md, timeout=30))
    servers = [s for s in pair.b.spans() if s.kind is SpanKind.SERVER]
    queues = sorted((s for s in pair.b.spans() if s.name == "meshd.queue"), key=lambda s: s.end_time or 0)
    runtimes = sorted(
        (s for s in pair.b.spans() if (s.attributes or {}).get("meshd.hop") == "runtime"), key=lambda s: s.end_time or 0
    )
    assert len(servers) == len(queues) == len(runtimes) == 2
    for queue in queues:
        assert any(_child_of(queue, server) for server in servers)
        assert (queue.attributes or {})["meshd.model_id"] == pair.model_id
    # The second request's queue span lasts until the first request's runtime call is over.
    first_done, waited = runtimes[0].end_time, queues[1].end_time
    assert first_done is not None and waited is not None and waited >= first_done


async def test_a_stream_is_one_span_per_instance_in_the_same_trace(start_pair: PairFactory) -> None:
    pair: Pair = await start_pair(True)
    md = (("mm-model-id", pair.model_id), ("traceparent", TRACEPARENT))
    answers = [r async for r in pair.channel.stream_stream(f"{ECHO}/Bidi")(iter([b"x", b"y"]), metadata=md)]
    assert answers == [pair.model_id.encode() + b"|x", pair.model_id.encode() + b"|y"]
    a_server = _one(pair.a.spans(), SpanKind.SERVER)
    b_server = _one(pair.b.spans(), SpanKind.SERVER)
    assert a_server.parent is not None and _id(a_server.parent.span_id) == CLIENT_SPAN
    assert _child_of(b_server, a_server)  # a stream's hop has no span of its own
    received = await pair.last_trace(pair.b)
    assert received["traceparent"] == f"00-{TRACE_ID}-{_id(b_server.context.span_id)}-01"


async def test_off_by_default_the_client_trace_headers_reach_the_runtime_unchanged(
    start_pair: PairFactory,
) -> None:
    pair: Pair = await start_pair(False)
    assert pair.a.instance.tracing is None and pair.b.instance.tracing is None
    assert pair.a.instance.router is not None and pair.a.instance.router.tracing is None
    md = (("mm-model-id", pair.model_id), ("traceparent", TRACEPARENT), ("tracestate", "client=1"))
    await pair.channel.unary_unary(f"{ECHO}/Unary")(b"hi", metadata=md, timeout=30)
    assert await pair.last_trace(pair.b) == {"traceparent": TRACEPARENT, "tracestate": "client=1"}


def test_bad_otel_values_leave_a_real_instance_serving_untraced(
    start_node: NodeFactory, models: list[GeneratedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Children inherit this environment: an exporter the SDK cannot build (a timeout that is not
    # a number) plus an unknown one. The instance starts, warns once each, serves untraced.
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp,jaeger")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "soon")
    c = start_node()
    m = models[0]
    c.register(m)
    assert c.infer(m.id, [[0.5, -1.0, 2.0, 0.25]])
    log = c.node.meshd.log_tail(200)
    assert "unknown exporter 'jaeger' ignored" in log and "tracing off: cannot set up OpenTelemetry" in log
    assert "Traceback" not in log


def test_console_exporter_from_the_environment(
    start_node: NodeFactory, models: list[GeneratedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "meshd-console-test")
    c = start_node()
    m = models[0]
    c.register(m)
    assert c.infer(m.id, [[0.5, -1.0, 2.0, 0.25]])
    c.node.meshd.stop(sig=signal.SIGINT)  # a clean stop flushes the batched spans
    log = c.node.meshd.log_tail(400)
    assert '"name": "inference.GRPCInferenceService/ModelInfer"' in log
    assert '"service.name": "meshd-console-test"' in log
    assert "Traceback" not in log
