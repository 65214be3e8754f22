"""KServe V2 over HTTP/REST (a thin transport over KServeCore, on the instance's event loop).

Endpoints (KServe V2 REST protocol and its model-repository extension):

    GET  /v2/health/live                      200 {"live": true}
    GET  /v2/health/ready                     200 {"ready": true} | 503 while stopping
    GET  /v2                                  200 {"name", "version", "extensions"}
    GET  /v2/models/{name}[/versions/{v}]/ready   200 {"name", "ready": true} | 503 not loaded | 404 unknown
    POST /v2/repository/index                 body {"ready": bool} optional;
                                              200 [{"name", "version", "state", "reason"}]
    POST /v2/repository/models/{name}/load    200 {} once loaded somewhere in the mesh
    POST /v2/repository/models/{name}/unload  200 {} once every copy is unloaded
    POST /v2/models/{name}[/versions/{v}]/infer   KServe V2 inference (JSON, or the binary-data
                                              extension with Inference-Header-Content-Length),
                                              translated to one ModelInfer (api/kserve_json.py) and
                                              routed like a gRPC call: `mm-model-id` or
                                              `mm-vmodel-id` headers, else the model named in the path
    GET  /v2/models/{name}[/versions/{v}]     model metadata: one ModelMetadata, routed the same
                                              way (the model is loaded if it has no copy, as on gRPC)

Inference and metadata calls take their deadline from an `mm-timeout-ms` header (or the
OpenAI SDKs' `x-stainless-timeout`, seconds), else MESHD_REQUEST_TIMEOUT_MS: as a gRPC
deadline does, it bounds the call and tells the load queue how long the client will wait.

Either answers 501 when the runtime does not serve the gRPC method behind it. Errors are
`{"error": "..."}` with the HTTP status matching the core error's gRPC status. Model names
are path segments, percent-decoded (`%2F` for a `/` in an id). Versions are accepted and
ignored: meshd models have none. A request aiohttp cannot parse (a request line or header
over its 8190-byte limits, e.g. a 10,000-character model name in the path) is answered the
same way, 400 `{"error": ...}`, and logged as one line, not as an error with a traceback.
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler

from meshd._proto.inference import grpc_predict_v2_pb2 as pb
from meshd.api.kserve_core import KServeCore
from meshd.api.kserve_json import BadTensor, parse_infer_request, render_infer_response, render_metadata_response
from meshd.core.errors import InvalidArgument, MeshError
from meshd.decisions.ids import check_id
from meshd.decisions.openai import error_body as openai_error_body
from meshd.decisions.status import ModelStatus
from meshd.net.listen import bound_socket, describe
from meshd.serving.proxy.headers import RequestIds, http_timeout_s, parse_request_headers

log = logging.getLogger(__name__)

UPSTREAM_REST_PORT = 8008  # modelmesh-serving's REST proxy (kserve/rest-proxy) listens here
MAX_BODY_BYTES = 1 << 20  # repository calls carry tiny bodies; inference is bounded by max_body_bytes
HEADER_LENGTH = "Inference-Header-Content-Length"  # KServe V2 binary-data extension
BINARY_TYPE = "application/octet-stream"

# gRPC status of a core error -> HTTP status (the mapping grpc-gateway and KServe's rest-proxy use).
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# One serialized request (ModelInfer, ModelMetadata) routed to a copy of the model the ids
# name, within the call's deadline (seconds; None: none); its serialized response.
Infer = Callable[[bytes, RequestIds, float | None], Awaitable[bytes]]


def http_status(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class KServeHttp:
    def __init__(
        self,
        core: KServeCore,
        infer: Infer | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        model_metadata: Infer | None = None,
        more_routes: Callable[[web.Application], None] | None = None,
    ) -> None:
        """`infer`, `model_metadata`: where ModelInfer and ModelMetadata go (None: 501);
        `max_body_bytes`: the largest request; `more_routes`: adds other APIs' routes (OpenAI's)."""
        self.core = core
        self._infer = infer
        self._model_metadata = model_metadata
        self.max_body_bytes = max_body_bytes
        self.more_routes = more_routes

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors], client_max_size=max(self.max_body_bytes, MAX_BODY_BYTES))
        r = app.router
        r.add_get("/v2/health/live", self.live)
        r.add_get("/v2/health/ready", self.ready)
        r.add_get("/v2", self.metadata)
        r.add_get("/v2/models/{name}/ready", self.model_ready)
        r.add_get("/v2/models/{name}/versions/{version}/ready", self.model_ready)
        r.add_post("/v2/repository/index", self.index)
        r.add_post("/v2/repository/models/{name}/load", self.load)
        r.add_post("/v2/repository/models/{name}/unload", self.unload)
        for path in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
            r.add_get(path, self.model_metadata)
        for path in ("/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer"):
            r.add_post(path, self.infer)
        if self.more_routes is not None:
            self.more_routes(app)
        return app

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"live": self.core.live()})

    async def ready(self, request: web.Request) -> web.Response:
        if not self.core.ready():
            return web.json_response({"ready": False, "error": "meshd is stopping"}, status=503)
        return web.json_response({"ready": True})

    async def metadata(self, request: web.Request) -> web.Response:
        md = self.core.metadata()
        return web.json_response({"name": md.name, "version": md.version, "extensions": list(md.extensions)})

    async def model_ready(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        h = request.headers
        status = await self.core.model_status(name, h.get("mm-model-id", ""), h.get("mm-vmodel-id", ""))
        if status == ModelStatus.NOT_FOUND:
            return error(404, f"model {name!r} not found")
        if status != ModelStatus.LOADED:
            return web.json_response(
                {"name": name, "ready": False, "error": f"model {name!r} is not loaded ({status.name})"}, status=503
            )
        return web.json_response({"name": name, "ready": True})

    async def index(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            return error(400, f"'ready' must be true or false, not {json.dumps(ready)}")
        entries = await self.core.index(ready_only=ready)
        return web.json_response(
            [{"name": e.name, "version": e.version, "state": e.state, "reason": e.reason} for e in entries]
        )

    async def load(self, request: web.Request) -> web.Response:
        await _json_body(request)  # parameters (Triton's config overrides) are not supported; the body must parse
        await self.core.load(request.match_info["name"])
        return web.json_response({})

    async def unload(self, request: web.Request) -> web.Response:
        await _json_body(request)
        await self.core.unload(request.match_info["name"])
        return web.json_response({})

    async def infer(self, request: web.Request) -> web.Response:
        if self._infer is None:
            return await self.not_served(request)
        name = request.match_info["name"]
        length = request.headers.get(HEADER_LENGTH)
        try:
            header_length = int(length) if length is not None else None
        except ValueError:
            return error(400, f"{HEADER_LENGTH} must be a number of bytes (got {length!r})")
        ids = _ids(request, name)
        body = await request.read()
        try:
            message, choice = parse_infer_request(body, header_length, name, request.match_info.get("version", ""))
        except BadTensor as e:
            return error(400, str(e))
        timeout_s = http_timeout_s(request.headers, None)
        answer = pb.ModelInferResponse.FromString(await self._infer(message.SerializeToString(), ids, timeout_s))
        try:
            out, json_length = render_infer_response(answer, choice)
        except BadTensor as e:
            return error(400, str(e))
        if json_length is None:
            return web.Response(body=out, content_type="application/json")
        return web.Response(body=out, content_type=BINARY_TYPE, headers={HEADER_LENGTH: str(json_length)})

    async def model_metadata(self, request: web.Request) -> web.Response:
        if self._model_metadata is None:
            return await self.not_served(request)
        name = request.match_info["name"]
        ids = _ids(request, name)
        message = pb.ModelMetadataRequest(name=name, version=request.match_info.get("version", ""))
        timeout_s = http_timeout_s(request.headers, None)
        answer = pb.ModelMetadataResponse.FromString(
            await self._model_metadata(message.SerializeToString(), ids, timeout_s)
        )
        return web.json_response(render_metadata_response(answer))

    async def not_served(self, request: web.Request) -> web.Response:
        return error(501, f"{request.method} {request.path} is not served over HTTP by meshd; use gRPC")


def _ids(request: web.Request, name: str) -> RequestIds:
    """The model a request names: `mm-model-id[-bin]` / `mm-vmodel-id[-bin]` headers as on
    gRPC (both is an error), else the model named in the path."""
    mm: list[tuple[str, str | bytes]] = []
    for key, value in request.headers.items():
        key = key.lower()
        if key.endswith("-bin") and key.startswith("mm-"):  # base64 in HTTP, as gRPC sends it
            try:
                mm.append((key, base64.b64decode(value + "=" * (-len(value) % 4), validate=True)))
            except ValueError:
                raise InvalidArgument(f"the {key} header is not base64") from None
        elif key.startswith("mm-"):
            mm.append((key, value))
    ids, _ = parse_request_headers(mm, required=False)
    if ids.model_id is None and ids.vmodel_id is None:
        try:
            return RequestIds(check_id(name), None, ids.balanced)
        except InvalidArgument as e:
            raise InvalidArgument(f"the model name in the path: {e.message}") from None
    return ids


async def _json_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object body ({} when empty); 400 for anything else."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise web.HTTPBadRequest(
            text=json.dumps({"error": f"malformed JSON body: {e}"}), content_type="application/json"
        ) from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(
            text=json.dumps({"error": f"the body must be a JSON object, not {type(body).__name__}"}),
            content_type="application/json",
        )
    return body


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as `{"error": ...}` (OpenAI's error object on /v1/ paths): core errors
    with their mapped status, aiohttp's own (404 no such endpoint, 405, 413) with theirs,
    anything else 500 with the reason logged."""
    fail = _openai_error if request.path.startswith("/v1/") else error
    try:
        return await handler(request)
    except MeshError as e:
        return fail(http_status(e.code), e.message)
    except web.HTTPException as e:
        if e.content_type == "application/json" or e.status < 400:
            raise
        return fail(e.status, e.reason if e.status != 404 else f"no endpoint {request.method} {request.path}")
    except Exception as e:
        log.exception("HTTP %s %s failed", request.method, request.path)
        return fail(500, f"{type(e).__name__}: {e}")


