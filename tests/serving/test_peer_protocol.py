"""The internal port's refusals (issue 15, fault 2): a well-formed peer call from an
instance this one does not (yet) see as live is refused with a reason the sender reroutes
on, never INVALID_ARGUMENT passed on to its client; a peer that does not answer at all is
evidence its record is stale."""

from __future__ import annotations

import math

import grpc
import pytest

from meshd.core.errors import InvalidArgument, RuntimeStatusError
from meshd.serving.peer_protocol import (
    HOP,
    LOADS,
    MODE,
    PRICE_LIMIT,
    REASON,
    REPRICED,
    UNKNOWN_PEER,
    PeerRefusal,
    Refused,
    peer_failure,
    price_header,
    read_price_limit,
    reported_loads,
    runtime_failure,
)
from meshd.serving.proxy.headers import MODEL_ID
from meshd.serving.proxy.peer_handler import parse_peer_metadata


def _call(hop: str) -> tuple[tuple[str, str], ...]:
    return ((HOP, hop), (MODE, "serve"), (MODEL_ID, "m"))


def test_a_call_from_an_instance_not_live_here_is_a_reroutable_refusal() -> None:
    with pytest.raises(PeerRefusal) as err:
        parse_peer_metadata(_call("inst-new"), lambda iid: False)
    assert err.value.reason == UNKNOWN_PEER and err.value.code == grpc.StatusCode.UNAVAILABLE
    refused = peer_failure(err.value.code, err.value.message, ((REASON, UNKNOWN_PEER),), "m")
    assert isinstance(refused, Refused) and refused.exclude and not refused.unreachable


def test_a_call_not_marked_as_a_peer_call_is_still_invalid() -> None:
    with pytest.raises(InvalidArgument):
        parse_peer_metadata(((MODE, "serve"), (MODEL_ID, "m")), lambda iid: True)
    assert parse_peer_metadata(_call("inst-b"), lambda iid: iid == "inst-b")[:2] == ("m", "serve")


def test_no_answer_at_all_marks_the_peer_unreachable_and_a_refusal_does_not() -> None:
    gone = peer_failure(grpc.StatusCode.UNAVAILABLE, "connection refused", (), "m")
    assert isinstance(gone, Refused) and gone.unreachable
    here = peer_failure(grpc.StatusCode.UNAVAILABLE, "no copy", ((REASON, "not-here"),), "m")
    assert isinstance(here, Refused) and not here.unreachable


def test_a_peer_cancelling_a_call_it_was_not_asked_to_cancel_is_a_reroute() -> None:
    """A stopping gRPC server cancels the calls that reached it but no handler: the peer is
    leaving, not answering for the model (not marked unreachable: it still answers)."""
    stopping = peer_failure(grpc.StatusCode.CANCELLED, "CANCELLED", (), "m")
    assert isinstance(stopping, Refused) and stopping.exclude and not stopping.unreachable


@pytest.mark.parametrize(
    ("code", "details", "meaning"),
    [
        (grpc.StatusCode.UNAVAILABLE, "connection refused", Refused),  # down: another copy
        (grpc.StatusCode.CANCELLED, "CANCELLED", Refused),  # its server stopping: another copy
        (grpc.StatusCode.INTERNAL, "Failed to deserialize request", InvalidArgument),
        (grpc.StatusCode.INTERNAL, "the model crashed", RuntimeStatusError),  # its own answer
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "", RuntimeStatusError),
    ],
)
def test_what_the_runtimes_answer_means(code: grpc.StatusCode, details: str, meaning: type) -> None:
    failure = runtime_failure(code, details)
    assert type(failure) is meaning
    if isinstance(failure, RuntimeStatusError):  # passed on as it is
        assert failure.code == code and failure.message == (details or code.name)


def test_only_a_peers_load_failure_is_marked_as_one() -> None:
    failed = peer_failure(grpc.StatusCode.UNAVAILABLE, "injected", ((REASON, "load-failed"),), "m")
    assert isinstance(failed, Refused) and failed.load_failed and failed.exclude
    here = peer_failure(grpc.StatusCode.UNAVAILABLE, "no copy", ((REASON, "not-here"),), "m")
    gone = peer_failure(grpc.StatusCode.UNAVAILABLE, "connection refused", (), "m")
    assert isinstance(here, Refused) and isinstance(gone, Refused)
    assert not here.load_failed and not gone.load_failed


def test_a_peers_load_count_is_read_only_when_it_is_a_count() -> None:
    assert reported_loads(((REASON, "not-here"), (LOADS, "3"))) == 3
    assert reported_loads(((LOADS, b"0"),)) == 0
    assert reported_loads(((REASON, "not-here"),)) is None  # an older peer says nothing
    assert reported_loads(None) is None
    assert reported_loads(((LOADS, "-1"),)) is None and reported_loads(((LOADS, "many"),)) is None
    assert reported_loads(((LOADS, "\u00b2"),)) is None  # a digit to str.isdigit(), not to int()


def test_a_load_placed_by_price_carries_its_limit_and_a_repricing_refusal_reroutes() -> None:
    call = (*_call("inst-b"), (PRICE_LIMIT, price_header(-1.25)))
    assert parse_peer_metadata(call, lambda iid: True)[3] == -1.25
    assert parse_peer_metadata(_call("inst-b"), lambda iid: True)[3] is None  # no limit: load unconditionally
    refused = peer_failure(grpc.StatusCode.UNAVAILABLE, "would evict more", ((REASON, REPRICED),), "m")
    assert isinstance(refused, Refused) and refused.repriced and refused.exclude and not refused.unreachable
    assert not refused.busy


def test_price_limits_round_trip_and_a_bad_one_is_no_limit() -> None:
    assert read_price_limit(price_header(-math.inf)) == -math.inf  # only free room will do
    assert read_price_limit(price_header(3.14159)) == 3.1416
    assert read_price_limit(b"2.5") == 2.5
    for bad in ("", "abc", "nan", "inf", "1e999"):
        assert read_price_limit(bad) is None, bad
