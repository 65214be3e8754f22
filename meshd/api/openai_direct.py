"""A warm local copy's OpenAI answer streamed by meshd from the engine itself (issue 43).

The router still decides everything (which copy, loads, limits, metrics); only the bytes of
a copy beside this instance skip the llm-runtime's gRPC relay, so each piece crosses one
Python process, not two. The runtime is asked once per copy where its engine listens
(`HttpCall.where`), then the request goes to that port on a connection of its own.

The answer is spliced: each read from the engine's socket (whatever it has queued: pieces
coalesced) is written to the client's socket from the read's own callback, in one chunk, with
no task switch, no per-piece timer and no stream buffer between them (aiohttp's client spent
about half of meshd's CPU per piece on those; bench/llm_relay.py). The first piece goes out
as soon as it comes.

Anything that fails before the first piece of the answer (the engine gone, restarting on
another port, refusing the connection) is handed back to the runtime's relay, which meets
the same trouble and answers as it always did (rerouted, or 503 "restarting"): nothing has
reached the client yet. An engine that breaks off after that ends the call UNAVAILABLE,
which the front turns into one error event.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit

from meshd._proto.meshd import llm_pb2
from meshd.core.errors import Unavailable
from meshd.decisions.cache import CacheEntry
from meshd.serving.router import Answered, DirectOpen, Sink

# As the runtime's relay (adapter.llm.calls): connect at once; a silence this long between two
# pieces (prefill included) ends the call.
CONNECT_TIMEOUT_S = 10.0
SILENCE_S = 300.0
HEAD_LIMIT = 64 << 10  # an engine's status line and headers
# The client reads slower than the engine writes: stop reading the engine above this much
# unsent to the client, and look again shortly.
CLIENT_BACKLOG = 1 << 20
RESUME_CHECK_S = 0.005


class EngineBroke(Exception):
    """The engine's answer ended before it was whole."""


