"""Sockets on both address families (meshd.net.listen), over real loopback connections."""

from __future__ import annotations

import errno
import socket

import pytest

from meshd.net import listen


def _connects(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as c:
        c.settimeout(2)
        return c.connect_ex((host, port)) == 0


needs_ipv6 = pytest.mark.skipif(not listen.ipv6_available(), reason="no IPv6 on this host")


@needs_ipv6
def test_no_host_listens_on_both_families_with_one_socket() -> None:
    with listen.bound_socket(None, 0) as sock:
        sock.listen()
        port = sock.getsockname()[1]
        assert sock.family == socket.AF_INET6
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
        assert _connects("::1", port) and _connects("127.0.0.1", port)
        assert listen.describe(None, port) == f"[::]:{port}"


def test_without_ipv6_it_is_0_0_0_0(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listen, "ipv6_available", lambda: False)
    with listen.bound_socket(None, 0) as sock:
        sock.listen()
        assert sock.family == socket.AF_INET and sock.getsockname()[0] == "0.0.0.0"
        assert _connects("127.0.0.1", sock.getsockname()[1])
        assert listen.describe(None, 8089) == "0.0.0.0:8089"


def test_a_configured_host_is_bound_as_given() -> None:
    with listen.bound_socket("127.0.0.1", 0) as sock:
        assert sock.family == socket.AF_INET and sock.getsockname()[0] == "127.0.0.1"


@needs_ipv6
def test_a_configured_ipv6_host_bracketed_or_not() -> None:
    for host in ("::1", "[::1]"):
        with listen.bound_socket(host, 0) as sock:
            assert sock.family == socket.AF_INET6 and sock.getsockname()[0] == "::1"


@needs_ipv6
def test_a_port_taken_on_either_family_is_taken() -> None:
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::1")):
        with socket.socket(family, socket.SOCK_STREAM) as other:
            if family == socket.AF_INET6:
                other.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            other.bind((host, 0))
            other.listen()
            with pytest.raises(OSError) as taken:
                listen.bound_socket(None, other.getsockname()[1]).close()
            assert taken.value.errno == errno.EADDRINUSE
