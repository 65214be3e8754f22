"""Upstream's HTTP probe and pre-stop endpoints, on the ports a modelmesh-serving pod expects.

    MM_PROBE_PORT (8089)          GET /live    200 while the process runs its event loop
                                  GET /ready   200 once the instance serves, 503 before and
                                               from the moment it starts stopping
    MM_PRESTOP_WAIT_PORT (8090)   GET /prestop starts the shutdown (the same entry SIGTERM
                                               uses: drain, then stop) and answers once the
                                               instance has stopped; a second call waits too

The controller's Deployment polls `/ready` and `/live` on 8089 (readiness and liveness of the
`mm` container) and the runtime containers' preStop hooks call `:8090/prestop`, so the
daemon starts handing its models away before their runtime is stopped (upstream's
`ModelMesh` probe server and prestop server; paths and ports are upstream's). Both servers
start before anything else: liveness must answer while start-up waits for etcd and the
runtime (upstream polls the runtime for up to 3 minutes; the probe's first check is at 90 s).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

from aiohttp import web

from meshd.net.listen import bound_socket, describe

log = logging.getLogger(__name__)

UPSTREAM_PROBE_PORT = 8089  # MM_PROBE_PORT: upstream's litelinks health probe port
UPSTREAM_PRESTOP_PORT = 8090  # MM_PRESTOP_WAIT_PORT: upstream's pre-stop server


class ProbeServer:
    """`/live` and `/ready` on one port, `/prestop` on another (or the same when equal)."""

    def __init__(
        self,
        host: str | None,  # None: every address, both families (meshd.net.listen)
        probe_port: int | None,
        prestop_port: int | None,
        ready: Callable[[], bool],
        prestop: Callable[[], Awaitable[None]],
    ) -> None:
        self.host = host
        self.probe_port = probe_port
        self.prestop_port = prestop_port
        self.ready = ready
        self.prestop = prestop  # starts the shutdown; returns once the instance has stopped
        self.runners: list[web.AppRunner] = []
        self.bound: dict[str, int] = {}

    async def _live(self, request: web.Request) -> web.Response:
        return web.Response(text="OK\n")

    async def _ready(self, request: web.Request) -> web.Response:
        if self.ready():
            return web.Response(text="READY\n")
        return web.Response(status=503, text="NOT READY\n")

    async def _prestop(self, request: web.Request) -> web.Response:
        log.info("pre-stop hook called: shutting down")
        # Shielded: the caller hanging up (its hook timed out) must not cancel the shutdown.
        await asyncio.shield(self.prestop())
        # The pid, so `meshd stop wait` can also wait for the process to end: the kubelet's
        # SIGTERM follows the hook at once, and one landing before the exit ends it as Error/143.
        return web.Response(text=f"STOPPED {os.getpid()}\n")

    async def start(self) -> None:
        """Listen (OSError naming the port when it is taken)."""
        probes = [web.get("/live", self._live), web.get("/ready", self._ready)]
        prestop = [web.get("/prestop", self._prestop)]
        servers: list[tuple[int, list[web.RouteDef]]] = []
        if self.probe_port is not None and self.probe_port == self.prestop_port and self.probe_port != 0:
            servers.append((self.probe_port, probes + prestop))  # one port asked for both
        else:
            if self.probe_port is not None:
                servers.append((self.probe_port, probes))
            if self.prestop_port is not None:
                servers.append((self.prestop_port, prestop))
        for port, defs in servers:
            app = web.Application()
            app.add_routes(defs)
            runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
            await runner.setup()
            self.runners.append(runner)
            try:
                await web.SockSite(runner, bound_socket(self.host, port)).start()
            except OSError as e:
                await self.stop()
                raise OSError(
                    e.errno, f"cannot listen for probes on {describe(self.host, port)}: {e.strerror}"
                ) from None
            bound = int(runner.addresses[0][1])
            for d in defs:
                self.bound[str(getattr(d, "path", ""))] = bound

    def port_of(self, path: str) -> int | None:
        """The bound port serving `path` (tests pass port 0)."""
        return self.bound.get(path)

    async def stop(self) -> None:
        for runner in self.runners:
            await runner.cleanup()
        self.runners.clear()
