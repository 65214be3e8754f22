"""A warm local copy's OpenAI answer streamed by meshd from the engine itself (issue 43).

The router still decides everything (which copy, loads, limits, metrics); only the bytes of
a copy beside this instance skip the llm-runtime's gRPC relay, so each piece crosses one
Python process, not two. The runtime is asked once per copy where its engine listens
(`HttpCall.where`), then the request goes to that port on a connection kept open between
calls (HTTP/1.1 keep-alive, as a browser's: no connect and no accept per call, and the request
is written at once). A kept connection the engine closed meanwhile is replaced by a new one.

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
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit

from meshd._proto.meshd import llm_pb2
from meshd.core.errors import Unavailable
from meshd.core.hostport import join as host_port
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
# Idle connections kept per engine: as many as calls were in flight at once, up to this (each
# holds a descriptor here and one in the engine; uvicorn, vLLM's server, closes them after 5 s).
IDLE_PER_ENGINE = 1024
# The runtime is asked where an engine listens again this often while calls come, beside them:
# its answer carries the engine's load (queue, KV cache), read at most this often
# (adapter.llm.load.READ_EVERY_S), for routing and for adding copies when queues stay deep.
ASK_AGAIN_S = 0.25


class EngineBroke(Exception):
    """The engine's answer ended before it was whole."""


class EngineStreams:
    """meshd's client to the engines of its own runtime: where each listens."""

    def __init__(self) -> None:
        # model id -> (its copy, host, port, time.monotonic() the runtime was asked)
        self._where: dict[str, tuple[CacheEntry, str, int, float]] = {}
        self._asking: dict[str, asyncio.Task[None]] = {}  # model id -> asked again now
        self._idle: dict[tuple[str, int], dict[_EngineConnection, None]] = {}  # (host, port) -> kept connections

    async def close(self) -> None:
        self._where.clear()
        for task in list(self._asking.values()):
            task.cancel()
        for idle in list(self._idle.values()):
            for connection in list(idle):
                connection.close()
        self._idle.clear()

    def _keep(self, connection: _EngineConnection) -> bool:
        """Keep a connection whose answer came whole for the next call (False: it is full)."""
        idle = self._idle.setdefault(connection.address, {})
        if len(idle) >= IDLE_PER_ENGINE:
            return False
        idle[connection] = None
        return True

    def _forget(self, connection: _EngineConnection) -> None:
        idle = self._idle.get(connection.address)
        if idle is not None:
            idle.pop(connection, None)

    def _kept(self, address: tuple[str, int]) -> _EngineConnection | None:
        idle = self._idle.get(address)
        while idle:
            connection = idle.popitem()[0]  # the last kept: the least likely to have timed out
            if connection.transport is not None and not connection.transport.is_closing():
                return connection
            connection.close()
        return None

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
                f"POST {call.path} HTTP/1.1\r\nHost: {host_port(host, port)}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode() + body
            engine = self._kept(where)
            while True:
                kept = engine is not None
                if engine is None:
                    try:
                        engine = await self._connect(where)
                    except (OSError, TimeoutError):
                        self._where.pop(model_id, None)
                        return None
                engine.send(request)
                try:
                    status, content_type, first = await engine.head  # after the prefill: its failure reroutes
                    break
                except EngineBroke:
                    engine.close()
                    if kept and not engine.heard:  # closed by the engine while kept: try a new connection
                        engine = None
                        continue
                    self._where.pop(model_id, None)
                    return None
                except BaseException:  # the call's timeout, or the client gone: the engine stops too
                    engine.close()
                    raise
            head = llm_pb2.HttpChunk(status=status, content_type=content_type, data=first)
            return Answered(head.SerializeToString(), _nothing(), engine, splice=self._splice(engine, model_id))

        return direct

    async def _connect(self, address: tuple[str, int]) -> _EngineConnection:
        loop = asyncio.get_running_loop()
        _, engine = await asyncio.wait_for(
            loop.create_connection(lambda: _EngineConnection(address, self._keep, self._forget), *address),
            CONNECT_TIMEOUT_S,
        )
        return engine

    def _splice(self, engine: _EngineConnection, model_id: str) -> Callable[[Sink], Awaitable[None]]:
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
            if time.monotonic() - known[3] >= ASK_AGAIN_S and model_id not in self._asking:
                # Asked again beside the call, not before it: the answer brings the engine's load.
                self._asking[model_id] = asyncio.create_task(self._ask_again(entry, model_id, ask))
            return known[1], known[2]
        return await self._ask(entry, model_id, ask)

    async def _ask(
        self, entry: CacheEntry, model_id: str, ask: Callable[[bytes], Awaitable[bytes | None]]
    ) -> tuple[str, int] | None:
        # No path: a runtime that does not know `where` refuses it, calling no engine.
        answer = await ask(llm_pb2.HttpCall(model_id=model_id, where=True).SerializeToString())
        url = urlsplit(llm_pb2.HttpChunk.FromString(answer).engine_url if answer else "")
        if url.scheme != "http" or not url.hostname or not url.port:  # refused, or an older runtime
            return None
        self._where[model_id] = (entry, url.hostname, url.port, time.monotonic())
        return url.hostname, url.port

    async def _ask_again(
        self, entry: CacheEntry, model_id: str, ask: Callable[[bytes], Awaitable[bytes | None]]
    ) -> None:
        try:
            await self._ask(entry, model_id, ask)  # refused: the address known stays (a call finds it gone)
        except Exception:  # the call's deadline, say: asked again with the next call
            pass
        finally:
            self._asking.pop(model_id, None)


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield b""  # an async generator with nothing in it: a spliced answer has no messages


