"""meshd on an IPv6 pod IP (WKUBE_POD_IPADDR=::1, as on an IPv6-only or dual-stack cluster):
two real instances on a real etcd forward to each other at the `[::1]:port` their records
give, and the probes, /prestop and /metrics answer on IPv6 as the kubelet and Prometheus call them."""

from __future__ import annotations

import json
import socket
import urllib.request

import grpc
import pytest

from meshd.kv.embedded import EmbeddedEtcd
from meshd.net.listen import ipv6_available
from meshd.runtimes.models import GeneratedModel
from meshd.testing.cluster import LocalMesh
from meshd.testing.procs import free_ports, wait_until

from .conftest import Client, NodeFactory, close_enough, expected
from .test_instance_record import read
from .test_mesh import ROWS, copies, load_on

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ipv6_available(), reason="no IPv6 on this host"),
]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except OSError:  # refused, reset, or an HTTPError (its code is in the message we do not need)
        return 0, b""


def _ipv6_node(start_node: NodeFactory, instance_id: str) -> tuple[Client, int, int, int]:
    probe, prestop, metrics = free_ports(3)
    settings: dict[str, str | int] = {
        "probe_port": probe,
        "prestop_port": prestop,
        "metrics": f"prometheus:port={metrics}",
    }
    client = start_node(instance_id, settings=settings)
    # Ready (the record published) as the kubelet sees it: at the pod IP.
    wait_until(lambda: _get(f"http://[::1]:{probe}/ready")[0] == 200, 30, f"{instance_id} ready on [::1]")
    return client, probe, prestop, metrics


@pytest.mark.both_data_planes
def test_two_instances_on_an_ipv6_pod_ip_forward_and_answer_probes_on_it(
    start_node: NodeFactory,
    mesh: LocalMesh,
    etcd_server: EmbeddedEtcd,
    models: list[GeneratedModel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("MESHD_ADVERTISE_HOST", "POD_IP"):  # these would come before the pod IP
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WKUBE_POD_IPADDR", "::1")  # the controller's env: the pod IP
    (a, _, _, _), (b, probe, prestop, metrics) = (_ipv6_node(start_node, i) for i in ("inst-a", "inst-b"))

    for c in (a, b):  # the address peers dial, in brackets: `::1:port` names no port to grpc
        kv = read(etcd_server, f"/tas-runtime/{mesh.service}/instances/{c.node.instance_id}")
        assert kv is not None and json.loads(kv.value)["loc"] == f"[::1]:{c.node.peer_port}"

    m = models[0]
    a.register(m)
    load_on(a, m.id)
    assert close_enough(b.infer(m.id, ROWS), expected(m, ROWS))
    # Forwarded to a's copy at [::1]: b neither loaded one nor found a unreachable.
    assert a.runtime_loaded() == [m.id] and b.runtime_loaded() == []
    assert copies(b, m.id) == {"inst-a"}
    with grpc.insecure_channel(f"[::1]:{b.node.grpc_port}") as ch:  # the external port, on IPv6 too
        assert grpc.channel_ready_future(ch).result(timeout=10) is None

    assert _get(f"http://[::1]:{probe}/live") == (200, b"OK\n")
    status, body = _get(f"http://[::1]:{metrics}/metrics")
    assert status == 200 and b"modelmesh_" in body
    assert _get(f"http://127.0.0.1:{probe}/ready")[0] == 200  # IPv4 still answers: one dual-stack socket

    # A runtime container's preStop hook at the pod IP: b drains and stops.
    status, body = _get(f"http://[::1]:{prestop}/prestop")
    assert status == 200 and body.startswith(b"STOPPED"), body
    wait_until(lambda: not b.node.meshd.alive(), 30, "inst-b to exit after /prestop")
    with socket.socket(socket.AF_INET6) as s:
        assert s.connect_ex(("::1", probe)) != 0
