"""Sockets that listen on both address families, so an IPv6-only or dual-stack pod's
kubelet probes, preStop hooks and Prometheus scrapes reach meshd at the pod IP.

A server given no host listens on `::` with IPV6_V6ONLY off: one socket takes IPv6 and
(IPv4-mapped) IPv4 connections. Where the host has no IPv6 (a kernel booted with
ipv6.disable=1, a container without it) the socket is `0.0.0.0`, as before. A host the user
configured is bound as given. The gRPC ports need none of this: grpc-core already binds its
wildcard (`0.0.0.0:port`) dual-stack, falling back to IPv4 the same way.
"""

from __future__ import annotations

import functools
import socket

from meshd.core.hostport import join

ANY_V6 = "::"
ANY_V4 = "0.0.0.0"


@functools.cache
def ipv6_available() -> bool:
    """Whether a dual-stack `::` socket can be bound here (checked once per process)."""
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind((ANY_V6, 0))
    except OSError:
        return False
    return True


def wildcard() -> str:
    """The address a server given no host listens on: `::` (both families) or `0.0.0.0`."""
    return ANY_V6 if ipv6_available() else ANY_V4


def describe(host: str | None, port: int) -> str:
    """`host:port` for messages, `[::]:port` for the dual-stack wildcard."""
    return join(wildcard() if host is None else host, port)


def bound_socket(host: str | None, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` (every address of both families when `host` is None),
    SO_REUSEADDR as servers set it, non-blocking, not yet listening; OSError when taken."""
    dual = host is None and ipv6_available()
    if host is None:
        host = wildcard()
    family, kind, proto, _, address = socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        if dual:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
