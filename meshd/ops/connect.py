"""How the operator CLI reaches a meshd, and how failed calls become one clear line.

`open_channel` is the one place a channel is made (transport security goes there).
`call_error` turns a failed call into the line printed after `meshd <command>:`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from meshd.security.tls import TlsConfigError, read_client_credentials

ADDRESS_ENV = "MESHD_ADDRESS"
DEFAULT_ADDRESS = "localhost:8033"  # upstream's external gRPC port (MM_SVC_GRPC_PORT)
DEFAULT_TIMEOUT_S = 30.0
MAX_MESSAGE_BYTES = 64 << 20  # listings of large meshes are big; requests are small


class OpsError(Exception):
    """A failure to report as one line and exit status 1."""


@dataclass(frozen=True, slots=True)
class TargetTls:
    """How to dial a TLS port: `ca` checks the server (None: the system's roots), `cert` and
    `key` are the client certificate mTLS asks for, `server_name` the name the server's
    certificate holds when the address does not (an IP, a port-forward)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None


@dataclass(frozen=True, slots=True)
class Target:
    address: str
    timeout_s: float
    tls: TargetTls | None = None


def default_address(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get(ADDRESS_ENV, "").strip() or DEFAULT_ADDRESS


def open_channel(target: Target) -> grpc.Channel:
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    if target.tls is None:
        return grpc.insecure_channel(target.address, options=options)
    tls = target.tls
    try:
        credentials = read_client_credentials(tls.ca, tls.cert, tls.key)
    except TlsConfigError as e:
        raise OpsError(str(e)) from None
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.secure_channel(target.address, credentials, options=options)


# Connection failures as grpc words them -> what an operator reads (first match wins).
_REASONS = (
    ("connection refused", "connection refused"),
    ("dns resolution failed", "cannot resolve the host name"),
    ("domain name not found", "cannot resolve the host name"),
    ("no route to host", "no route to host"),
    ("network is unreachable", "network is unreachable"),
    ("handshake", "TLS handshake failed"),
    ("timed out", "connection timed out"),
    ("socket closed", "connection closed by the server"),
    ("connection reset", "connection reset"),
)


def unreachable_reason(details: str) -> str | None:
    """Why the server could not be reached, when `details` of an UNAVAILABLE say so; None
    when the server itself answered UNAVAILABLE (its registry down, say)."""
    text = details.lower()
    for needle, reason in _REASONS:
        if needle in text:
            return reason
    if "failed to connect" in text:
        return details.rsplit(": ", 1)[-1].strip() or "connection failed"
    return None


def call_error(target: Target, code: grpc.StatusCode, details: str, service: str = "") -> str:
    """The one line a failed call prints (after `meshd <command>: `)."""
    if code == grpc.StatusCode.UNAVAILABLE:
        reason = unreachable_reason(details)
        if reason is not None:
            return f"cannot reach meshd at {target.address} ({reason})"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer from meshd at {target.address} within {target.timeout_s:g}s (see --timeout)"
    if code == grpc.StatusCode.UNIMPLEMENTED and service:
        return f"{target.address} does not serve {service} (not a meshd, or an older one)"
    text = " ".join(details.split()) or "no details"
    return f"{text} ({code.name})"


def rpc_failure(target: Target, err: grpc.RpcError, service: str = "") -> OpsError:
    code = err.code() if isinstance(err, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (err.details() if isinstance(err, grpc.Call) else str(err)) or ""
    return OpsError(call_error(target, code, details, service))
