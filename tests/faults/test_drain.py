"""SIGTERM (issue 15, fault 4): health says NOT_SERVING at once, yet the ports keep accepting
and serving for `MESHD_DRAIN_GRACE_MS` (load balancers and probes act only seconds later),
then the requests in flight finish and the process exits by itself."""

from __future__ import annotations

import signal
import time

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshd.runtimes.models import GeneratedModel
from meshd.testing.procs import wait_until

from .conftest import WAIT_S, FaultMesh, Traffic, answers, listed_instances, load_on

pytestmark = [pytest.mark.slow, pytest.mark.both_data_planes]

GRACE_MS = 4000
SETTINGS: dict[str, str | int] = {"drain_grace_ms": GRACE_MS, "scaleup_rpm_threshold": 1_000_000}
SERVED_AFTER_S = 1.5  # well inside the grace: traffic stops here, the port must still serve


def test_sigterm_keeps_serving_through_the_drain_grace_after_not_serving(
    fault_mesh: FaultMesh, models: list[GeneratedModel]
) -> None:
    a, b = (fault_mesh.add(f"inst-{n}", settings=SETTINGS) for n in "ab")
    for node in (a, b):
        wait_until(answers(lambda node=node: listed_instances(node) == {"inst-a", "inst-b"}), WAIT_S, "live")
    here, moved = models[0], models[1]
    for m in (here, moved):
        a.register(m)
    load_on(a, here.id)
    load_on(b, moved.id)  # forwarded from a throughout
    health = health_pb2_grpc.HealthStub(a.channel)

    def not_serving() -> bool:
        resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return bool(resp.status == health_pb2.HealthCheckResponse.NOT_SERVING)

    with Traffic([a], [here, moved]) as traffic:
        time.sleep(0.5)
        a.node.meshd.send_signal(signal.SIGTERM)
        wait_until(not_serving, WAIT_S, "NOT_SERVING")
        before = traffic.successes
        time.sleep(SERVED_AFTER_S)
        after = traffic.successes
    assert not traffic.failures, f"{len(traffic.failures)} failed: {sorted(set(traffic.failures))[:5]}"
    assert after > before, "nothing served after NOT_SERVING"
    assert a.node.meshd.proc.wait(WAIT_S) == 0, a.node.meshd.log_tail()