class _EngineConnection(asyncio.Protocol):
    """One HTTP/1.1 connection to an engine, one request at a time (`send`); its answer's body
    is handed on from `data_received` itself (to `sink`: the payload of one read, as segments).
    `close()` when done with an answer: a whole one leaves the connection kept (`keep`) for the
    next call, anything else closes it."""

    def __init__(
        self,
        address: tuple[str, int],
        keep: Callable[[_EngineConnection], bool],
        forget: Callable[[_EngineConnection], None],
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.address = address
        self.keep = keep
        self.forget = forget
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.idle = False  # kept between calls
        self.watch: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        """The state of one answer."""
        loop = self.loop
        self.head: asyncio.Future[tuple[int, str, bytes]] = loop.create_future()
        self.ended: asyncio.Future[None] = loop.create_future()
        self.status = 0  # 0 until the head is read
        self.content_type = ""
        self.reusable = False  # HTTP/1.1, not `Connection: close`
        self.heard = False  # any byte of this answer came
        self.buffer = b""  # the head until whole, then body bytes read before the sink came
        self.sink: Sink | None = None
        self.chunked = False
        self.length: int | None = None  # body bytes still to come (Content-Length), else None
        self.left = 0  # of the current chunk's payload
        self.skip = 0  # of the CRLF after a chunk
        self.line = b""  # a chunk-size or trailer line split across reads
        self.trailer = False  # past the last chunk: trailer lines until an empty one
        self.whole = False
        self.paused = False
        self.last = loop.time()

    # ---- the connection -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP transport (uvloop's too)

    def send(self, request: bytes) -> None:
        """Start a call on this connection (new, or kept and idle)."""
        assert self.transport is not None
        if self.idle:
            self.idle = False
            self._reset()
        self.transport.write(request)
        self.watch = self.loop.call_later(SILENCE_S, self._silence)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.idle:
            self.forget(self)
            return
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
        """Done with the answer (whole, or the client gone): the connection is kept for the
        next call if the answer came whole, else it goes (an engine stops a call whose
        connection closes)."""
        if self.idle:
            return
        if not self.ended.done():
            self.ended.cancel()  # nobody waits for it any more
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None
        if self.transport is None:
            return
        if (
            self.whole
            and self.reusable
            and not self.lost
            and not self.paused
            and not self.transport.is_closing()
            and self.keep(self)
        ):
            self.idle = True
            self.sink = None
            return
        self.transport.close()

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
        if self.idle or self.whole:  # nothing is asked: not an answer to keep the connection for
            self.forget(self)
            self.idle = False
            self.reusable = False
            if self.transport is not None:
                self.transport.close()
            return
        self.heard = True
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
        version, status_text = lines[0].split(" ", 2)[:2]
        status = int(status_text)
        self.reusable = version == "HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip()
            if name == "content-type":
                self.content_type = value
            elif name == "transfer-encoding" and "chunked" in value.lower():
                self.chunked = True
            elif name == "content-length":
                self.length = int(value)
            elif name == "connection" and "close" in value.lower():
                self.reusable = False
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
                if self.trailer:
                    self.whole = not line.strip()  # the empty line that ends the answer
                    continue
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    self.trailer = True
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
