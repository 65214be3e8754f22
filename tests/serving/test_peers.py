"""Channels to peers (meshd.serving.peers): the address each is dialled at."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import pytest

from meshd.serving.peers import Peers


@pytest.mark.parametrize(
    ("location", "target"),
    [
        ("[fd00::7]:8080", "[fd00::7]:8080"),
        ("fd00::7:8080", "[fd00::7]:8080"),  # written without brackets (an older meshd): grpc needs them
        ("10.0.0.7:8080", "10.0.0.7:8080"),
        ("meshd-0.modelmesh-serving:8080", "meshd-0.modelmesh-serving:8080"),
    ],
)
async def test_a_peer_is_dialled_at_a_target_grpc_reads_as_host_and_port(location: str, target: str) -> None:
    dialled: list[str] = []

    def dial(address: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
        dialled.append(address)
        return grpc.aio.insecure_channel(address, options=options)

    peers = Peers(1 << 20, dial)
    peer = peers.get("inst-b", location)
    assert dialled == [target] and peer.location == location  # a changed location is still noticed
    await peer.channel.close()
