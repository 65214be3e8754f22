"""Runtime endpoints: `port:N`, `N`, `host:port` or a unix socket path, as grpc targets."""

from __future__ import annotations

import grpc


def grpc_target(endpoint: str) -> str:
    """A grpc dial target for an endpoint spelled the upstream ways."""
    ep = endpoint.strip()
    if not ep:
        raise ValueError("empty runtime endpoint")
    if ep.startswith("unix:"):
        return ep
    if ep.startswith("/") or ep.startswith("."):
        return f"unix:{ep}"
    if ep.startswith("port:"):
        ep = ep[5:]
    if ep.isdigit():
        return f"127.0.0.1:{ep}"
    return ep


# gRPC's reconnect backoff grows to 120 s by default; a local runtime that restarts, or a peer
# whose partition healed, should be reached again within seconds.
_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2_000)]


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


# Peer channels ping the peer every few seconds, calls or not: a frozen or unreachable peer
# then fails its calls with UNAVAILABLE ("ping timeout"; a forward retried elsewhere like any
# unreachable peer's) instead of holding them to their deadline. grpc core answers pings on its
# own threads, so a peer whose event loop is merely busy still answers. grpc 1.75 times the
# ping out by `ping_timeout_ms` (default 1 min), not `keepalive_timeout_ms`: both are set.
PEER_KEEPALIVE_MS = 3_000
PEER_PING_TIMEOUT_MS = 3_000


def peer_channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        *channel_options(max_message_bytes),
        ("grpc.keepalive_time_ms", PEER_KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", PEER_PING_TIMEOUT_MS),
        ("grpc.http2.ping_timeout_ms", PEER_PING_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # else pings stop during a long silent call
        *_RECONNECT,
    ]


def server_options(max_message_bytes: int, max_headers_bytes: int) -> list[tuple[str, int]]:
    """Message and header limits for meshd's servers. grpc refuses headers between its soft
    and hard limit with a rising probability; one limit for both makes the answer the same
    for every request of a size."""
    return [
        *channel_options(max_message_bytes),
        # grpc sets SO_REUSEPORT by default: a second server on a taken port would share it
        # (two unrelated meshes answering on one port) instead of failing to bind.
        ("grpc.so_reuseport", 0),
        ("grpc.max_metadata_size", max_headers_bytes),
        ("grpc.absolute_max_metadata_size", max_headers_bytes),
    ]


def connection_age_options(age_s: int | None, grace_s: int | None) -> list[tuple[str, int]]:
    """MM_SVC_GRPC_MAX_CONNECTION_AGE_SECS and its _GRACE_SECS: clients' connections are
    closed (GOAWAY) after that age, so a balancer's new pods get connections; calls in flight
    get the grace (unset: no limit, grpc's default)."""
    options: list[tuple[str, int]] = []
    if age_s is not None:
        options.append(("grpc.max_connection_age_ms", min(age_s * 1000, 2**31 - 1)))
        if grace_s is not None:
            options.append(("grpc.max_connection_age_grace_ms", min(grace_s * 1000, 2**31 - 1)))
    return options


# What a forward adds to a request's headers (meshd-hop, meshd-mode, traceparent and the
# like, well under this): a request the external port takes is never refused by a peer's.
INTERNAL_HEADER_ROOM = 1024


def internal_server_options(max_message_bytes: int, max_headers_bytes: int) -> list[tuple[str, int]]:
    """The internal port's: room for the headers a forward adds, and peers' keepalive pings
    accepted (grpc's defaults answer pings more often than every 5 minutes with a GOAWAY)."""
    return [
        *server_options(max_message_bytes, min(max_headers_bytes + INTERNAL_HEADER_ROOM, 2**31 - 1)),
        ("grpc.http2.min_ping_interval_without_data_ms", PEER_KEEPALIVE_MS // 2),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def open_channel(endpoint: str, max_message_bytes: int) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(grpc_target(endpoint), options=[*channel_options(max_message_bytes), *_RECONNECT])
