"""MM_PAYLOAD_PROCESSORS: parsing, the bounded queue, a logger, and a real HTTP receiver on loopback."""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web

from meshd.observability.metrics import MetricsConfig, build_metrics
from meshd.observability.payloads import Payload, PayloadProcessors, Processor, parse_processors


def test_parse_processors() -> None:
    assert parse_processors("") == ()
    got = parse_processors("logger:// logger://m1  http://127.0.0.1:9/p https://h/x")
    assert got == (
        Processor("logger", ""),
        Processor("logger", "m1"),
        Processor("http", "http://127.0.0.1:9/p"),
        Processor("http", "https://h/x"),
    )
    assert parse_processors("logger://*") == (Processor("logger", ""),)
    with pytest.raises(ValueError, match="ftp://x"):
        parse_processors("ftp://x")
    with pytest.raises(ValueError, match="no host"):
        parse_processors("http:///path")


async def _until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    async def poll() -> None:
        while not condition():  # noqa: ASYNC110 - the senders signal nothing; their counters are the state
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout_s)


def _payload(i: int, kind: str = "request") -> Payload:
    return Payload(
        f"id-{i}", "m1", "vm", b"\x00\x01" + bytes([i]), kind, "OK" if kind == "response" else "", (("a", "b"),)
    )


async def test_full_queue_drops_and_counts_instead_of_waiting() -> None:
    metrics = build_metrics(MetricsConfig())
    procs = PayloadProcessors([Processor("logger", "")], capacity=2, metrics=metrics)  # senders not started
    for i in range(5):
        procs.submit(_payload(i))  # never blocks
    assert procs.queue.qsize() == 2 and procs.dropped == 3
    assert b"meshd_payloads_dropped 3.0" in metrics.exposition()


async def test_http_processor_posts_upstreams_json_to_a_real_receiver(caplog: pytest.LogCaptureFixture) -> None:
    received: list[dict[str, Any]] = []
    got_all = asyncio.Event()

    async def receive(request: web.Request) -> web.Response:
        received.append(await request.json())
        if len(received) == 4:
            got_all.set()
        return web.Response(text="ok")

    app = web.Application()
    app.add_routes([web.post("/payloads", receive)])
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    procs = PayloadProcessors(parse_processors(f"http://127.0.0.1:{port}/payloads logger://m1"))
    await procs.start()
    try:
        with caplog.at_level(logging.INFO, logger="meshd.payloads"):
            for i, kind in ((1, "request"), (1, "response"), (2, "request"), (2, "response")):
                procs.submit(_payload(i, kind))
            await asyncio.wait_for(got_all.wait(), 30)
            await _until(lambda: procs.sent == 8)  # the logger's records too
    finally:
        await procs.stop()
        await runner.cleanup()
    first = received[0]
    assert first["id"] == "id-1" and first["modelid"] == "m1" and first["vModelId"] == "vm"
    assert first["kind"] == "request" and base64.b64decode(first["data"]) == b"\x00\x01\x01"
    assert first["metadata"] == {"a": "b"}
    assert {(r["id"], r["kind"]) for r in received} == {(f"id-{i}", k) for i in (1, 2) for k in ("request", "response")}
    assert [r["status"] for r in received if r["kind"] == "response"] == ["OK", "OK"]
    logged = [r.getMessage() for r in caplog.records if r.name == "meshd.payloads"]
    assert len(logged) == 4 and all('"modelid":"m1"' in m for m in logged)


async def test_a_dead_endpoint_neither_blocks_nor_stops_the_senders() -> None:
    procs = PayloadProcessors(parse_processors("http://127.0.0.1:1/nothing-listens"), capacity=4)
    await procs.start()
    try:
        for i in range(3):
            procs.submit(_payload(i))
        await _until(lambda: procs.failed == 3)
        assert procs.sent == 0 and procs.dropped == 0
    finally:
        await procs.stop()
