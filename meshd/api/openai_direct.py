"""A warm local copy's OpenAI answer streamed by meshd from the engine itself (issue 43).

The router still decides everything (which copy, loads, limits, metrics); only the bytes of
a copy beside this instance skip the llm-runtime's gRPC relay, so each piece crosses one
Python process, not two. The runtime is asked once per copy where its engine listens
(`HttpCall.where`), then the request goes to that port. Whatever the engine has queued is
read and written at once (pieces coalesced into one write, the first sent as soon as it
comes).

Anything that fails before the first piece of the answer (the engine gone, restarting on
another port, refusing the connection) is handed back to the runtime's relay, which meets
the same trouble and answers as it always did (rerouted, or 503 "restarting"): nothing has
reached the client yet. An engine that breaks off after that ends the call UNAVAILABLE,
which the front turns into one error event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp

from meshd._proto.meshd import llm_pb2
from meshd.core.errors import Unavailable
from meshd.decisions.cache import CacheEntry
from meshd.serving.router import Answered, DirectOpen

JSON_HEADERS = {"Content-Type": "application/json"}
# As the runtime's relay (adapter.llm.calls): connect at once; a silence this long between two
# pieces (prefill included) ends the call.
ENGINE_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=300)


class EngineStreams:
    """meshd's client to the engines of its own runtime: their addresses, one connection pool."""

    def __init__(self) -> None:
        self._where: dict[str, tuple[CacheEntry, str]] = {}  # model id -> (its copy, engine URL)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return self._session

    def opener(self, call: llm_pb2.HttpCall) -> DirectOpen:
        """How the router opens `call` on a local copy: at its engine."""

        async def direct(
            entry: CacheEntry, model_id: str, ask: Callable[[bytes], Awaitable[bytes | None]]
        ) -> Answered | None:
            url = await self._url(entry, model_id, ask)
            if url is None:
                return None
            body = call.body
            if not (call.body_names_model and call.model_id == model_id):
                parsed = json.loads(body)  # checked by the front: a JSON object
                parsed["model"] = model_id  # the engine's name for it
                body = json.dumps(parsed).encode()
            try:
                response = await self._http().post(
                    url + call.path, data=body, headers=JSON_HEADERS, timeout=ENGINE_TIMEOUT
                )
            except (aiohttp.ClientError, OSError):
                self._forget(model_id)
                return None
            try:
                first = await response.content.readany()  # after the prefill: its failure reroutes
            except (aiohttp.ClientError, OSError):
                response.close()
                self._forget(model_id)
                return None
            head = llm_pb2.HttpChunk(
                status=response.status, content_type=response.headers.get("Content-Type", ""), data=first
            )
            return Answered(head.SerializeToString(), self._rest(response, model_id), _Done(response), raw=True)

        return direct

    async def _url(
        self, entry: CacheEntry, model_id: str, ask: Callable[[bytes], Awaitable[bytes | None]]
    ) -> str | None:
        known = self._where.get(model_id)
        if known is not None and known[0] is entry:
            return known[1]
        # No path: a runtime that does not know `where` refuses it, calling no engine.
        answer = await ask(llm_pb2.HttpCall(model_id=model_id, where=True).SerializeToString())
        url = llm_pb2.HttpChunk.FromString(answer).engine_url if answer else ""
        if not url:  # a runtime that does not know `where`, or refused: it relays this call
            return None
        self._where[model_id] = (entry, url)
        return url

    def _forget(self, model_id: str) -> None:
        self._where.pop(model_id, None)

    async def _rest(self, response: aiohttp.ClientResponse, model_id: str) -> AsyncIterator[bytes]:
        try:
            async for data in response.content.iter_any():  # all that has come: one write
                yield data
        except (aiohttp.ClientError, OSError) as e:
            self._forget(model_id)
            raise Unavailable(f"the engine of model {model_id!r} broke off its answer ({type(e).__name__})") from None


class _Done:
    """The engine's response, done with: its connection kept for the next call when the
    answer was read to its end, else closed (the engine sees the client go)."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response

    def close(self) -> None:
        if self.response.content.at_eof():
            self.response.release()
        else:
            self.response.close()
