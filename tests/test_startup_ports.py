"""Every port meshd listens on is checked before anything starts: the metrics port too, and two
settings naming one port (the gRPC, peer and HTTP cases run real processes in
tests/integration/test_startup_refusals.py)."""

from __future__ import annotations

import socket

import pytest

from meshd.config import load_config
from meshd.mesh import StartRefused, check_ports_free, listening_ports
from meshd.net.listen import ipv6_available
from meshd.testing.procs import free_port


def test_a_taken_metrics_port_refuses_start_naming_mm_metrics() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = load_config(None, {"MM_METRICS": f"prometheus:port={port}", "MM_SVC_GRPC_PORT": str(free_port())})
        assert ("MM_METRICS (port=N; or 'disabled')", port) in listening_ports(cfg)
        with pytest.raises(StartRefused, match=rf"port {port} is already in use .*set MM_METRICS"):
            check_ports_free(listening_ports(cfg))


def test_a_taken_probe_port_refuses_start() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = load_config(None, {"MM_PROBE_PORT": str(port), "MM_SVC_GRPC_PORT": str(free_port())})
        with pytest.raises(StartRefused, match=rf"port {port} is already in use .*set MM_PROBE_PORT"):
            check_ports_free(listening_ports(cfg))


def test_two_settings_naming_one_port_refuse_start() -> None:
    port = free_port()
    cfg = load_config(None, {"MM_METRICS": f"prometheus:port={port}", "MM_SVC_GRPC_PORT": str(port)})
    with pytest.raises(StartRefused, match=rf"MM_METRICS .* and MM_SVC_GRPC_PORT .* both name port {port}"):
        check_ports_free(listening_ports(cfg))


def test_free_ports_pass_and_disabled_ones_are_not_checked() -> None:
    env = {"MM_METRICS": "disabled", "MESHD_HTTP_PORT": "disabled", "MM_PROBE_PORT": "disabled"}
    env |= {"MM_PRESTOP_WAIT_PORT": "disabled", "MM_SVC_GRPC_PORT": str(free_port())}
    cfg = load_config(None, {**env, "MESHD_PEER_PORT": str(free_port())})
    assert [what for what, _ in listening_ports(cfg)] == [
        "MM_SVC_GRPC_PORT (--grpc-port)",
        "MESHD_PEER_PORT (--peer-port)",
    ]
    check_ports_free(listening_ports(cfg))


@pytest.mark.skipif(not ipv6_available(), reason="no IPv6 on this host")
def test_a_port_taken_on_ipv6_only_refuses_start() -> None:
    """The servers bind both families, so a port another process holds on IPv6 alone is taken."""
    with socket.socket(socket.AF_INET6) as taken:
        taken.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        taken.bind(("::1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = load_config(None, {"MM_PROBE_PORT": str(port), "MM_SVC_GRPC_PORT": str(free_port())})
        with pytest.raises(StartRefused, match=rf"port {port} is already in use .*set MM_PROBE_PORT"):
            check_ports_free(listening_ports(cfg))
