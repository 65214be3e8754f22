"""Upstream's HTTP probe and pre-stop endpoints (meshd.api.probes), over real loopback HTTP."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from meshd.api.probes import ProbeServer
from meshd.net.listen import ipv6_available


async def test_ready_follows_the_instance_and_prestop_waits_for_the_stop() -> None:
    ready = False
    stopped = asyncio.Event()
    called = asyncio.Event()
    prestops = 0

    async def prestop() -> None:
        nonlocal prestops, ready
        prestops += 1
        ready = False
        called.set()
        await stopped.wait()

    server = ProbeServer("127.0.0.1", 0, 0, lambda: ready, prestop)
    await server.start()
    probe, pre = server.port_of("/ready"), server.port_of("/prestop")
    assert probe and pre and server.port_of("/live") == probe
    try:
        async with aiohttp.ClientSession() as http:

            async def get(port: int | None, path: str) -> int:
                async with http.get(f"http://127.0.0.1:{port}{path}") as r:
                    return r.status

            assert await get(probe, "/live") == 200
            assert await get(probe, "/ready") == 503  # not serving yet
            ready = True
            assert await get(probe, "/ready") == 200
            assert await get(pre, "/ready") == 404  # separate ports, as upstream's
            call = asyncio.create_task(get(pre, "/prestop"))
            await asyncio.wait_for(called.wait(), 30)
            assert await get(probe, "/ready") == 503 and not call.done()  # draining: still waiting
            stopped.set()
            assert await call == 200 and prestops == 1
    finally:
        await server.stop()


@pytest.mark.skipif(not ipv6_available(), reason="no IPv6 on this host")
async def test_with_no_host_the_probes_answer_on_ipv6_and_ipv4() -> None:
    """The kubelet probes the pod IP, an IPv6 address on an IPv6-only cluster."""

    async def prestop() -> None:
        return None

    server = ProbeServer(None, 0, 0, lambda: True, prestop)
    await server.start()
    try:
        assert [len(r.addresses) for r in server.runners] == [1, 1]  # one dual-stack socket a port
        async with aiohttp.ClientSession() as http:
            for host in ("[::1]", "127.0.0.1"):
                async with http.get(f"http://{host}:{server.port_of('/ready')}/ready") as r:
                    assert r.status == 200, host
                async with http.get(f"http://{host}:{server.port_of('/live')}/live") as r:
                    assert r.status == 200, host
                async with http.get(f"http://{host}:{server.port_of('/prestop')}/prestop") as r:
                    assert r.status == 200, host
    finally:
        await server.stop()