def _openai_error(status: int, message: str) -> web.Response:
    """An error on an OpenAI path (/v1/...), in OpenAI's shape."""
    return web.json_response(openai_error_body(status, message), status=status)


ERROR_DETAIL_CHARS = 200  # of a parser's message, which may quote the offending line


def parse_error(exc: BaseException | None, message: str | None) -> str:
    """What to tell a client whose request could not be parsed (short: never the line itself)."""
    if isinstance(exc, LineTooLong):
        what, limit = exc.args[0], exc.args[1]
        what = what.decode(errors="replace") if isinstance(what, bytes) else str(what)
        if len(what) <= ERROR_DETAIL_CHARS:
            return f"bad HTTP request: {what} (the limit is {limit} bytes)"
        return f"bad HTTP request: a request line or header is over {limit} bytes"
    detail = message or (exc.message if isinstance(exc, HttpProcessingError) else "") or "cannot be parsed"
    if len(detail) > ERROR_DETAIL_CHARS:
        detail = detail[:ERROR_DETAIL_CHARS] + "..."
    return f"bad HTTP request: {detail}"


class _Connection(RequestHandler):
    """aiohttp's connection handler, answering a request its parser refused (status 4xx,
    before any route or middleware runs) as `{"error": ...}` and logging it as one line."""

    __slots__ = ()  # the same layout as RequestHandler: `_Server` retypes its handlers

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if not 400 <= status < 500:
            return super().handle_error(request, status, exc, message)
        text = parse_error(exc, message)
        log.info("HTTP %d to %s: %s", status, request.remote, text)
        response = web.json_response({"error": text}, status=status)
        response.force_close()
        return response


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        handler = super().__call__()
        handler.__class__ = _Connection
        return handler


