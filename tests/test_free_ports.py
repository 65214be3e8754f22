"""meshd.testing.procs.free_port(s): a port handed out is not handed out again a moment later,
even when the kernel offers it again (nothing holds it between the two calls)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from meshd.testing import procs


class _Offers:
    """A stand-in for socket.socket whose bind(port 0) gets the next port of a script."""

    def __init__(self, ports: list[int]) -> None:
        self.ports: Iterator[int] = iter(ports)

    def __call__(self, *_: object) -> _Offers._Socket:
        return self._Socket(next(self.ports))

    class _Socket:
        def __init__(self, port: int) -> None:
            self.port = port

        def bind(self, _: tuple[str, int]) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

        def close(self) -> None:
            pass


def test_a_port_offered_again_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procs, "_HANDED_OUT", {})
    monkeypatch.setattr(
        "meshd.testing.procs.socket.socket", _Offers([40001, 40001, 40002, 40001, 40002, 40003, 40004, 40005])
    )
    assert procs.free_port() == 40001
    assert procs.free_port() == 40002  # the kernel offered 40001 again: not handed out twice
    assert procs.free_ports(2, avoid=[40003]) == [40004, 40005]


def test_the_memory_of_handed_out_ports_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procs, "_HANDED_OUT", {})
    monkeypatch.setattr(procs, "_HANDED_OUT_MAX", 3)
    monkeypatch.setattr("meshd.testing.procs.socket.socket", _Offers([1, 2, 3, 4, 1]))
    assert [procs.free_port() for _ in range(5)] == [1, 2, 3, 4, 1]  # 1 was forgotten when 4 came


def test_real_ports_are_distinct_and_bindable() -> None:
    ports = [procs.free_port() for _ in range(50)] + procs.free_ports(20)
    assert len(set(ports)) == 70
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[-1]))
