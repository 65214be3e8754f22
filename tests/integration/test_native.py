"""The native data plane (MESHD_DATAPLANE=native) through real meshd, HAProxy and runtime
processes: what it carries and what it leaves to the Python path, counted by its own
counters (InstanceStats.nativeCarried); the LRU fed by those counters; peers reached on
their native ports; an eviction waiting for native requests in flight; HAProxy started
again after it dies. The data-plane, fault and bad-input suites run on it too
(`both_data_planes`)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.runtimes.models import (
    GeneratedModel,
    decode_infer_response,
    make_echo_request,
    make_infer_request,
    write_echo_model,
)
from meshd.serving.native.haproxy_config import trailers_reset_bug
from meshd.testing import haproxy
from meshd.testing.procs import free_port, wait_until

from .conftest import Client, NodeFactory, close_enough, expected
from .test_metrics import scrape, total

pytestmark = pytest.mark.slow

ROWS = [[0.5, -1.0, 2.0, 0.25]]
INFER = "ModelInfer"  # the metrics' method label


@pytest.fixture
def data_plane() -> str:
    return "native"


def carried(c: Client) -> int:
    return int(c.stats().nativeCarried)


def check(c: Client, model: GeneratedModel, header: str = "mm-model-id", model_id: str | None = None) -> None:
    assert close_enough(c.infer(model_id or model.id, ROWS, header=header), expected(model, ROWS))


def load(c: Client, model: GeneratedModel) -> None:
    assert c.register(model, loadNow=True, sync=True).status == mm.ModelStatusInfo.LOADED


def until_carried(c: Client, send: Callable[[], None], timeout_s: float = 15.0) -> int:
    """Send until the counters show a request carried natively, and say how many were sent.
    A route reaches HAProxy in the sync after what makes it (a load, a vmodel, HAProxy started
    again), not with it; until then requests take the Python path, as they should. Under load
    that is more than the fixed sleep these tests used to take."""
    start = carried(c)
    deadline = time.monotonic() + timeout_s
    sent = 0
    while carried(c) == start:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no request carried natively after {sent} in {timeout_s:.0f} s")
        send()
        sent += 1
        time.sleep(0.05)
    settled(c)
    return sent


def settled(c: Client, quiet_s: float = 2.0) -> int:
    """The native count once it stops moving (no new request: the last ones sent may show a
    counters poll later than the first), for tests that count exactly from there."""
    last = carried(c)
    while True:
        time.sleep(quiet_s)  # longer than a poll of the counters (1 s)
        now = carried(c)
        if now == last:
            return now
        last = now


@pytest.mark.parametrize("eviction", ["lru", "gdsf", "lrfu", "rate"])
def test_warm_requests_are_carried_natively_and_their_uses_reach_the_lru(
    start_node: NodeFactory, models: list[GeneratedModel], eviction: str
) -> None:
    c = start_node(capacity_models=3, settings={"eviction": eviction})
    assert c.stats().dataPlane == "native"
    m0, m1, m2, m3 = models[:4]
    load(c, m0)
    load(c, m1)  # m1 is now the most recently used
    until_carried(c, lambda: check(c, m0))
    before = carried(c)
    for _ in range(20):
        check(c, m0)
    wait_until(lambda: carried(c) >= before + 20, 10, "the counters to show the native requests")
    assert carried(c) == before + 20  # every one of them natively: the route was in before the first
    assert c.stats().requests >= 20  # and counted as served here, for the rates copy scaling reads
    # Only the counters say m0 was used after m1, and 21 times to the others' once. Under LRU
    # the eviction for m3 must take m1, exactly. Under GDSF, LRFU and RATE the victim also depends on each
    # copy's measured load time, so three evictions in a row (m3, m4, m5) must all spare m0:
    # with its load's single use it would be among the first to go.
    load(c, m2)
    load(c, m3)
    if eviction == "lru":
        assert c.runtime_loaded() == sorted([m0.id, m2.id, m3.id])
    else:
        m4, m5 = models[4:6]
        load(c, m4)
        load(c, m5)
        loaded = c.runtime_loaded()
        assert m0.id in loaded and m5.id in loaded and len(loaded) == 3, loaded


def test_a_miss_takes_the_python_path_then_warm_requests_go_native(
    start_node: NodeFactory, models: list[GeneratedModel]
) -> None:
    c = start_node()
    m = models[0]
    c.register(m)  # registered, not loaded
    check(c, m)  # the Python path loads it
    assert carried(c) == 0
    wait_until(lambda: m.id in c.stats().loadedModels, 10, "the copy")
    deadline = time.monotonic() + 10
    while carried(c) == 0 and time.monotonic() < deadline:  # the route goes in within a sync
        check(c, m)
        time.sleep(0.1)
    assert carried(c) > 0


def test_vmodel_requests_are_carried_as_their_active_model(
    start_node: NodeFactory, models: list[GeneratedModel]
) -> None:
    c = start_node()
    m0, m1 = models[:2]
    load(c, m0)
    load(c, m1)
    req = mm.SetVModelRequest(vModelId="v", targetModelId=m0.id, sync=True)
    assert c.mm.setVModel(req, timeout=30).status == mm.VModelStatusInfo.DEFINED
    until_carried(c, lambda: check(c, m0, header="mm-vmodel-id", model_id="v"))  # the vmodels map has v
    before = carried(c)
    for _ in range(10):
        check(c, m0, header="mm-vmodel-id", model_id="v")
    wait_until(lambda: carried(c) >= before + 10, 10, "native vmodel requests")
    # The vmodel moves: the next requests (after a sync) reach the new target.
    req = mm.SetVModelRequest(vModelId="v", targetModelId=m1.id, sync=True)
    assert c.mm.setVModel(req, timeout=30).status == mm.VModelStatusInfo.DEFINED

    def answers_as(model: GeneratedModel) -> bool:
        return close_enough(c.infer("v", ROWS, header="mm-vmodel-id"), expected(model, ROWS))

    wait_until(lambda: answers_as(m1), 10, "the vmodel's new target")  # the map changes at a sync
    assert all(answers_as(m1) for _ in range(5))  # and stays changed


def test_a_peers_copy_is_reached_on_its_native_port(start_node: NodeFactory, models: list[GeneratedModel]) -> None:
    settings: dict[str, str | int] = {"type_constraints": json.dumps({"demo-gpu": {"required": ["gpu"]}})}
    b = start_node("inst-b", settings={**settings, "labels": "gpu"})
    a = start_node("inst-a", settings=settings)
    m = models[0]
    info = mm.ModelInfo(type="demo-gpu", path=str(m.path))
    req = mm.RegisterModelRequest(modelId=m.id, modelInfo=info, loadNow=True, sync=True)
    assert a.mm.registerModel(req, timeout=30).status == mm.ModelStatusInfo.LOADED
    deadline = time.monotonic() + 10
    while carried(b) < 20 and time.monotonic() < deadline:
        check(a, m)  # a holds no copy: the first goes through a's Python path, then natively to b
    assert carried(b) >= 20
    assert carried(a) == 0
    assert a.runtime_loaded() == []


def test_an_eviction_waits_for_the_native_requests_in_flight(
    start_node: NodeFactory, models: list[GeneratedModel]
) -> None:
    c = start_node(runtime_args=["--infer-delay-ms", "1500"])
    m = models[0]
    load(c, m)
    until_carried(c, lambda: check(c, m))  # the route is in
    before = carried(c)
    results: list[str] = []

    def call() -> None:
        try:
            check(c, m)
            results.append("ok")
        except Exception as e:
            results.append(f"failed: {e}")

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the four are in the runtime's delay
    unload = c.mm.unregisterModel(mm.UnregisterModelRequest(modelId=m.id), timeout=30)
    assert unload is not None
    for t in threads:
        t.join(30)
    assert results == ["ok"] * 4
    wait_until(lambda: c.runtime_loaded() == [], 10, "the unload, after the requests")
    wait_until(lambda: carried(c) >= before + 4, 10, "the counters")
    assert carried(c) == before + 4


def test_limited_copies_and_ids_in_the_body_stay_on_the_python_path(
    start_node: NodeFactory, models: list[GeneratedModel]
) -> None:
    limited = start_node(
        "inst-limited", runtime_args=["--max-concurrency", "2", "--limit-model-concurrency"]
    )  # the copy's queue is the Python path's
    m = models[0]
    load(limited, m)
    for _ in range(10):
        check(limited, m)
    dataplane = {"rpcConfigs": {"inference.GRPCInferenceService/ModelInfer": {"idExtractionPath": [1]}}}
    body = start_node("inst-body", settings={"dataplane_config": json.dumps(dataplane)})
    m1 = models[1]
    load(body, m1)
    for _ in range(10):
        check(body, m1)
    time.sleep(1.5)  # a poll of the counters
    assert carried(limited) == 0
    assert carried(body) == 0


def test_haproxy_that_dies_is_started_again(start_node: NodeFactory, models: list[GeneratedModel]) -> None:
    c = start_node()
    m = models[0]
    load(c, m)
    pid = haproxy.child_of(c.node.meshd.pid)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: haproxy.child_of(c.node.meshd.pid) not in (None, pid), 15, "a new haproxy")
    deadline = time.monotonic() + 15
    while True:  # its port opens once it runs
        try:
            check(c, m)
            break
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    until_carried(c, lambda: check(c, m))  # its routes go in at the sync after it answers
    before = carried(c)
    for _ in range(10):
        check(c, m)
    wait_until(lambda: carried(c) >= before + 10, 10, "native requests after the restart")


def test_a_runtime_wanting_the_id_in_the_body_gets_it_natively_only_when_the_body_has_it(
    start_node: NodeFactory, models: list[GeneratedModel]
) -> None:
    # --inject-id: idInjectionPath [1] for ModelInfer, as the KServe runtime adapters announce.
    c = start_node(runtime_args=["--inject-id"])
    m = models[0]
    load(c, m)
    until_carried(c, lambda: check(c, m))  # the route is in
    start = carried(c)
    for _ in range(10):
        check(c, m)  # the body's model_name is the model id, as KServe clients send it
    wait_until(lambda: carried(c) >= start + 10, 10, "native requests")
    before = settled(c)
    other = make_infer_request("some-other-name", ROWS)  # the Python path splices the id in
    for _ in range(10):
        resp = c.v2.ModelInfer(other, metadata=(("mm-model-id", m.id),), timeout=30)
        assert close_enough(decode_infer_response(resp), expected(m, ROWS))
    big = [[0.5] * 4] * 40_000  # 640 KB: the id is read from the body's start, not the whole body
    big_req = make_infer_request(m.id, big)
    resp = c.v2.ModelInfer(big_req, metadata=(("mm-model-id", m.id),), timeout=30)
    assert close_enough(decode_infer_response(resp)[:1], expected(m, big[:1]))
    wait_until(lambda: carried(c) > before, 10, "the large request, carried natively")
    time.sleep(1.5)  # a poll more: none of the others shows up late
    assert carried(c) == before + 1


def test_natively_carried_calls_keep_their_metrics_and_invoke_log(
    start_node: NodeFactory, models: list[GeneratedModel]
) -> None:
    port = free_port()
    metrics = f"prometheus:port={port};per_model_metrics=true"
    c = start_node(settings={"metrics": metrics, "log_each_invoke": "true"})
    m = models[0]
    load(c, m)
    primed = until_carried(c, lambda: check(c, m))  # the route is in: these took either path
    start = carried(c)
    for _ in range(10):
        check(c, m)
    wait_until(lambda: carried(c) >= start + 10, 10, "native requests")
    assert carried(c) == start + 10
    api = "modelmesh_api_request_milliseconds_count"
    # The same names and labels as the Python path's records, from HAProxy's log of each call:
    # every call counted once, whichever path carried it.
    calls = primed + 10
    wait_until(lambda: total(scrape(port), api, modelId=m.id) == calls, 10, "the carried calls' metrics")
    series = scrape(port)
    assert total(series, api, method=INFER, code="OK", modelId=m.id, vModelId="") == calls
    assert total(series, "modelmesh_invoke_model_milliseconds_count", method=INFER, code="OK", modelId=m.id) == calls
    lines = [line for line in c.node.meshd.log_path.read_text().splitlines() if "served_by=local native" in line]
    assert len(lines) == carried(c) and all(f"model={m.id}" in line for line in lines)


def many_large_requests(c: Client, tmp_path: Path, rounds: int = 1) -> None:
    """64 concurrent 1 MiB echo calls on one connection, `rounds` times; all must complete."""
    echo = write_echo_model(tmp_path / "echo.json")
    info = mm.ModelInfo(type="demo", path=str(echo))
    req = mm.RegisterModelRequest(modelId="echo", modelInfo=info, loadNow=True, sync=True)
    assert c.mm.registerModel(req, timeout=30).status == mm.ModelStatusInfo.LOADED
    small = make_echo_request("echo", 16)

    def echo_small() -> None:
        c.v2.ModelInfer(small, metadata=(("mm-model-id", "echo"),), timeout=30)

    until_carried(c, echo_small)  # the route is in
    before = carried(c)
    request = make_echo_request("echo", 1 << 20)
    options = [("grpc.max_send_message_length", 8 << 20), ("grpc.max_receive_message_length", 8 << 20)]
    for _ in range(rounds):
        with grpc.insecure_channel(c.node.target, options=options) as channel:
            infer = channel.unary_unary(
                "/inference.GRPCInferenceService/ModelInfer",
                request_serializer=lambda r: r.SerializeToString(),
                response_deserializer=lambda b: b,
            )
            futures = [infer.future(request, metadata=(("mm-model-id", "echo"),), timeout=60) for _ in range(64)]
            sizes = [len(f.result()) for f in futures]
        assert all(size > 1 << 20 for size in sizes)
    wait_until(lambda: carried(c) >= before + 64 * rounds, 10, "the counters")


def runtime_connections(c: Client) -> int:
    """How many connections this node's HAProxy has opened to its runtime (`show stat`)."""
    pid = haproxy.child_of(c.node.meshd.proc.pid)
    assert pid is not None
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    config = Path(args[args.index(b"-f") + 1].decode())
    api = next(line.split()[2] for line in config.read_text().splitlines() if line.strip().startswith("stats socket"))
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(api)
        s.sendall(b"show stat\n")
        out = b"".join(iter(lambda: s.recv(65536), b"")).decode()
    header, *rows = out.lstrip("# ").splitlines()
    fields = header.split(",")
    for row in rows:
        values = dict(zip(fields, row.split(","), strict=False))
        if values.get("pxname") == "be_local" and values.get("svname") == "rt":
            return int(values["connect"] or 0)
    raise AssertionError(f"no be_local/rt row in: {out[:500]}")


