"""A runtime process killed under its meshd: its copies leave the records, requests are
served elsewhere, nothing reports a copy LOADED where no runtime holds it, and once a
runtime is back on that endpoint the instance takes loads again."""

from __future__ import annotations

import time

import pytest

from meshd._proto.meshd import admin_pb2, admin_pb2_grpc
from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.runtimes.models import GeneratedModel
from meshd.testing.procs import wait_until

from ..conftest import lost_in_flight
from ..integration.conftest import MODEL_SIZE, Client, close_enough, expected
from .conftest import ROWS, WAIT_S, FaultMesh, Traffic, answers, load_on

pytestmark = [pytest.mark.slow, pytest.mark.both_data_planes]

FAST = {"runtime_check_ms": 300}


def truthful(fault_mesh: FaultMesh, dead: set[str]) -> bool:
    """Every copy a record in etcd names, and every copy an instance reports LOADED, is in
    that instance's runtime (which reports what it really holds); a dead runtime holds none."""
    by_id = {c.node.instance_id: c for c in fault_mesh.clients}
    held = {iid: set() if iid in dead else set(c.runtime_loaded()) for iid, c in by_id.items()}
    for model_id, rec in fault_mesh.records().items():
        if any(model_id not in held[iid] for iid in rec["instanceIds"]):
            return False
        for c in fault_mesh.clients:
            if c.node.instance_id in dead:
                continue
            st = c.status(model_id)
            loaded = {x.location for x in st.modelCopyInfos if x.copyStatus == mm.ModelStatusInfo.LOADED}
            if any(model_id not in held[iid] for iid in loaded):
                return False
    return True


def test_killed_runtime_copies_leave_records_and_requests_go_elsewhere(
    fault_mesh: FaultMesh, models: list[GeneratedModel], data_plane: str
) -> None:
    a, b, c = (fault_mesh.add(f"inst-{n}", settings=FAST) for n in "abc")
    shared, only_a, on_c = models[:3]
    for m in (shared, only_a, on_c):
        a.register(m)
    for node, m in ((a, shared), (b, shared), (a, only_a), (c, on_c)):
        load_on(node, m.id)
    assert truthful(fault_mesh, set())

    with Traffic([a, b, c], [shared, only_a, on_c]) as traffic:
        time.sleep(0.5)
        a.node.runtime.kill()  # SIGKILL: meshd on a is told nothing
        # a's copies leave the records; the model only a held is loaded elsewhere.
        wait_until(
            answers(lambda: all("inst-a" not in r["instanceIds"] for r in fault_mesh.records().values())),
            WAIT_S,
            "the dead runtime's copies to leave the records",
        )
        wait_until(answers(lambda: bool(fault_mesh.records()[only_a.id]["instanceIds"])), WAIT_S, "a reload")
        time.sleep(1.0)
    # One client thread per instance: at most one request per thread was in flight at the kill.
    assert not lost_in_flight(data_plane, traffic.failures, in_flight=3), traffic.failures[:5]
    wait_until(answers(lambda: truthful(fault_mesh, {"inst-a"})), WAIT_S, "records and statuses to match runtimes")
    # Placement leaves a alone meanwhile: new loads go to instances whose runtime answers.
    fresh = models[3]
    a.register(fresh)
    assert close_enough(a.infer(fresh.id, ROWS), expected(fresh, ROWS))
    assert set(fault_mesh.records()[fresh.id]["instanceIds"]) <= {"inst-b", "inst-c"}
    # Operators see why: the listing says its runtime is down, not that it is draining.
    wait_until(answers(lambda: runtime_down(b, "inst-a")), WAIT_S, "inst-a listed with its runtime down")

    # A runtime back on the same endpoint: a serves from its own runtime again.
    args = ["--capacity-bytes", str(8 * MODEL_SIZE)]
    a.node.runtime, _ = fault_mesh.mesh.start_runtime("inst-a-runtime-2", args, port=a.node.runtime_port)
    again = models[4]
    a.register(again)
    wait_until(answers(lambda: _loads_here(a, again.id)), WAIT_S, "a to take loads again")
    wait_until(answers(lambda: not runtime_down(b, "inst-a")), WAIT_S, "inst-a listed as serving again")
    assert close_enough(b.infer(again.id, ROWS), expected(again, ROWS))
    wait_until(answers(lambda: truthful(fault_mesh, set())), WAIT_S, "records and statuses to match runtimes")


