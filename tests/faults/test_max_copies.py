"""Two instances asked at the same moment for a cold model capped at one copy: exactly one
runtime loads it (the other instance's load is refused in the registry's compare-and-set)
and every request is served, through the copy that won."""

from __future__ import annotations

import threading

import grpc
import pytest

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.runtimes.models import GeneratedModel
from meshd.testing.procs import wait_until

from ..integration.conftest import Client, close_enough, expected
from .conftest import ROWS, WAIT_S, FaultMesh, answers, listed_instances

pytestmark = [pytest.mark.slow, pytest.mark.both_data_planes]

MAX_ONE = '{"meshd": {"max_copies": 1}}'
PER_INSTANCE = 4  # concurrent cold requests per model through each instance


def test_concurrent_cold_requests_through_two_instances_load_a_max_one_model_once(
    fault_mesh: FaultMesh, models: list[GeneratedModel]
) -> None:
    a, b = fault_mesh.add("inst-a"), fault_mesh.add("inst-b")
    for c in (a, b):
        wait_until(answers(lambda c=c: listed_instances(c) == {"inst-a", "inst-b"}), WAIT_S, "both instances live")
    for m in models:  # without placement by registration: the requests load them
        info = mm.ModelInfo(type="demo", path=str(m.path), key=MAX_ONE)
        a.mm.registerModel(mm.RegisterModelRequest(modelId=m.id, modelInfo=info), timeout=30)
    wait_until(lambda: set(fault_mesh.records()) == {m.id for m in models}, WAIT_S, "records")

    failures: list[str] = []
    lock = threading.Lock()
    senders = [(c, m) for m in models for c in (a, b) for _ in range(PER_INSTANCE)]
    start = threading.Barrier(len(senders))

    def send(c: Client, m: GeneratedModel) -> None:
        start.wait(WAIT_S)  # every model cold, asked through both instances at once
        try:
            ok = close_enough(c.infer(m.id, ROWS), expected(m, ROWS))
            error = "" if ok else "wrong answer"
        except grpc.RpcError as e:
            ok, error = False, f"{e.code().name}: {e.details()}"
        if not ok:
            with lock:
                failures.append(f"{c.node.instance_id} {m.id}: {error}")

    threads = [threading.Thread(target=send, args=s, daemon=True) for s in senders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads)
    assert not failures, failures[:5]

    records = fault_mesh.records()
    held = {c.node.instance_id: set(c.runtime_loaded()) for c in (a, b)}
    for m in models:
        loaded_in = sorted(iid for iid, names in held.items() if m.id in names)
        assert len(loaded_in) == 1, f"{m.id} loaded in {loaded_in}"
        assert sorted(records[m.id]["instanceIds"]) == loaded_in
