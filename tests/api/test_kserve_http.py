"""The KServe V2 REST transport over the real core, with a fake mesh behind it: every route,
status codes, and `{"error": ...}` bodies for each bad input."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from meshd.api.kserve_core import KServeCore
from meshd.api.kserve_http import HttpServer, KServeHttp
from meshd.core.errors import InvalidArgument, NotFound
from meshd.decisions.status import NOT_FOUND, ModelStatus, StatusView
from meshd.net.listen import ipv6_available


class FakeMesh:
    """Models by status; `load` makes a model LOADED unless it is in `broken`."""

    def __init__(self) -> None:
        self.models = {"loaded": ModelStatus.LOADED, "idle": ModelStatus.NOT_LOADED}
        self.vmodels = {"vm": "loaded"}
        self.broken = {"bad"}
        self.directory = ["fresh", "loaded"]
        self.serving = True

    def status(self, name: str) -> StatusView:
        if name in self.broken:
            return StatusView(ModelStatus.LOADING_FAILED, ("inst-a: boom",))
        return StatusView(self.models[name]) if name in self.models else NOT_FOUND

    async def resolve(self, vmodel: str) -> str:
        if vmodel not in self.vmodels:
            raise NotFound(f"vmodel {vmodel!r} not found")
        return self.vmodels[vmodel]

    def model_ids(self) -> list[str]:
        return [*self.models, *self.broken]

    async def unregistered(self) -> list[str]:
        return self.directory

    async def load(self, name: str) -> StatusView:
        if "/" in name:
            raise InvalidArgument(f"model name {name!r} must be a single folder name")
        if name in self.directory and name not in self.models:
            self.models[name] = ModelStatus.NOT_LOADED
        if name not in self.models and name not in self.broken:
            raise NotFound(f"model {name!r} not found")
        if name not in self.broken:
            self.models[name] = ModelStatus.LOADED
        return self.status(name)

    async def unload(self, name: str) -> None:
        if name not in self.models:
            raise NotFound(f"model {name!r} not found")
        self.models[name] = ModelStatus.NOT_LOADED


@pytest.fixture
def fake() -> FakeMesh:
    return FakeMesh()


@pytest.fixture
async def client(fake: FakeMesh) -> AsyncIterator[TestClient[Any, Any]]:
    core = KServeCore(fake.status, lambda: fake.serving, fake, fake.resolve)
    async with TestClient(TestServer(KServeHttp(core).app())) as c:
        yield c


async def call(client: TestClient[Any, Any], method: str, path: str, **kw: Any) -> tuple[int, Any]:
    resp = await client.request(method, path, **kw)
    assert resp.content_type == "application/json", await resp.text()
    return resp.status, await resp.json()


async def test_health_and_metadata(client: TestClient[Any, Any], fake: FakeMesh) -> None:
    assert await call(client, "GET", "/v2/health/live") == (200, {"live": True})
    assert await call(client, "GET", "/v2/health/ready") == (200, {"ready": True})
    status, body = await call(client, "GET", "/v2")
    assert status == 200 and body["name"] == "meshd" and body["extensions"] == ["model_repository"]
    fake.serving = False
    assert await call(client, "GET", "/v2/health/ready") == (503, {"ready": False, "error": "meshd is stopping"})


async def test_model_ready(client: TestClient[Any, Any]) -> None:
    assert await call(client, "GET", "/v2/models/loaded/ready") == (200, {"name": "loaded", "ready": True})
    assert await call(client, "GET", "/v2/models/loaded/versions/7/ready") == (200, {"name": "loaded", "ready": True})
    assert await call(client, "GET", "/v2/models/vm/ready") == (200, {"name": "vm", "ready": True})
    status, body = await call(client, "GET", "/v2/models/idle/ready")
    assert status == 503 and body["ready"] is False and "NOT_LOADED" in body["error"]
    assert await call(client, "GET", "/v2/models/nope/ready") == (404, {"error": "model 'nope' not found"})
    # Headers route as on gRPC: mm-model-id wins over the path's name; an unknown vmodel is 404.
    assert (await call(client, "GET", "/v2/models/nope/ready", headers={"mm-model-id": "loaded"}))[0] == 200
    status, body = await call(client, "GET", "/v2/models/x/ready", headers={"mm-vmodel-id": "nov"})
    assert (status, body) == (404, {"error": "vmodel 'nov' not found"})


async def test_index(client: TestClient[Any, Any]) -> None:
    status, body = await call(client, "POST", "/v2/repository/index")
    assert status == 200
    assert [(m["name"], m["state"]) for m in body] == [
        ("bad", "UNAVAILABLE"),
        ("idle", "UNAVAILABLE"),
        ("loaded", "READY"),
        ("fresh", ""),  # in the directory, not registered
    ]
    assert body[0]["reason"] == "inst-a: boom" and body[1]["reason"] == "not loaded"
    status, body = await call(client, "POST", "/v2/repository/index", json={"ready": True})
    assert status == 200 and [m["name"] for m in body] == ["loaded"]


@pytest.mark.parametrize(
    ("data", "message"),
    [("{", "malformed JSON body"), ("[1]", "must be a JSON object"), ('{"ready": "yes"}', "'ready' must be true")],
)
async def test_index_bad_bodies(client: TestClient[Any, Any], data: str, message: str) -> None:
    status, body = await call(client, "POST", "/v2/repository/index", data=data)
    assert status == 400 and message in body["error"]


async def test_load_and_unload(client: TestClient[Any, Any], fake: FakeMesh) -> None:
    assert await call(client, "POST", "/v2/repository/models/idle/load") == (200, {})
    assert fake.models["idle"] == ModelStatus.LOADED
    assert await call(client, "POST", "/v2/repository/models/fresh/load", json={}) == (200, {})
    assert await call(client, "POST", "/v2/repository/models/idle/unload") == (200, {})
    assert fake.models["idle"] == ModelStatus.NOT_LOADED
    status, body = await call(client, "POST", "/v2/repository/models/bad/load")
    assert status == 500 and body["error"] == "failed to load 'bad': inst-a: boom"
    assert (await call(client, "POST", "/v2/repository/models/nope/load"))[0] == 404
    assert (await call(client, "POST", "/v2/repository/models/nope/unload"))[0] == 404
    status, body = await call(client, "POST", "/v2/repository/models/..%2Fx/load")  # decoded: ../x
    assert status == 400 and "single folder name" in body["error"]
    assert (await call(client, "POST", "/v2/repository/models/idle/load", data="{"))[0] == 400


async def test_unserved_and_unknown_endpoints_answer_json(client: TestClient[Any, Any]) -> None:
    for method, path in [("GET", "/v2/models/loaded"), ("POST", "/v2/models/loaded/infer")]:
        status, body = await call(client, method, path)
        assert status == 501 and "use gRPC" in body["error"]
    assert await call(client, "GET", "/v3/nothing") == (404, {"error": "no endpoint GET /v3/nothing"})
    status, body = await call(client, "GET", "/v2/repository/index")
    assert status == 405 and body["error"]


async def test_without_the_repository_extension(fake: FakeMesh) -> None:
    core = KServeCore(fake.status, lambda: True)
    async with TestClient(TestServer(KServeHttp(core).app())) as c:
        assert (await call(c, "GET", "/v2"))[1]["extensions"] == []
        status, body = await call(c, "POST", "/v2/repository/index")
        assert status == 501 and "not enabled" in body["error"]


class FakeInfer:
    """Answers a ModelInfer with its inputs echoed as outputs (raw), recording the ids."""

    def __init__(self) -> None:
        self.ids: list[Any] = []
        self.timeouts: list[float | None] = []
        self.error: Exception | None = None

    async def __call__(self, request: bytes, ids: Any, timeout_s: float | None) -> bytes:
        from meshd._proto.inference import grpc_predict_v2_pb2 as pb

        self.ids.append(ids)
        self.timeouts.append(timeout_s)
        if self.error is not None:
            raise self.error
        req = pb.ModelInferRequest.FromString(request)
        resp = pb.ModelInferResponse(model_name=req.model_name, id=req.id)
        for t in req.inputs:
            resp.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        resp.raw_output_contents.extend(req.raw_input_contents)
        return resp.SerializeToString()


async def test_inference_is_translated_and_routed_by_path_or_header(fake: FakeMesh) -> None:
    import base64
    import struct

    from meshd.core.errors import Unavailable

    infer = FakeInfer()
    core = KServeCore(fake.status, lambda: True)
    doc = {"id": "1", "inputs": [{"name": "x", "shape": [2], "datatype": "INT32", "data": [1, -2]}]}
    async with TestClient(TestServer(KServeHttp(core, infer).app())) as c:
        status, body = await call(c, "POST", "/v2/models/m1/infer", json=doc)
        assert status == 200 and body["outputs"] == [{"name": "x", "datatype": "INT32", "shape": [2], "data": [1, -2]}]
        assert (infer.ids[-1].model_id, infer.ids[-1].vmodel_id) == ("m1", None)
        await call(c, "POST", "/v2/models/path-name/versions/3/infer", json=doc, headers={"mm-vmodel-id": "vm"})
        assert (infer.ids[-1].model_id, infer.ids[-1].vmodel_id) == (None, "vm")
        bin_id = base64.b64encode("mödel".encode()).decode()
        await call(c, "POST", "/v2/models/x/infer", json=doc, headers={"mm-model-id-bin": bin_id})
        assert infer.ids[-1].model_id == "mödel"
        # Binary in, binary out: the header names the JSON's length both ways.
        header = json.dumps(
            {
                "inputs": [{"name": "x", "shape": [2], "datatype": "INT32", "parameters": {"binary_data_size": 8}}],
                "outputs": [{"name": "x", "parameters": {"binary_data": True}}],
            }
        ).encode()
        raw = struct.pack("<2i", 5, 6)
        resp = await c.post(
            "/v2/models/m1/infer",
            data=header + raw,
            headers={"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"},
        )
        assert resp.status == 200 and resp.content_type == "application/octet-stream"
        body_bytes = await resp.read()
        n = int(resp.headers["Inference-Header-Content-Length"])
        assert json.loads(body_bytes[:n])["outputs"][0]["parameters"] == {"binary_data_size": 8}
        assert body_bytes[n:] == raw
        # Errors: {"error": ...} with the HTTP status of the failure.
        status, body = await call(c, "POST", "/v2/models/m1/infer", data=b"{")
        assert status == 400 and "malformed JSON" in body["error"]
        headers = {"Inference-Header-Content-Length": "ten"}
        status, body = await call(c, "POST", "/v2/models/m1/infer", data=b"{}", headers=headers)
        assert status == 400 and "Inference-Header-Content-Length" in body["error"]
        both = {"mm-model-id": "a", "mm-vmodel-id": "b"}
        status, body = await call(c, "POST", "/v2/models/m1/infer", json=doc, headers=both)
        assert status == 400 and "both a model and a vmodel" in body["error"]
        infer.error = Unavailable("no copy of 'm1' could serve")
        assert await call(c, "POST", "/v2/models/m1/infer", json=doc) == (503, {"error": "no copy of 'm1' could serve"})


async def test_an_http_call_carries_the_deadline_its_timeout_header_gives(fake: FakeMesh) -> None:
    """Issue 33: the load queue waits as long as the client will (mm-timeout-ms, or the
    OpenAI SDKs' x-stainless-timeout in seconds); none: the daemon's default. A bad value is
    a 400 naming the header, and nothing is routed."""
    infer = FakeInfer()
    core = KServeCore(fake.status, lambda: True)
    doc = {"inputs": [{"name": "x", "shape": [1], "datatype": "INT32", "data": [1]}]}
    async with TestClient(TestServer(KServeHttp(core, infer).app())) as c:
        for headers, timeout in [
            ({}, None),
            ({"mm-timeout-ms": "60000"}, 60.0),
            ({"X-Stainless-Timeout": "600"}, 600.0),
            ({"mm-timeout-ms": "1500", "x-stainless-timeout": "600"}, 1.5),  # meshd's own header wins
        ]:
            status, _ = await call(c, "POST", "/v2/models/m1/infer", json=doc, headers=headers)
            assert status == 200 and infer.timeouts[-1] == timeout, headers
        routed = len(infer.ids)
        for bad in ["soon", "0", "-5", "nan", "inf", "1e99"]:
            status, body = await call(c, "POST", "/v2/models/m1/infer", json=doc, headers={"mm-timeout-ms": bad})
            assert status == 400 and "mm-timeout-ms header must be a positive number of milliseconds" in body["error"]
        status, body = await call(c, "POST", "/v2/models/m1/infer", json=doc, headers={"x-stainless-timeout": "x"})
        assert status == 400 and "x-stainless-timeout header must be a positive number of seconds" in body["error"]
        assert len(infer.ids) == routed


async def test_model_metadata_is_one_routed_model_metadata_call_rendered_as_rest(fake: FakeMesh) -> None:
    from meshd._proto.inference import grpc_predict_v2_pb2 as pb
    from meshd.core.errors import NotFound

    asked: list[tuple[Any, Any]] = []
    missing: list[str] = []

    async def metadata(request: bytes, ids: Any, timeout_s: float | None) -> bytes:
        req = pb.ModelMetadataRequest.FromString(request)
        asked.append((req, ids))
        if missing:
            raise NotFound(missing[0])
        resp = pb.ModelMetadataResponse(name=req.name, versions=["1"], platform="demo")
        resp.inputs.add(name="x", datatype="FP32", shape=[-1, 4])
        resp.outputs.add(name="y", datatype="FP32", shape=[-1, 2])
        return resp.SerializeToString()

    core = KServeCore(fake.status, lambda: True)
    async with TestClient(TestServer(KServeHttp(core, model_metadata=metadata).app())) as c:
        status, body = await call(c, "GET", "/v2/models/m1")
        assert status == 200 and body == {
            "name": "m1",
            "versions": ["1"],
            "platform": "demo",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],  # numbers, not int64 strings
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
        }
        assert (asked[-1][0].name, asked[-1][1].model_id) == ("m1", "m1")
        await call(c, "GET", "/v2/models/any/versions/7", headers={"mm-vmodel-id": "vm"})
        assert (asked[-1][0].version, asked[-1][1].vmodel_id, asked[-1][1].model_id) == ("7", "vm", None)
        missing.append("model 'gone' not found")
        assert await call(c, "GET", "/v2/models/gone") == (404, {"error": "model 'gone' not found"})
        status, body = await call(c, "GET", "/v2/models/x", headers={"mm-model-id": "a", "mm-vmodel-id": "b"})
        assert status == 400 and "both a model and a vmodel" in body["error"]


async def raw_exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection, read to EOF (the server closes after a parse error)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        data = await reader.read()
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


@pytest.mark.parametrize(
    "request_bytes",
    [
        # issue 15, item 7: a 10,000-character model name in the request line
        b"POST /v2/repository/models/" + b"m" * 10_000 + b"/load HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
        b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * 10_000 + b"\r\n\r\n",
        b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-" + b"n" * 10_000 + b": v\r\n\r\n",
        b"NOT HTTP AT ALL\r\n\r\n",
    ],
    ids=["long-request-line", "long-header-value", "long-header-name", "garbage"],
)
async def test_requests_the_parser_refuses_answer_json_without_a_traceback(
    fake: FakeMesh, request_bytes: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    core = KServeCore(fake.status, lambda: fake.serving, fake, fake.resolve)
    server = HttpServer(core, "127.0.0.1", 0)
    port = await server.start()
    try:
        with caplog.at_level(logging.DEBUG):
            status, headers, body = await raw_exchange(port, request_bytes)
            # the server still serves the next connection
            ok_status, _, ok_body = await raw_exchange(
                port, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
    finally:
        await server.stop()
    assert status == 400
    assert headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert error.startswith("bad HTTP request") and len(error) < 400
    assert (ok_status, json.loads(ok_body)) == (200, {"live": True})
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info], caplog.text


@pytest.mark.skipif(not ipv6_available(), reason="no IPv6 on this host")
async def test_with_no_host_http_answers_on_ipv6_and_ipv4(fake: FakeMesh) -> None:
    server = HttpServer(KServeCore(fake.status, lambda: True, fake, fake.resolve), None, 0)
    port = await server.start()
    try:
        assert len(server.runner.addresses) == 1  # one dual-stack socket, not one per family
        for host in ("::1", "127.0.0.1"):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            await writer.drain()
            assert (await reader.read()).startswith(b"HTTP/1.1 200"), host
            writer.close()
    finally:
        await server.stop()
