"""What one external inference call did, recorded where it ends: metrics and the invoke log.

The external handler calls `Invocations.done` once per call. Where the call was served is
noted by the router in `SERVED` (a context variable: the handler awaits the router in the
same task, so the router's note is visible once the call returns); it also carries the
concrete model a vmodel resolved to. With MM_LOG_EACH_INVOKE each call is one INFO record
on the `meshd.serving.invocations` logger, its fields also as record attributes (JSON logs show them).
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar

from meshd.observability.metrics import Metrics
from meshd.serving.proxy.headers import RequestIds

log = logging.getLogger("meshd.invocations")  # the documented per-call log (docs/observability.md); kept across moves

LOCAL = "local"  # `servedBy` of a call this instance's runtime served
# Codes of a call whose model id named nothing: not used as a per-model label (bounded series).
UNRESOLVED = frozenset({"NOT_FOUND", "INVALID_ARGUMENT"})

# (concrete model id, instance id that served or was last tried), set by the router.
SERVED: ContextVar[tuple[str, str] | None] = ContextVar("meshd_served", default=None)


class Invocations:
    def __init__(self, metrics: Metrics, log_each: bool, self_id: str) -> None:
        self.metrics = metrics
        self.log_each = log_each
        self.self_id = self_id
        self.active = metrics.enabled or log_each  # off: `done` returns at once

    def start(self) -> float:
        """The call's start time; forgets any earlier call's note in this context."""
        if self.active:
            SERVED.set(None)
        return time.perf_counter()

    def done(
        self, method: str, ids: RequestIds | None, code: str, started: float, req_bytes: int, resp_bytes: int
    ) -> None:
        """Record one finished call (`resp_bytes` < 0: no response, e.g. an error or a stream)."""
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
        if self.log_each:
            where = None if served is None else (LOCAL if served[1] == self.self_id else served[1])
            log.info(
                "invoke %s model=%s vmodel=%s code=%s %.2f ms served_by=%s",
                method,
                model_id or "-",
                vmodel_id or "-",
                code,
                ms,
                where or "-",
                extra={
                    "method": method,
                    "modelId": model_id or None,
                    "vModelId": vmodel_id or None,
                    "code": code,
                    "durationMs": round(ms, 3),
                    "servedBy": where,
                },
            )
