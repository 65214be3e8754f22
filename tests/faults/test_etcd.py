"""etcd outages against a running mesh: serving goes on from the mirrors, writes fail fast
with UNAVAILABLE, and once etcd is back (same data, same port) everything converges
without restarting meshd, with no watched change missed."""

from __future__ import annotations

import time

import grpc
import pytest

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.runtimes.models import GeneratedModel
from meshd.testing.procs import wait_until

from ..integration.conftest import close_enough, expected
from .conftest import (
    ROWS,
    WAIT_S,
    FaultMesh,
    Traffic,
    active_of,
    answers,
    listed_instances,
    listed_models,
    load_on,
)

pytestmark = [pytest.mark.slow, pytest.mark.both_data_planes]

ETCD_DOWN_S = 30.0  # issue 8: "etcd down for 30 s under traffic"
TTL = {"instance_ttl_s": 5}  # shorter than the outage: leases must survive it all the same


def test_etcd_down_30s_under_traffic_serves_fails_writes_fast_and_converges(
    fault_mesh: FaultMesh, models: list[GeneratedModel]
) -> None:
    a, b, c = (fault_mesh.add(f"inst-{n}", settings=TTL) for n in "abc")
    nodes = [a, b, c]
    served_models = models[:3]
    for m in served_models:
        a.register(m)
    for node, m in zip(nodes, served_models, strict=True):
        load_on(node, m.id)  # one copy each: two of three requests cross to a peer
    late = models[3]

    with Traffic(nodes, served_models) as traffic:
        time.sleep(1.0)
        fault_mesh.etcd_stop()
        outage_ends = time.monotonic() + ETCD_DOWN_S
        # Registration needs etcd: a clear UNAVAILABLE, not a hang until the client's deadline.
        for node in nodes:
            with pytest.raises(grpc.RpcError) as err:
                node.register(late)  # the helper's deadline is 30 s
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
            assert "registry unavailable" in (err.value.details() or ""), err.value.details()
        # Reads come from the mirrors: status still answers LOADED everywhere.
        for node in nodes:
            for m in served_models:
                assert node.status(m.id).status == mm.ModelStatusInfo.LOADED
        time.sleep(max(0.0, outage_ends - time.monotonic()))
        fault_mesh.etcd_start()
        # Writes work again (once the client has reconnected), without restarting meshd.
        wait_until(answers(lambda: a.register(late).status != mm.ModelStatusInfo.NOT_FOUND), WAIT_S, "a registration")
        time.sleep(1.0)  # traffic keeps going after the return too
    assert not traffic.failures, traffic.failures[:5]
    assert all(traffic.served[n.node.instance_id] > 10 for n in nodes), traffic.served

    # Every instance sees the record written after the return (watches resumed) ...
    for node in nodes:
        wait_until(answers(lambda node=node: late.id in listed_models(node)), WAIT_S, f"{node.node.instance_id} mirror")
    # ... lists every instance (leases and records survived the outage) ...
    for node in nodes:
        wait_until(
            answers(lambda node=node: listed_instances(node) == {"inst-a", "inst-b", "inst-c"}),
            WAIT_S,
            "a complete instance list",
        )
    # ... and a load after the return is recorded and served through every instance.
    for node in nodes:
        assert close_enough(node.infer(late.id, ROWS), expected(late, ROWS))
    holders = set(fault_mesh.records()[late.id]["instanceIds"])
    assert len(holders) == 1 and late.id in next(n for n in nodes if n.node.instance_id in holders).runtime_loaded()


def test_etcd_restart_loses_no_watched_change(fault_mesh: FaultMesh, models: list[GeneratedModel]) -> None:
    a, b = fault_mesh.add("inst-a", settings=TTL), fault_mesh.add("inst-b", settings=TTL)
    nodes = [a, b]
    first, second, third = models[:3]
    for m in (first, second, third):
        a.register(m)
    a.mm.setVModel(mm.SetVModelRequest(vModelId="vm", targetModelId=first.id, force=True), timeout=30)
    for node in nodes:
        wait_until(answers(lambda node=node: active_of(node, "vm") == first.id), WAIT_S, "the vmodel everywhere")

    def record(i: int) -> dict[str, object]:
        return {"type": "demo", "mPath": f"/nowhere/{i}", "instanceIds": {}, "lu": 1}

    # A burst written straight to etcd (as another tool would) right before the stop ...
    before = {f"before-{i}": record(i) for i in range(10)}
    for item_id, rec in before.items():
        fault_mesh.put("registry", item_id, rec)
    fault_mesh.put("vmodels", "vm", {"o": "", "amid": second.id, "tmid": second.id})
    fault_mesh.delete("registry", "before-0")
    fault_mesh.etcd_stop()
    fault_mesh.etcd_start()
    # ... and right after the restart, while the instances' watches are still reconnecting.
    after = {f"after-{i}": record(i) for i in range(10)}
    for item_id, rec in after.items():
        fault_mesh.put("registry", item_id, rec)
    fault_mesh.put("vmodels", "vm", {"o": "", "amid": third.id, "tmid": third.id})
    fault_mesh.delete("registry", "after-0")  # deletions, on both sides of the restart

    wanted = {first.id, second.id, third.id, *before, *after} - {"before-0", "after-0"}
    for node in nodes:
        wait_until(answers(lambda node=node: listed_models(node) == wanted), WAIT_S, "every change in each mirror")
        wait_until(answers(lambda node=node: active_of(node, "vm") == third.id), WAIT_S, "the last vmodel change")
    assert fault_mesh.records().keys() == wanted
