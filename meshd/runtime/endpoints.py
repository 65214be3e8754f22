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


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def server_options(max_message_bytes: int, max_headers_bytes: int) -> list[tuple[str, int]]:
    """Message and header limits for meshd's servers. grpc refuses headers between its soft
    and hard limit with a rising probability; one limit for both makes the answer the same
    for every request of a size."""
    return [
        *channel_options(max_message_bytes),
        ("grpc.max_metadata_size", max_headers_bytes),
        ("grpc.absolute_max_metadata_size", max_headers_bytes),
    ]


# gRPC's reconnect backoff grows to 120 s by default; a local runtime that restarts should
# be reached again within seconds.
_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2_000)]


def open_channel(endpoint: str, max_message_bytes: int) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(grpc_target(endpoint), options=[*channel_options(max_message_bytes), *_RECONNECT])
