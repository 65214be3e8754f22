"""Model selection and header forwarding rules of SPEC §3 (pure).

Which model a request names (`mm-model-id[-bin]` or `mm-vmodel-id[-bin]`), whether the
client already balanced its load (`mm-balanced`), and which client headers go on to the
runtime: everything except `mm-*`, `grpc-*`, meshd's internal ones and transport headers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from meshd.core.errors import InvalidArgument
from meshd.decisions.ids import check_id, decode_id

MODEL_ID = "mm-model-id"
MODEL_ID_BIN = "mm-model-id-bin"
VMODEL_ID = "mm-vmodel-id"
VMODEL_ID_BIN = "mm-vmodel-id-bin"
BALANCED = "mm-balanced"
# An HTTP call's deadline (gRPC calls carry theirs as grpc-timeout): milliseconds, meshd's own;
# seconds as the OpenAI SDKs send it on every call (their client timeout, 600 s by default).
TIMEOUT_MS = "mm-timeout-ms"
OPENAI_TIMEOUT_S = "x-stainless-timeout"
MAX_TIMEOUT_S = 365 * 86400.0
INTERNAL_PREFIX = "meshd-"  # peer-only metadata: stripped from, never trusted on, the external port
TRANSPORT_HEADERS = frozenset({"content-type", "user-agent", "te", "host", "grpc-timeout", "grpc-encoding"})

Metadata = tuple[tuple[str, str | bytes], ...]


@dataclass(frozen=True, slots=True)
class RequestIds:
    model_id: str | None
    vmodel_id: str | None
    balanced: bool = False


def ids_from_body(body_id: str | None, is_vmodel: bool, headers: RequestIds) -> RequestIds:
    """Id extraction (MM_DATAPLANE_CONFIG): the body's id wins, the headers are the fallback."""
    if body_id:
        what = "vmodel id" if is_vmodel else "model id"
        body_id = check_id(body_id, what)
        if is_vmodel:
            return RequestIds(None, body_id, headers.balanced)
        return RequestIds(body_id, None, headers.balanced)
    if headers.model_id is None and headers.vmodel_id is None:
        raise InvalidArgument("no model named: the request body has no id and no mm-model-id header is set")
    return headers


def http_timeout_s(headers: Mapping[str, str], default_s: float | None) -> float | None:
    """The deadline an HTTP call gives meshd, in seconds: `mm-timeout-ms`, else
    `x-stainless-timeout`, else `default_s` (MESHD_REQUEST_TIMEOUT_MS; None: none). A value
    that is not a positive number raises InvalidArgument."""
    for name, scale in ((TIMEOUT_MS, 0.001), (OPENAI_TIMEOUT_S, 1.0)):
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            value = float(raw) * scale
        except ValueError:
            value = math.nan
        if not 0 < value <= MAX_TIMEOUT_S:  # also refuses nan and inf
            unit = "milliseconds" if scale < 1 else "seconds"
            raise InvalidArgument(f"the {name} header must be a positive number of {unit}, not {raw[:40]!r}")
        return value
    return default_s


def _set_once(found: dict[str, str], what: str, value: str) -> None:
    previous = found.get(what)
    if previous is not None and previous != value:
        raise InvalidArgument(f"several different {what}s in the request headers; send exactly one")
    found[what] = value


def parse_request_headers(
    metadata: Iterable[tuple[str, str | bytes]], required: bool = True
) -> tuple[RequestIds, Metadata]:
    """The ids a request names and the headers to forward. Raises InvalidArgument.

    `required=False`: naming no model is allowed (the body may name it, id extraction)."""
    found: dict[str, str] = {}
    balanced = False
    forward: list[tuple[str, str | bytes]] = []
    for key, value in metadata:
        if key.startswith("mm-"):
            if key == MODEL_ID or key == VMODEL_ID:
                what = "model id" if key == MODEL_ID else "vmodel id"
                text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
                _set_once(found, what, check_id(text, what))
            elif key == MODEL_ID_BIN or key == VMODEL_ID_BIN:
                what = "model id" if key == MODEL_ID_BIN else "vmodel id"
                raw = value if isinstance(value, bytes) else value.encode()
                _set_once(found, what, decode_id(raw, what))
            elif key == BALANCED:
                balanced = (value.decode() if isinstance(value, bytes) else value).strip().lower() == "true"
            continue
        if key.startswith("grpc-") or key.startswith(INTERNAL_PREFIX) or key in TRANSPORT_HEADERS:
            continue
        forward.append((key, value))
    model_id = found.get("model id")
    vmodel_id = found.get("vmodel id")
    if model_id is not None and vmodel_id is not None:
        raise InvalidArgument("the request names both a model and a vmodel; send one of mm-model-id or mm-vmodel-id")
    if model_id is None and vmodel_id is None and required:
        raise InvalidArgument("no model named: set the mm-model-id (or mm-vmodel-id) header")
    return RequestIds(model_id, vmodel_id, balanced), tuple(forward)


@functools.lru_cache(maxsize=4096)
def _id_headers(model_id: str) -> Metadata:
    # Made once per model, not per request: the encode and the ASCII check add up.
    if model_id.isascii() and model_id.isprintable():
        return ((MODEL_ID_BIN, model_id.encode()), (MODEL_ID, model_id))
    return ((MODEL_ID_BIN, model_id.encode()),)


def runtime_metadata(forward: Metadata, model_id: str) -> Metadata:
    """Headers for the runtime: the client's, plus the concrete model id."""
    ids = _id_headers(model_id)
    return forward + ids if forward else ids