class EngineStreams:
    """meshd's client to the engines of its own runtime: where each listens."""

    def __init__(self) -> None:
        self._where: dict[str, tuple[CacheEntry, str, int]] = {}  # model id -> (its copy, host, port)

    async def close(self) -> None:
        self._where.clear()

    def opener(self, call: llm_pb2.HttpCall) -> DirectOpen:
        """How the router opens `call` on a local copy: at its engine."""

        async def direct(
            entry: CacheEntry, model_id: str, ask: Callable[[bytes], Awaitable[bytes | None]]
        ) -> Answered | None:
            where = await self._address(entry, model_id, ask)
            if where is None:
                return None
            body = call.body
            if not (call.body_names_model and call.model_id == model_id):
                parsed = json.loads(body)  # checked by the front: a JSON object
                parsed["model"] = model_id  # the engine's name for it
                body = json.dumps(parsed).encode()
            host, port = where
            request = (
                f"POST {call.path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode() + body
            loop = asyncio.get_running_loop()
            try:
                _, engine = await asyncio.wait_for(
                    loop.create_connection(lambda: _EngineCall(request), host, port), CONNECT_TIMEOUT_S
                )
            except (OSError, TimeoutError):
                self._where.pop(model_id, None)
                return None
            try:
                status, content_type, first = await engine.head  # after the prefill: its failure reroutes
            except EngineBroke:
                engine.close()
                self._where.pop(model_id, None)
                return None
            except BaseException:  # the call's timeout, or the client gone: the engine stops too
                engine.close()
                raise
            head = llm_pb2.HttpChunk(status=status, content_type=content_type, data=first)
            return Answered(head.SerializeToString(), _nothing(), engine, splice=self._splice(engine, model_id))

        return direct

    def _splice(self, engine: _EngineCall, model_id: str) -> Callable[[Sink], Awaitable[None]]:
        async def splice(sink: Sink) -> None:
            try:
                await engine.splice(sink)
            except EngineBroke as e:
                self._where.pop(model_id, None)  # asked again next time: it may be back elsewhere
                raise Unavailable(f"the engine of model {model_id!r} broke off its answer ({e})") from None

        return splice

    async def _address(
        self, entry: CacheEntry, model_id: str, ask: Callable[[bytes], Awaitable[bytes | None]]
    ) -> tuple[str, int] | None:
        known = self._where.get(model_id)
        if known is not None and known[0] is entry:
            return known[1], known[2]
        # No path: a runtime that does not know `where` refuses it, calling no engine.
        answer = await ask(llm_pb2.HttpCall(model_id=model_id, where=True).SerializeToString())
        url = urlsplit(llm_pb2.HttpChunk.FromString(answer).engine_url if answer else "")
        if url.scheme != "http" or not url.hostname or not url.port:  # refused, or an older runtime
            return None
        self._where[model_id] = (entry, url.hostname, url.port)
        return url.hostname, url.port


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield b""  # an async generator with nothing in it: a spliced answer has no messages


class _EngineCall(asyncio.Protocol):
    """One HTTP/1.1 request to an engine on a connection of its own; its answer's body is
    handed on from `data_received` itself (to `sink`: the payload of one read, as segments)."""

    def __init__(self, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.request = request
        self.transport: asyncio.Transport | None = None
        self.head: asyncio.Future[tuple[int, str, bytes]] = loop.create_future()
        self.ended: asyncio.Future[None] = loop.create_future()
        self.status = 0  # 0 until the head is read
        self.content_type = ""
        self.buffer = b""  # the head until whole, then body bytes read before the sink came
        self.sink: Sink | None = None
        self.chunked = False
        self.length: int | None = None  # body bytes still to come (Content-Length), else None
        self.left = 0  # of the current chunk's payload
        self.skip = 0  # of the CRLF after a chunk
        self.line = b""  # a chunk-size line split across reads
        self.whole = False
        self.paused = False
        self.last = loop.time()
        self.watch: asyncio.TimerHandle | None = None

    # ---- the connection -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP transport (uvloop's too)
        transport.write(self.request)  # type: ignore[attr-defined]
        self.watch = self.loop.call_later(SILENCE_S, self._silence)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.watch is not None:
            self.watch.cancel()
        if self.status and not self.chunked and self.length is None:
            self.whole = True  # a body delimited by the connection's end
            if not self.head.done():
                self.head.set_result((self.status, self.content_type, b""))
        why = EngineBroke(f"its connection ended mid-answer ({exc or 'EOF'})")
        if not self.head.done():
            self.head.set_exception(why)
        self._end(None if self.whole else why)

    def close(self) -> None:
        """Done with the answer (whole, or the client gone): the connection goes."""
        if not self.ended.done():
            self.ended.cancel()  # nobody waits for it any more
        if self.transport is not None:
            self.transport.close()
        if self.watch is not None:
            self.watch.cancel()

    def _silence(self) -> None:
        idle = self.loop.time() - self.last
        if idle >= SILENCE_S:
            self._fail(EngineBroke(f"no answer for {SILENCE_S:g} s"))
        else:
            self.watch = self.loop.call_later(SILENCE_S - idle, self._silence)

    def _fail(self, e: BaseException) -> None:
        if not self.head.done():
            self.head.set_exception(e)
        self._end(e)
        if self.transport is not None:
            self.transport.abort()

    def _end(self, e: BaseException | None) -> None:
        if not self.ended.done():
            if e is None:
                self.ended.set_result(None)
            else:
                self.ended.set_exception(e)

    # ---- the answer -----------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self.last = self.loop.time()
        if not self.status:
            self.buffer += data
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > HEAD_LIMIT:
                    self._fail(EngineBroke("an answer head over 64 KiB"))
                return
            try:
                self._parse_head(self.buffer[:end])
            except (ValueError, IndexError) as e:
                self._fail(EngineBroke(f"not an HTTP answer: {e}"))
                return
            data, self.buffer = self.buffer[end + 4 :], b""
        try:
            segments = self._payload(data)
        except ValueError as e:
            self._fail(EngineBroke(f"a broken chunk: {e}"))
            return
        if not self.head.done():
            first = b"".join(segments)
            if first or self.whole:  # the first piece of the answer is what rerouting waits for
                self.head.set_result((self.status, self.content_type, first))
        elif segments:
            if self.sink is None:
                self.buffer += b"".join(segments)
            elif not self.sink.write(segments):
                self._fail(ConnectionResetError("the client went away"))
                return
            elif not self.paused and self.sink.backlog() > CLIENT_BACKLOG:
                self._pause()
        if self.whole:
            self._end(None)

    def _pause(self) -> None:
        assert self.transport is not None
        self.paused = True
        self.transport.pause_reading()
        self.loop.call_later(RESUME_CHECK_S, self._resume)

    def _resume(self) -> None:
        if self.transport is None or self.transport.is_closing() or self.sink is None:
            return
        if self.sink.backlog() > CLIENT_BACKLOG // 2:
            self.loop.call_later(RESUME_CHECK_S, self._resume)
            return
        self.paused = False
        self.transport.resume_reading()

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip()
            if name == "content-type":
                self.content_type = value
            elif name == "transfer-encoding" and "chunked" in value.lower():
                self.chunked = True
            elif name == "content-length":
                self.length = int(value)
        if self.chunked:
            self.length = None
        elif self.length == 0 or status in (204, 304):
            self.whole = True
        self.status = status

    def _payload(self, data: bytes) -> list[bytes]:
        """The answer's own bytes in `data` (chunk framing taken off); sets `whole` at its end."""
        if not self.chunked:
            if self.length is not None:
                data = data[: self.length]
                self.length -= len(data)
                if self.length == 0:
                    self.whole = True
            return [data] if data else []
        out: list[bytes] = []
        i, n = 0, len(data)
        while i < n and not self.whole:
            if self.left:
                take = min(self.left, n - i)
                out.append(data[i : i + take] if take < n else data)
                i += take
                self.left -= take
                if not self.left:
                    self.skip = 2
            elif self.skip:
                take = min(self.skip, n - i)
                i += take
                self.skip -= take
            else:
                j = data.find(b"\n", i)
                if j < 0:
                    self.line += data[i:]
                    break
                line, self.line = self.line + data[i:j], b""
                i = j + 1
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    self.whole = True  # trailers, if any, are not read: the connection goes
                else:
                    self.left = size
        return out

    async def splice(self, sink: Sink) -> None:
        """Hand the rest of the answer to `sink` as it comes; returns once it is whole."""
        if self.buffer:
            if not sink.write([self.buffer]):
                raise ConnectionResetError("the client went away")
            self.buffer = b""
        self.sink = sink
        await self.ended
