"""etcd frozen (SIGSTOP) for longer than the instance leases, then resumed (issue 15, faults
2 and 3): every instance record expires at once and comes back one by one. Forwarded calls
between instances that do not yet see each other again are rerouted, never answered
INVALID_ARGUMENT, and a model capped at one copy is never loaded by a second runtime.

What makes the window visible: an instance re-registers when its keep-alive learns that
its lease is gone. A keep-alive in flight during the freeze (bounded by the store's 5 s
call deadline) is answered the moment etcd revokes the leases, so with short leases
(TTL/3 between keep-alives, well under 5 s) every instance is waiting on one and all come
back within milliseconds of each other. With a 12 s lease the keep-alives are 4 s apart,
longer than the idle part of the 5 s call: an instance asleep between two keep-alives
when etcd resumes comes back up to 4 s after one that was waiting, and for that time its
peers see no record for it (fault 3: its capped models look unheld) while it sees theirs
(fault 2: it forwards to peers that do not yet see it). Twenty models, nine of them capped,
under traffic through all three instances, so requests cross in both directions."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.runtimes.models import GeneratedModel, generate_models
from meshd.testing.procs import wait_until

from ..integration.conftest import MODEL_SIZE
from .conftest import WAIT_S, FaultMesh, Traffic, answers, listed_instances, load_on

pytestmark = [pytest.mark.slow, pytest.mark.both_data_planes]

MAX_ONE = '{"meshd": {"max_copies": 1}}'
TTL_S = 12
SETTINGS: dict[str, str | int] = {
    "instance_ttl_s": TTL_S,
    "janitor_ms": 500,
    "rate_check_ms": 500,
    "scaleup_rpm_threshold": 1_000_000,
}
STALL_S = TTL_S + 3.0  # every lease expires while etcd is frozen
AFTER_S = 6.0  # traffic once etcd is back: the records return one by one
MODELS, CAPPED = 20, 9


def test_etcd_stall_past_the_leases_loses_no_request_and_keeps_max_copies(
    fault_mesh: FaultMesh, tmp_path: Path
) -> None:
    nodes = [fault_mesh.add(f"inst-{n}", settings=SETTINGS, capacity_models=MODELS) for n in "abc"]
    names = {c.node.instance_id for c in nodes}
    for node in nodes:
        wait_until(answers(lambda node=node: listed_instances(node) == names), WAIT_S, "all live")
    models = generate_models(tmp_path / "many", MODELS, size_bytes=MODEL_SIZE)
    capped = models[:CAPPED]
    for i, m in enumerate(models):
        info = mm.ModelInfo(type="demo", path=str(m.path), key=MAX_ONE if i < CAPPED else "")
        nodes[0].mm.registerModel(mm.RegisterModelRequest(modelId=m.id, modelInfo=info), timeout=30)
    for i, m in enumerate(capped):
        load_on(nodes[i % 3], m.id)  # three each: two of three requests for them cross to a peer

    over: list[tuple[float, str]] = []
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
            now = time.monotonic()
            over.extend((now, f"{m.id} on {held[m.id]}") for m in capped if len(held.get(m.id, ())) > 1)

    observer = threading.Thread(target=observe, daemon=True)
    etcd = fault_mesh.mesh.etcd
    assert etcd is not None and etcd.pid is not None
    with Traffic(nodes + nodes, models) as traffic:
        time.sleep(2.0)  # every uncapped model loaded somewhere
        failed_before = len(traffic.failures)
        observer.start()
        etcd_pid = etcd.pid
        os.kill(etcd_pid, signal.SIGSTOP)
        try:
            time.sleep(STALL_S)
        finally:
            os.kill(etcd_pid, signal.SIGCONT)
        resumed = time.monotonic()
        for node in nodes:  # every record back (each instance re-registers)
            wait_until(answers(lambda node=node: listed_instances(node) == names), WAIT_S, "records back")
        time.sleep(AFTER_S)
        stop.set()
        observer.join(30)
    failed = traffic.failures
    codes = sorted({f.split(": ")[1] for f in failed})
    span = f"{min(traffic.failed_at) - resumed:+.1f}..{max(traffic.failed_at) - resumed:+.1f} s" if failed else "-"
    over_span = f"{over[0][0] - resumed:+.1f}..{over[-1][0] - resumed:+.1f} s" if over else "-"
    print(
        f"\nserved {traffic.successes}; failed {len(failed)} ({failed_before} before the stall) {codes}, "
        f"from resume {span}; samples over max copies {len(over)} ({len({o for _, o in over})} distinct), "
        f"from resume {over_span}"
    )
    assert not failed, f"{len(failed)} failed: {sorted(set(failed))[:5]}"
    assert not over, f"{len(over)} samples over max copies: {[o for _, o in over[:5]]}"


def test_register_model_while_etcd_is_frozen_answers_unavailable_at_once(fault_mesh: FaultMesh, tmp_path: Path) -> None:
    """Issue 15, item 5: a frozen etcd answers nothing, so a write used to wait out the
    store's 5 s deadline; it now gives up as soon as the store is seen not answering
    (kv.health). The answer says so rather than DEADLINE_EXCEEDED (the time is printed,
    not asserted)."""
    node = fault_mesh.add("inst-a", settings={"instance_ttl_s": 30})
    m0, m1 = generate_models(tmp_path / "reg", 2, size_bytes=MODEL_SIZE)

    def register(m: GeneratedModel) -> None:
        info = mm.ModelInfo(type="demo", path=str(m.path), key="")
        node.mm.registerModel(mm.RegisterModelRequest(modelId=m.id, modelInfo=info), timeout=30)

    register(m0)
    etcd = fault_mesh.mesh.etcd
    assert etcd is not None and etcd.pid is not None
    etcd_pid = etcd.pid
    os.kill(etcd_pid, signal.SIGSTOP)
    took: list[float] = []
    try:
        for _ in range(2):  # the first call itself shows the stall; the second finds it known
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                register(m1)
            took.append(time.monotonic() - start)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert "etcd is not answering" in (err.value.details() or "")
    finally:
        os.kill(etcd_pid, signal.SIGCONT)
    print(f"\nregisterModel against a frozen etcd answered UNAVAILABLE in {took[0]:.2f} s, then {took[1]:.2f} s")
    wait_until(answers(lambda: register(m1) is None), WAIT_S, "registers once etcd is back")
