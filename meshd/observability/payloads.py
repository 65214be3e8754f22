"""Payload logging (upstream's `MM_PAYLOAD_PROCESSORS`): inference requests and responses
handed to a logger or POSTed to an HTTP endpoint, off the request path.

`MM_PAYLOAD_PROCESSORS` is a space-separated list of URIs:

    logger://           every payload as one INFO record on the `meshd.payloads` logger
    logger://<modelId>  only payloads of that model
    http://host:port/path, https://...   every payload POSTed there as JSON

Each payload is upstream's JSON object: `{"id", "modelid", "vModelId", "data" (base64),
"kind" ("request" | "response"), "status" (the gRPC code name, responses), "metadata"
(the request's headers, `mm-*` included; binary ones left out)}`. A request and its response
share `id`.

Asynchronous and bounded: the request path only puts a record on a queue of
`MM_PAYLOAD_PROCESSORS_CAPACITY` (upstream's default 64) records; when the queue is full the
record is dropped and counted (`meshd_payloads_dropped` on /metrics, and a warning at most
once a minute), so a slow or dead endpoint never slows inference. Senders
(`MM_PAYLOAD_PROCESSORS_THREADS`, default 2) take records off the queue. Unary calls only:
streamed calls (ModelStreamInfer) are not recorded.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import aiohttp

from meshd.observability.metrics import NO_METRICS, Metrics

log = logging.getLogger("meshd.payloads")
internal_log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 64  # upstream MM_PAYLOAD_PROCESSORS_CAPACITY
DEFAULT_SENDERS = 2  # upstream MM_PAYLOAD_PROCESSORS_THREADS
POST_TIMEOUT_S = 10.0
DROP_WARN_EVERY_S = 60.0


@dataclass(frozen=True, slots=True)
class Processor:
    kind: str  # "logger" | "http"
    target: str  # the URL (http), or a model id to keep ("" for all; logger)


def parse_processors(text: str) -> tuple[Processor, ...]:
    """The URIs of `MM_PAYLOAD_PROCESSORS`; ValueError names a bad one."""
    out: list[Processor] = []
    for uri in text.split():
        parsed = urlparse(uri)
        if parsed.scheme == "logger":
            model = (parsed.netloc + parsed.path).strip("/")
            out.append(Processor("logger", "" if model in ("", "*") else model))
        elif parsed.scheme in ("http", "https"):
            if not parsed.hostname:
                raise ValueError(f"payload processor {uri!r} has no host")
            out.append(Processor("http", uri))
        else:
            raise ValueError(f"payload processor {uri!r}: expected logger://... or http(s)://...")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Payload:
    id: str
    model_id: str
    vmodel_id: str
    data: bytes
    kind: str  # "request" | "response"
    status: str  # gRPC code name ("" for a request)
    metadata: tuple[tuple[str, str], ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "modelid": self.model_id,
            "vModelId": self.vmodel_id or None,
            "data": base64.b64encode(self.data).decode("ascii"),
            "kind": self.kind,
            "status": self.status or None,
            "metadata": dict(self.metadata),
        }


class PayloadProcessors:
    """The queue and its senders; `submit` never blocks."""

    def __init__(
        self,
        processors: Iterable[Processor],
        capacity: int = DEFAULT_CAPACITY,
        senders: int = DEFAULT_SENDERS,
        metrics: Metrics = NO_METRICS,
    ) -> None:
        self.processors = tuple(processors)
        self.queue: asyncio.Queue[Payload] = asyncio.Queue(maxsize=max(capacity, 1))
        self.senders = max(senders, 1)
        self.metrics = metrics
        self.dropped = 0
        self.sent = 0
        self.failed = 0
        self._last_drop_warning = 0.0
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None

    def submit(self, payload: Payload) -> None:
        try:
            self.queue.put_nowait(payload)
        except asyncio.QueueFull:
            self.dropped += 1
            self.metrics.payloads_dropped()
            now = time.monotonic()
            if now - self._last_drop_warning >= DROP_WARN_EVERY_S:
                self._last_drop_warning = now
                internal_log.warning("payload queue full: %d payload records dropped so far", self.dropped)

    async def start(self) -> None:
        if any(p.kind == "http" for p in self.processors):
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=POST_TIMEOUT_S))
        for i in range(self.senders):
            self._tasks.append(asyncio.create_task(self._run(), name=f"payload sender {i}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()

    async def _run(self) -> None:
        while True:
            payload = await self.queue.get()
            for p in self.processors:
                try:
                    await self._send(p, payload)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    self.failed += 1
                    internal_log.debug("payload processor %s failed: %s", p.target, e)

    async def _send(self, p: Processor, payload: Payload) -> None:
        if p.kind == "logger":
            if p.target and p.target != payload.model_id:
                return
            log.info("payload %s", json.dumps(payload.to_json(), separators=(",", ":")))
            self.sent += 1
            return
        assert self._session is not None
        async with self._session.post(p.target, json=payload.to_json()) as resp:
            if resp.status >= 300:
                raise RuntimeError(f"HTTP {resp.status}")
        self.sent += 1


def text_headers(metadata: Iterable[tuple[str, str | bytes]] | None) -> tuple[tuple[str, str], ...]:
    """Request headers as text (binary `-bin` values and transport headers left out)."""
    if not metadata:
        return ()
    with contextlib.suppress(Exception):
        return tuple((k, v) for k, v in metadata if isinstance(v, str) and not k.startswith(":"))
    return ()
