"""How the operator CLI words a failed call."""

from __future__ import annotations

import grpc
import pytest

from meshd.ops.connect import DEFAULT_ADDRESS, Target, call_error, default_address, unreachable_reason

T = Target("mesh:8033", 30.0)


@pytest.mark.parametrize(
    ("details", "reason"),
    [
        (
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
            "Failed to connect to remote host: Connection refused",
            "connection refused",
        ),
        (
            "DNS resolution failed for nosuch:1: C-ares status is not ARES_SUCCESS: Domain name not found",
            "cannot resolve the host name",
        ),
        (
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.1:1: Ssl handshake failed: X",
            "TLS handshake failed",
        ),
        ("failed to connect to all addresses; last error: UNKNOWN: something new", "something new"),
        ("model registry unavailable: etcd down", None),  # the server answered
    ],
)
def test_unreachable_reason(details: str, reason: str | None) -> None:
    assert unreachable_reason(details) == reason


def test_call_errors_are_one_line() -> None:
    refused = "failed to connect to all addresses; last error: Connection refused"
    assert call_error(T, grpc.StatusCode.UNAVAILABLE, refused) == "cannot reach meshd at mesh:8033 (connection refused)"
    assert (
        call_error(T, grpc.StatusCode.UNAVAILABLE, "model registry unavailable: x")
        == "model registry unavailable: x (UNAVAILABLE)"
    )
    assert call_error(T, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") == (
        "no answer from meshd at mesh:8033 within 30s (see --timeout)"
    )
    assert call_error(T, grpc.StatusCode.UNIMPLEMENTED, "", "meshd.admin.MeshAdmin") == (
        "mesh:8033 does not serve meshd.admin.MeshAdmin (not a meshd, or an older one)"
    )
    assert call_error(T, grpc.StatusCode.ALREADY_EXISTS, "model 'm'\nexists") == "model 'm' exists (ALREADY_EXISTS)"
    assert call_error(T, grpc.StatusCode.INTERNAL, "") == "no details (INTERNAL)"


def test_default_address_from_the_environment() -> None:
    assert default_address({}) == DEFAULT_ADDRESS == "localhost:8033"
    assert default_address({"MESHD_ADDRESS": "  "}) == DEFAULT_ADDRESS
    assert default_address({"MESHD_ADDRESS": "mesh.svc:8033"}) == "mesh.svc:8033"
