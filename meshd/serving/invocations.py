"""What one external inference call did, recorded where it ends: metrics and the invoke log.

The external handler calls `Invocations.done` once per call. Where the call was served is
noted by the router in `SERVED` (a context variable: the handler awaits the router in the
same task, so the router's note is visible once the call returns); it also carries the
concrete model a vmodel resolved to. With MM_LOG_EACH_INVOKE each call is one INFO record
on the `meshd.serving.invocations` logger, its fields also as record attributes (JSON logs show them).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Mapping
from contextvars import ContextVar

from meshd.observability.metrics import Metrics
from meshd.observability.payloads import Payload, PayloadProcessors, text_headers
from meshd.serving.proxy.headers import RequestIds

log = logging.getLogger("meshd.invocations")  # the documented per-call log (docs/observability.md); kept across moves

LOCAL = "local"  # `servedBy` of a call this instance's runtime served
# Codes of a call whose model id named nothing: not used as a per-model label (bounded series).
UNRESOLVED = frozenset({"NOT_FOUND", "INVALID_ARGUMENT"})

# (concrete model id, instance id that served or was last tried), set by the router.
SERVED: ContextVar[tuple[str, str] | None] = ContextVar("meshd_served", default=None)


def records_calls(metrics: bool, log_each: bool, payloads: bool) -> bool:
    """Whether calls are recorded one by one at all: metrics, the invoke log or payload processors."""
    return metrics or log_each or payloads


class Invocations:
    def __init__(
        self,
        metrics: Metrics,
        log_each: bool,
        self_id: str,
        payloads: PayloadProcessors | None = None,
        header_fields: Mapping[str, str] | None = None,
    ) -> None:
        """`payloads`: MM_PAYLOAD_PROCESSORS; `header_fields`: MM_LOG_REQUEST_HEADERS, request
        header -> field of the invoke log record (upstream puts them in the log context)."""
        self.metrics = metrics
        self.log_each = log_each
        self.self_id = self_id
        self.payloads = payloads
        self.header_fields = dict(header_fields or {})
        self._ids = itertools.count(1)
        self.active = records_calls(metrics.enabled, log_each, payloads is not None)  # off: `done` returns at once

    def set_log_each(self, on: bool) -> None:
        """Turn the invoke log on or off at run time (etcd's `config/log_each_invocation`)."""
        self.log_each = on
        self.active = records_calls(self.metrics.enabled, on, self.payloads is not None)

    def start(self) -> float:
        """The call's start time; forgets any earlier call's note in this context."""
        if self.active:
            SERVED.set(None)
        return time.perf_counter()

    def carried(
        self,
        method: str,
        model_id: str,
        vmodel_id: str,
        code: str,
        ms: float,
        req_bytes: int,
        resp_bytes: int,
        served_by: str,
    ) -> None:
        """Record one call the native data plane carried (served by this runtime, LOCAL, or by a
        peer): the same metrics and invoke log as `done`. Its payloads never reach Python, so
        with payload processors on, nothing is carried natively (see meshd.mesh)."""
        if not self.active:
            return
        self.metrics.api_request(method, code, ms, req_bytes, resp_bytes, model_id, vmodel_id)
        if self.log_each:
            log.info(
                "invoke %s model=%s vmodel=%s code=%s %.2f ms served_by=%s native",
                method,
                model_id,
                vmodel_id or "-",
                code,
                ms,
                served_by,
                extra={
                    "method": method,
                    "modelId": model_id,
                    "vModelId": vmodel_id or None,
                    "code": code,
                    "durationMs": round(ms, 3),
                    "servedBy": served_by,
                    "native": True,
                },
            )

    def done(
        self,
        method: str,
        ids: RequestIds | None,
        code: str,
        started: float,
        req_bytes: int,
        resp_bytes: int,
        request: bytes | None = None,
        response: bytes | None = None,
        metadata: Iterable[tuple[str, str | bytes]] | None = None,
    ) -> None:
        """Record one finished call (`resp_bytes` < 0: no response, e.g. an error or a stream);
        `request`/`response`/`metadata`: the call itself, for the payload processors."""
        if not self.active:
            return
        ms = (time.perf_counter() - started) * 1000
        served = SERVED.get()
        vmodel_id = (ids.vmodel_id if ids is not None else None) or ""
        if served is not None:
            model_id = served[0]
        else:
            model_id = (ids.model_id if ids is not None else None) or ""
        # A client's id that named no model gets no per-model series (clients choose ids).
        labelled = "" if served is None and code in UNRESOLVED else model_id
        self.metrics.api_request(method, code, ms, req_bytes, resp_bytes, labelled, vmodel_id)
        if self.payloads is not None and request is not None:
            headers = text_headers(metadata)
            call_id = f"{self.self_id}-{next(self._ids)}"
            self.payloads.submit(Payload(call_id, model_id, vmodel_id, request, "request", "", headers))
            self.payloads.submit(Payload(call_id, model_id, vmodel_id, response or b"", "response", code, headers))
        if self.log_each:
            fields: dict[str, str] = {}
            if self.header_fields and metadata is not None:
                for key, value in metadata:
                    name = self.header_fields.get(key)
                    if name is not None and isinstance(value, str):
                        fields[name] = value
            where = None if served is None else (LOCAL if served[1] == self.self_id else served[1])
            log.info(
                "invoke %s model=%s vmodel=%s code=%s %.2f ms served_by=%s%s",
                method,
                model_id or "-",
                vmodel_id or "-",
                code,
                ms,
                where or "-",
                "".join(f" {k}={v}" for k, v in fields.items()),
                extra={
                    **fields,
                    "method": method,
                    "modelId": model_id or None,
                    "vModelId": vmodel_id or None,
                    "code": code,
                    "durationMs": round(ms, 3),
                    "servedBy": where,
                },
            )
