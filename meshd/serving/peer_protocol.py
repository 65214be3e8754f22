"""The internal port's protocol between peers: the metadata a forwarded call carries, the
reasons a refusal gives, and what an answer from a peer, or from the local runtime, means to
the sender (reroute, not found, a request it could not parse, or the status as it is).
"""

from __future__ import annotations

import math
from typing import Any

import grpc

from meshd.core.errors import InvalidArgument, MeshError, NotFound, RuntimeStatusError

# Internal metadata, only ever read on the internal port (the external one strips meshd-*).
HOP = "meshd-hop"  # instance id of the forwarding peer
MODE = "meshd-mode"  # "serve": only a loaded copy here; "load": load here first if needed
# With "load": the sender placed it by price (placement.rank.cheapest): load here only if what
# this instance would evict is worth no more (log2, as `meshdVictim`) and a thread is free.
PRICE_LIMIT = "meshd-price-limit"
REASON = "meshd-reason"  # trailing metadata on a refusal: why, so the sender reroutes
NOT_HERE = "not-here"  # no loaded copy there (or it could not take the load): reroute
LOAD_FAILED = "load-failed"  # the load failed there (recorded): reroute
UNKNOWN_MODEL = "unknown-model"  # the model is not registered (any more)
REPRICED = "repriced"  # a load placed by price would evict more here, or wait: place it again
BUSY = "busy"  # the copy's queue is full (its concurrency limit): try another copy
AT_MAX = "at-max"  # not loaded there: the model's max copies are on other instances
# The caller is not (yet) a live instance of the mesh there: its record may be back in etcd
# but not in that peer's mirror (after an etcd stall every record returns at once): reroute.
UNKNOWN_PEER = "unknown-peer"
PASSED_ON = "status"  # the runtime's (or meshd's) own answer: goes to the client as is
ACCEPTED = "meshd-accepted"  # initial metadata: the peer took the stream, send the messages
# Trailing metadata on every unary answer: the answering instance's loads in progress
# (running and queued) as it finishes the call, fresher than its record (issue 36).
LOADS = "meshd-loads"


def reported_loads(trailers: Any) -> int | None:
    """The `meshd-loads` a peer's answer carried (None: absent or not a count, e.g. an older peer)."""
    for key, value in trailers or ():
        if key == LOADS:
            text = value if isinstance(value, str) else value.decode()
            return int(text) if text.isascii() and text.isdigit() else None  # not '²', which int() refuses
    return None


def price_header(price_limit: float) -> str:
    """`meshd-price-limit`'s value ("-inf": only free room will do)."""
    return "-inf" if price_limit == -math.inf else f"{price_limit:.4f}"


def read_price_limit(value: str | bytes) -> float | None:
    """A `meshd-price-limit` value (None: not a number this instance can use; the load then
    goes unconditionally, as from a sender that does not price)."""
    text = value if isinstance(value, str) else value.decode("ascii", "replace")
    try:
        limit = float(text)
    except ValueError:
        return None
    return limit if math.isfinite(limit) or limit == -math.inf else None


class Refused(Exception):
    """An instance could not serve (gone, no copy, load failed): reroute.

    `exclude`: do not try that instance again for this request (False when retrying
    there may work, e.g. its runtime lost a copy and it can reload it). `unreachable`: the
    instance did not answer at all (gRPC's own UNAVAILABLE), evidence that its record is stale.
    """

    def __init__(
        self,
        message: str,
        exclude: bool = True,
        busy: bool = False,
        holders: dict[str, int] | None = None,
        unreachable: bool = False,
        load_failed: bool = False,
        repriced: bool = False,
    ) -> None:
        super().__init__(message)
        self.repriced = repriced  # a load sent with a price limit, refused for it (rank.stays)
        self.exclude = exclude
        self.unreachable = unreachable
        self.load_failed = load_failed  # the load failed there (its record says so once etcd's watch catches up)
        self.busy = busy  # the copy is saturated (its queue is full)
        # Not None: the load was refused at the model's max copies; these hold it (empty:
        # not known, read the record from etcd). The mirror may not show them yet.
        self.holders = holders


class PeerRefusal(MeshError):
    """Answered to a peer: UNAVAILABLE with the reason in trailing metadata."""

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"meshd: {message}")
        self.reason = reason


def peer_failure(code: grpc.StatusCode, details: str | None, trailers: Any, model_id: str) -> Exception:
    """What a peer's non-OK answer means here: reroute, not found, or the status as is."""
    reason = None
    for key, value in trailers or ():
        if key == REASON:
            reason = value if isinstance(value, str) else value.decode()
    if reason == LOAD_FAILED:
        return Refused(f"{reason}: {details}", load_failed=True)
    if reason == REPRICED:
        return Refused(f"{reason}: {details}", repriced=True)
    if reason in (NOT_HERE, UNKNOWN_PEER):
        return Refused(f"{reason}: {details}")
    if reason == BUSY:
        return Refused(f"busy: {details}", busy=True)
    if reason == AT_MAX:
        return Refused(f"{reason}: {details}", exclude=False, holders={})
    if reason == UNKNOWN_MODEL:
        return NotFound(details or f"model {model_id!r} not found")
    if reason is None and code == grpc.StatusCode.UNAVAILABLE:
        return Refused(f"unreachable: {details}", unreachable=True)  # gRPC's own: the peer is gone
    if reason is None and code == grpc.StatusCode.CANCELLED:
        # Not this instance's doing (its own cancellation ends the calling task instead): a
        # gRPC server that is stopping cancels the calls that reached it but no handler yet
        # (grpc 1.75 answers CANCELLED "CANCELLED"), so the peer is leaving: try another copy.
        return Refused(f"cancelled by the peer (stopping?): {details}")
    return RuntimeStatusError(code, details or code.name)


def runtime_failure(code: grpc.StatusCode, details: str | None) -> Exception:
    """What the local runtime's non-OK answer means (a lost copy is checked by the caller
    first, against the runtime): reroute when it is down or overloaded (UNAVAILABLE: SPEC's
    "another copy"; if none can serve, the client gets UNAVAILABLE with the reasons) or when
    it cancelled a call this instance did not cancel (its server is stopping, as in
    `peer_failure`); INVALID_ARGUMENT when it could not parse the request; else its status."""
    if code == grpc.StatusCode.UNAVAILABLE:
        return Refused(f"the runtime is unavailable: {details}")
    if code == grpc.StatusCode.CANCELLED:
        return Refused(f"the runtime cancelled the call (stopping?): {details}")
    if code == grpc.StatusCode.INTERNAL and "deserializ" in (details or "").lower():
        return InvalidArgument(f"the runtime could not parse the request: {details}")
    return RuntimeStatusError(code, details or code.name)
