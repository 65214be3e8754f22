"""`host:port` text with IPv6 literals in brackets (meshd.core.hostport)."""

from __future__ import annotations

import pytest

from meshd.core import hostport


@pytest.mark.parametrize(
    ("host", "port", "address"),
    [
        ("10.0.0.7", 8080, "10.0.0.7:8080"),
        ("::1", 8080, "[::1]:8080"),
        ("fd00::7", 18080, "[fd00::7]:18080"),
        ("[fd00::7]", 8080, "[fd00::7]:8080"),  # bracketed once, not twice
        ("fe80::1%eth0", 80, "[fe80::1%eth0]:80"),
        ("::ffff:10.0.0.7", 80, "[::ffff:10.0.0.7]:80"),
        ("meshd-0.modelmesh-serving", 8033, "meshd-0.modelmesh-serving:8033"),
        ("localhost", "8033", "localhost:8033"),
    ],
)
def test_join_brackets_ipv6_literals_only(host: str, port: int | str, address: str) -> None:
    assert hostport.join(host, port) == address


@pytest.mark.parametrize(
    ("address", "split"),
    [
        ("10.0.0.7:8080", ("10.0.0.7", 8080)),
        ("[::1]:18080", ("::1", 18080)),
        ("[fd00::7]:8080", ("fd00::7", 8080)),
        ("::1:18080", ("::1", 18080)),  # unbracketed, as an older record holds it: last colon
        ("fd00::7:8080", ("fd00::7", 8080)),
        ("etcd.modelmesh-serving:2379", ("etcd.modelmesh-serving", 2379)),
        ("localhost:1", ("localhost", 1)),
    ],
)
def test_split_reads_every_spelling(address: str, split: tuple[str, int]) -> None:
    assert hostport.split(address) == split
    assert hostport.split(hostport.join(*split)) == split  # round trip


@pytest.mark.parametrize(
    "address", ["10.0.0.7", "localhost", "[::1]", "[::1]8080", "[::1:8080", ":8080", "h:0", "h:65536", "h:x", "::1"]
)
def test_split_refuses_what_has_no_port(address: str) -> None:
    with pytest.raises(ValueError):
        hostport.split(address)


@pytest.mark.parametrize(
    ("address", "target"),
    [
        ("::1:18080", "[::1]:18080"),  # grpc reads `::1:18080` as a host with no port
        ("fd00::7:8080", "[fd00::7]:8080"),
        ("[fd00::7]:8080", "[fd00::7]:8080"),
        ("10.0.0.7:8080", "10.0.0.7:8080"),
        ("meshd-0:8080", "meshd-0:8080"),
        ("unix:/tmp/peer.sock", "unix:/tmp/peer.sock"),
        ("dns:///meshd:8080", "dns:///meshd:8080"),
        ("no-port", "no-port"),
    ],
)
def test_dial_target_brackets_what_grpc_needs_and_passes_the_rest(address: str, target: str) -> None:
    assert hostport.dial_target(address) == target


def test_ipv6_and_brackets() -> None:
    assert hostport.is_ipv6("::1") and hostport.is_ipv6("[::1]") and hostport.is_ipv6("fe80::1%eth0")
    assert not hostport.is_ipv6("10.0.0.7") and not hostport.is_ipv6("localhost") and not hostport.is_ipv6("")
    assert hostport.bracket("::1") == "[::1]" and hostport.bracket("[::1]") == "[::1]"
    assert hostport.bracket("10.0.0.7") == "10.0.0.7" and hostport.unbracket("[::1]") == "::1"
    assert hostport.unbracket("localhost") == "localhost"
