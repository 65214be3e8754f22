"""The only holder of a model capped at one copy dies (SIGKILL) or freezes (SIGSTOP) while
its lease, and so its instance record, is still valid (issue 15, fault 1): the instances
that find it unreachable load the model elsewhere and every request is served."""

from __future__ import annotations

import signal
import time

import pytest

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.runtimes.models import GeneratedModel
from meshd.testing.procs import wait_until

from ..conftest import lost_in_flight
from .conftest import WAIT_S, FaultMesh, Traffic, answers, listed_instances, load_on

pytestmark = [pytest.mark.slow, pytest.mark.both_data_planes]

MAX_ONE = '{"meshd": {"max_copies": 1}}'
# A lease far longer than the fault: the dead holder's record stays live in every mirror
# throughout, so only the data path can tell it is gone.
SETTINGS: dict[str, str | int] = {"instance_ttl_s": 30, "scaleup_rpm_threshold": 1_000_000}
FAULT_S = 4.0


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_capped_model_is_served_while_its_dead_holder_still_has_a_record(
    fault_mesh: FaultMesh, models: list[GeneratedModel], fault: str, data_plane: str
) -> None:
    a, b, c = (fault_mesh.add(f"inst-{n}", settings=SETTINGS) for n in "abc")
    names = {"inst-a", "inst-b", "inst-c"}
    for node in (a, b, c):
        wait_until(answers(lambda node=node: listed_instances(node) == names), WAIT_S, "all live")
    capped = models[:3]
    for m in capped:
        info = mm.ModelInfo(type="demo", path=str(m.path), key=MAX_ONE)
        a.mm.registerModel(mm.RegisterModelRequest(modelId=m.id, modelInfo=info), timeout=30)
        load_on(c, m.id)  # c holds every capped model; a and b forward to it

    with Traffic([a, b], capped) as traffic:
        time.sleep(1.0)
        if fault == "kill":
            c.node.meshd.kill()
            c.node.runtime.kill()
        else:
            c.node.meshd.send_signal(signal.SIGSTOP)
        try:
            time.sleep(FAULT_S)
            served_during = traffic.successes
        finally:
            if fault == "freeze":
                c.node.meshd.send_signal(signal.SIGCONT)
    # One client thread per ingress: at most one request each was in flight to c at the kill,
    # which the native data plane answers UNAVAILABLE (REFUSED_STREAM) instead of rerouting.
    lost = lost_in_flight(data_plane, traffic.failures, in_flight=2)
    assert not lost, f"{len(traffic.failures)} failed: {traffic.failures[:3]}"
    assert served_during > 0
    assert listed_instances(a) >= {"inst-a", "inst-b"}
