"""The native data plane's arrivals, for the load queue's popularity (which counts every
request arriving at an instance, local hits included, as the simulator does): a real HAProxy
on the rendered configuration counts, per model, the requests that arrived from a client and
were carried natively (to the local runtime or to a peer), not a peer's native hop nor what
it leaves to the Python path (which counts its own); the plane's poll hands the new ones to
`LocalModels.popularity`. Runtime, peer and Python path are in-process servers."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshd.core.records import ModelRecord, VModelRecord
from meshd.kv.memory import MemoryStore
from meshd.kv.table import Table
from meshd.registry.models import Registry
from meshd.serving.local import LocalModels
from meshd.serving.native.haproxy import HAProxy
from meshd.serving.native.haproxy_config import (
    ARRIVALS_TABLE,
    COUNTERS_TABLE,
    HOP_HEADER,
    PEER_BACKEND,
    PLAIN,
    Layout,
    parse_table,
    render,
)
from meshd.serving.native.plane import NativePlane
from meshd.testing.fake_runtime import FakeRuntime, runtime_info
from meshd.testing.procs import free_port

PREDICT = "/t.Runtime/Predict"


class Answers(grpc.GenericRpcHandler):  # type: ignore[misc]
    """A server behind HAProxy: answers every call with its own name, recording the model."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.models: list[str] = []

    def service(self, details: Any) -> Any:
        async def predict(request: bytes, context: Any) -> bytes:
            self.models.append(dict(context.invocation_metadata())["mm-model-id"])
            return self.name.encode()

        return grpc.unary_unary_rpc_method_handler(predict)


async def serve(handler: Answers) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([handler])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@dataclasses.dataclass
class Native:
    haproxy: HAProxy
    port: int
    runtime: Answers
    peer: Answers
    python: Answers

    async def call(self, model_id: str, hop: bool = False) -> bytes:
        metadata = (("mm-model-id", model_id), *(((HOP_HEADER, "1"),) if hop else ()))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as ch:
            answer: bytes = await ch.unary_unary(PREDICT)(b"\x00\x00\x00\x00\x00", metadata=metadata, timeout=10)
            return answer


@pytest.fixture
async def native(haproxy_path: str, tmp_path: Path) -> AsyncIterator[Native]:
    handlers = [Answers(n) for n in ("runtime", "peer", "python")]
    servers = [await serve(h) for h in handlers]
    (_, runtime_port), (_, peer_port), (_, python_port) = servers
    layout = Layout(
        listen=f"127.0.0.1:{free_port()}",
        python=f"127.0.0.1:{python_port}",
        runtime=f"127.0.0.1:{runtime_port}",
        api_socket=str(tmp_path / "api.sock"),
        methods_map=str(tmp_path / "m.map"),
        local_map=str(tmp_path / "l.map"),
        peers_map=str(tmp_path / "p.map"),
        vmodels_map=str(tmp_path / "v.map"),
        peer_slots=1,
    )
    maps = [layout.methods_map, layout.local_map, layout.peers_map, layout.vmodels_map]
    haproxy = HAProxy(haproxy_path, render(layout), tmp_path, maps, layout.api_socket)
    await haproxy.start()
    try:
        peer = f"{PEER_BACKEND}0/peer"
        await haproxy.commands(
            [
                f"add map {layout.methods_map} {PREDICT} {PLAIN}",
                f"add map {layout.local_map} here 1",
                f"add map {layout.peers_map} there {PEER_BACKEND}0",
                f"set server {peer} addr 127.0.0.1 port {peer_port}",
                f"set server {peer} state ready",
            ]
        )
        yield Native(haproxy, int(layout.listen.rpartition(":")[2]), *handlers)
    finally:
        await haproxy.stop()
        for server, _ in servers:
            await server.stop(None)


async def test_haproxy_counts_client_arrivals_carried_natively_not_hops_nor_the_python_paths(
    native: Native,
) -> None:
    assert await native.call("here") == b"runtime"
    assert await native.call("here") == b"runtime"
    assert await native.call("here", hop=True) == b"runtime"  # a peer's native hop: counted there
    assert await native.call("there") == b"peer"
    assert await native.call("elsewhere") == b"python"  # the Python path counts it (Router)
    assert native.runtime.models == ["here"] * 3 and native.peer.models == ["there"]
    arrived = parse_table(await native.haproxy.command(f"show table {ARRIVALS_TABLE}"))
    assert {m: r.requests for m, r in arrived.items()} == {"here": 2, "there": 1}
    carried = parse_table(await native.haproxy.command(f"show table {COUNTERS_TABLE}"))
    assert {m: r.requests for m, r in carried.items()} == {"here": 3}  # uses of the local copy: hops too


@dataclasses.dataclass
class Tables:
    """HAProxy's runtime API as the plane's poll reads it: the two tables' dumps."""

    rows: dict[str, dict[str, int]]
    running: bool = True

    async def command(self, command: str) -> str:
        table = command.removeprefix("show table ")
        return "".join(
            f"0x{i:x}: key={m} use=0 exp=86399000 conn_cur=0 http_req_cnt={n}\n"
            for i, (m, n) in enumerate(self.rows.get(table, {}).items(), start=1)
        )


async def test_the_plane_hands_new_native_arrivals_to_the_load_queues_popularity() -> None:
    store = MemoryStore()
    models = Table(store, "/t/registry/", ModelRecord.decode, ModelRecord.encode)
    vmodels = Table(store, "/t/vmodels/", VModelRecord.decode, VModelRecord.encode)
    runtime = FakeRuntime()
    local = LocalModels(
        "me",
        Registry(models, vmodels),
        runtime,
        runtime_info(),
        failure_expiry_ms=900_000,  # type: ignore[arg-type]
    )
    tables = Tables({COUNTERS_TABLE: {"here": 3}, ARRIVALS_TABLE: {"here": 2, "there": 1}})
    plane = NativePlane(
        tables,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        local,
        models,
        vmodels,
        lambda: None,  # type: ignore[arg-type, return-value]
        dict,
        10_000,
        lambda: 1_000,
    )
    try:
        local.popularity.count("here")  # one request the Python path counted
        await plane.poll_counters()
        assert local.popularity.of("here") == 3 and local.popularity.of("there") == 1
        assert plane.counts.carried == 3
        tables.rows[ARRIVALS_TABLE] = {"here": 4, "there": 1}
        await plane.poll_counters()  # only what arrived since the last poll
        assert local.popularity.of("here") == 5 and local.popularity.of("there") == 1
    finally:
        await local.close(deregister=False)
        await store.close()
