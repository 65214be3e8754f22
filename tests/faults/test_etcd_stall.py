"""etcd frozen (SIGSTOP) for longer than the instance leases, then resumed (issue 15, faults
2 and 3): every instance record expires at once and comes back one by one. Forwarded calls
between instances that do not yet see each other again are rerouted, never answered
INVALID_ARGUMENT, and a model capped at one copy is never loaded by a second runtime."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.runtimes.models import GeneratedModel
from meshd.testing.procs import wait_until

from .conftest import WAIT_S, FaultMesh, Traffic, answers, listed_instances, load_on

pytestmark = pytest.mark.slow

MAX_ONE = '{"meshd": {"max_copies": 1}}'
SETTINGS: dict[str, str | int] = {
    "instance_ttl_s": 2,
    "janitor_ms": 500,
    "rate_check_ms": 500,
    "scaleup_rpm_threshold": 1_000_000,
}
STALL_S = 5.0  # over twice the lease TTL
AFTER_S = 5.0  # traffic once etcd is back: the records return one by one


def test_etcd_stall_past_the_leases_loses_no_request_and_keeps_max_copies(
    fault_mesh: FaultMesh, models: list[GeneratedModel]
) -> None:
    nodes = [fault_mesh.add(f"inst-{n}", settings=SETTINGS) for n in "abc"]
    names = {c.node.instance_id for c in nodes}
    for node in nodes:
        wait_until(answers(lambda node=node: listed_instances(node) == names), WAIT_S, "all live")
    capped = models[:3]
    for node, m in zip(nodes, capped, strict=True):
        info = mm.ModelInfo(type="demo", path=str(m.path), key=MAX_ONE)
        nodes[0].mm.registerModel(mm.RegisterModelRequest(modelId=m.id, modelInfo=info), timeout=30)
        load_on(node, m.id)  # one each: two of three requests cross to a peer

    over: list[str] = []
    stop = threading.Event()

    def observe() -> None:  # how many runtimes hold each capped model, every 0.2 s
        while not stop.wait(0.2):
            held: dict[str, list[str]] = {}
            for c in nodes:
                try:
                    for name in c.runtime_loaded():
                        held.setdefault(name, []).append(c.node.instance_id)
                except grpc.RpcError:
                    continue
            over.extend(f"{m.id} on {held[m.id]}" for m in capped if len(held.get(m.id, ())) > 1)

    observer = threading.Thread(target=observe, daemon=True)
    etcd = fault_mesh.mesh.etcd
    assert etcd is not None and etcd.pid is not None
    with Traffic(nodes, capped) as traffic:
        observer.start()
        time.sleep(1.0)
        etcd_pid = etcd.pid
        os.kill(etcd_pid, signal.SIGSTOP)
        try:
            time.sleep(STALL_S)
        finally:
            os.kill(etcd_pid, signal.SIGCONT)
        for node in nodes:  # every record back (each instance re-registers)
            wait_until(answers(lambda node=node: listed_instances(node) == names), WAIT_S, "records back")
        time.sleep(AFTER_S)
        stop.set()
        observer.join(30)
    assert not traffic.failures, f"{len(traffic.failures)} failed: {sorted(set(traffic.failures))[:5]}"
    assert not over, f"{len(over)} samples over max copies: {over[:5]}"