class _Runner(web.AppRunner):
    """An AppRunner whose connections answer unparseable requests as JSON (`_Connection`):
    aiohttp answers those in its protocol handler, with no hook for the body."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server
        return server


class HttpServer:
    """The REST endpoints on one TCP port; `stop()` closes it (idempotent)."""

    def __init__(
        self,
        core: KServeCore,
        host: str | None,  # None: every address, both families (meshd.net.listen)
        port: int,
        shutdown_timeout_s: float = 5.0,
        ssl_context: ssl.SSLContext | None = None,
        infer: Infer | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        model_metadata: Infer | None = None,
        more_routes: Callable[[web.Application], None] | None = None,
    ) -> None:
        self.ssl_context = ssl_context
        app = KServeHttp(core, infer, max_body_bytes, model_metadata, more_routes).app()
        self.runner = _Runner(app, access_log=None, handle_signals=False, shutdown_timeout=shutdown_timeout_s)
        self.host = host
        self.port = port

    async def start(self) -> int:
        """Listen; returns the bound port (OSError when it is taken)."""
        await self.runner.setup()
        try:
            await web.SockSite(self.runner, bound_socket(self.host, self.port), ssl_context=self.ssl_context).start()
        except OSError as e:
            await self.runner.cleanup()
            raise OSError(
                e.errno, f"cannot listen for HTTP on {describe(self.host, self.port)}: {e.strerror}"
            ) from None
        self.port = int(self.runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        await self.runner.cleanup()