def runtime_down(c: Client, instance_id: str) -> bool:
    """admin listInstances as `c` answers it: `instance_id` stopped taking models for a dead runtime."""
    resp = admin_pb2_grpc.MeshAdminStub(c.channel).listInstances(admin_pb2.ListInstancesRequest(), timeout=10)
    listed = {i.instanceId: i for i in resp.instances}[instance_id]
    return bool(listed.shutdown and listed.runtimeDown)


def _loads_here(c: Client, model_id: str) -> bool:
    load_on(c, model_id)
    return model_id in c.runtime_loaded()


def test_runtime_stopped_gracefully_under_traffic_fails_nothing(
    fault_mesh: FaultMesh, models: list[GeneratedModel], data_plane: str
) -> None:
    """A runtime's gRPC server that is stopping (SIGTERM, as in a rollout) cancels the calls
    that reached it but no handler yet: those are sent to another copy, never answered
    CANCELLED. Then the runtime is gone (refused) and a's requests go to b's copies."""
    a, b, c = (fault_mesh.add(f"inst-{n}", settings=FAST) for n in "abc")
    shared = models[:2]
    for m in shared:
        a.register(m)
        load_on(a, m.id)
        load_on(b, m.id)
    # Several threads per instance, so that calls are arriving at a's runtime as it stops.
    clients = [a, a, a, a, b, c, c]
    with Traffic(clients, shared, pace_s=0.0) as traffic:
        time.sleep(0.5)
        assert a.node.runtime.stop() == 0  # SIGTERM: the runtime stops its server itself
        wait_until(
            answers(lambda: all("inst-a" not in r["instanceIds"] for r in fault_mesh.records().values())),
            WAIT_S,
            "the stopped runtime's copies to leave the records",
        )
        time.sleep(0.5)
    # a's threads and c's (c holds no copy and forwards to a or b) can each have one request at
    # a's runtime as it stops; b's thread is served by b's own copies.
    reaching_a = sum(1 for node in clients if node is not b)
    assert not lost_in_flight(data_plane, traffic.failures, in_flight=reaching_a), traffic.failures[:5]
    assert traffic.served["inst-a"] > 10


def test_killed_runtime_of_a_capped_models_holder_fails_no_request_through_the_others(
    fault_mesh: FaultMesh, models: list[GeneratedModel]
) -> None:
    """Found by the chaos soak (issue 34): the holder's runtime killed, a model capped at one
    copy was refused everywhere ("its max copies are on inst-a") until the runtime watch's
    third probe, up to 3 x MESHD_RUNTIME_CHECK_MS later. A call the runtime refuses now has
    it probed at once; the dead runtime's copies leave the records before the call is
    rerouted, so the capped model loads elsewhere at the first retry."""
    a, b, c = (fault_mesh.add(f"inst-{n}") for n in "abc")  # the default 5 s runtime checks
    capped = models[0]
    info = mm.ModelInfo(type="demo", path=str(capped.path), key='{"meshd": {"max_copies": 1}}')
    a.mm.registerModel(mm.RegisterModelRequest(modelId=capped.id, modelInfo=info), timeout=30)
    load_on(a, capped.id)
    with Traffic([b, c], [capped]) as traffic:
        time.sleep(0.5)
        a.node.runtime.kill()
        wait_until(
            answers(lambda: set(fault_mesh.records()[capped.id]["instanceIds"]) & {"inst-b", "inst-c"} != set()),
            WAIT_S,
            "the capped model reloaded elsewhere",
        )
        time.sleep(1.0)
    assert traffic.successes > 20
    assert not traffic.failures, traffic.failures[:5]