def test_many_large_requests_at_once_all_complete(start_node: NodeFactory, tmp_path: Path, haproxy_path: str) -> None:
    # With a per-stream window larger than HAProxy's stream buffers, these once stalled HAProxy's
    # HTTP/2 demultiplexer for good. On an HAProxy with the trailers bug (Debian 12's 2.6.12),
    # the runtime connection carrying them was reset now and then, with every stream on it.
    # The tests' HAProxy is one without it where it can be built (meshd.testing.haproxy).
    c = start_node(capacity_models=64)
    many_large_requests(c, tmp_path)
    if trailers_reset_bug(haproxy.version(haproxy_path) or ""):
        assert runtime_connections(c) >= 64  # one per request, as below
    else:
        assert runtime_connections(c) < 64  # streams share connections


@pytest.fixture(scope="session")
def haproxy_with_trailers_bug() -> str:
    """Debian 12's HAProxy (2.6.12), fetched from its package: one with the trailers bug."""
    found = haproxy.fetch()
    if found is None:
        pytest.skip("no apt-get here to fetch Debian's HAProxy package")
    line = haproxy.version(found) or ""
    if not trailers_reset_bug(line):
        pytest.skip(f"Debian's HAProxy here is {line}, without the trailers bug")
    return found


def test_an_haproxy_with_the_trailers_bug_opens_a_connection_per_request(
    start_node: NodeFactory, tmp_path: Path, haproxy_with_trailers_bug: str
) -> None:
    c = start_node(capacity_models=64, settings={"haproxy": haproxy_with_trailers_bug})
    assert "HAProxy issue #2388" in c.node.meshd.log_tail(200)  # said at start-up, with the cost
    many_large_requests(c, tmp_path, rounds=3)
    assert runtime_connections(c) >= 64 * 3  # one per request
