"""`meshd serve` refuses to start, with one line and before it changes anything, when a
port it would listen on is taken or its instance id is held by a live instance; stops
when signalled while it waits for its runtime; finds a wrong serving port at start-up."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from meshd.config import env_for
from meshd.runtimes.models import GeneratedModel
from meshd.testing.cluster import LocalMesh
from meshd.testing.procs import Child, free_port, wait_until
from tests.integration.conftest import Client, NodeFactory

pytestmark = pytest.mark.slow
EXIT_WAIT_S = 120  # a refused start exits long before; an unrefused one never does


def start_second(mesh: LocalMesh, name: str, settings: dict[str, str | int]) -> Child:
    """A `meshd serve` on the mesh's etcd with free ports, unless `settings` say otherwise."""
    base: dict[str, str | int] = {
        "service_name": mesh.service,
        "kv_store": f"etcd:{mesh.etcd_url}",
        "instance_id": name,
        "grpc_port": free_port(),
        "peer_port": free_port(),
        "http_port": free_port(),
        "metrics": "disabled",
        "data_dir": str(mesh.workdir / name),
    }
    return mesh.children.start(name, [sys.executable, "-m", "meshd", "serve"], env_for({**base, **settings}))


def exit_code(child: Child) -> int:
    try:
        return child.proc.wait(EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{child.name} did not stop:\n{child.log_tail()}")


@pytest.mark.parametrize(
    ("taken", "setting"),
    [
        ("grpc_port", "MM_SVC_GRPC_PORT"),
        ("peer_port", "MESHD_PEER_PORT"),
        ("http_port", "MESHD_HTTP_PORT"),
        ("instance_id", "MESHD_INSTANCE_ID"),
    ],
)
def test_a_second_meshd_on_a_taken_port_or_live_id_changes_nothing(
    taken: str, setting: str, mesh: LocalMesh, start_node: NodeFactory, models: list[GeneratedModel]
) -> None:
    a: Client = start_node("inst-a")
    model = models[0]
    a.register(model, loadNow=True, sync=True)
    assert a.runtime_loaded() == [model.id]
    node = a.node
    held: dict[str, str | int] = {
        "grpc_port": node.grpc_port,
        "peer_port": node.peer_port,
        "http_port": node.http_port,
        "instance_id": node.instance_id,
    }
    # Pointed at the first one's runtime, as a mistaken copy of its settings would be.
    settings: dict[str, str | int] = {"runtime_port": node.runtime_port, taken: held[taken], "instance_ttl_s": 2}
    second = start_second(mesh, "inst-b", settings)
    assert exit_code(second) == 2, second.log_tail()
    out = second.log_path.read_text()
    assert "Traceback" not in out, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("meshd serve: ") and setting in last, out
    # Nothing changed: the runtime kept its copy, the first instance its record and port.
    assert a.runtime_loaded() == [model.id]
    assert a.status(model.id).status == a.status(model.id).LOADED
    assert a.stats().instanceId == node.instance_id and node.meshd.alive()


def test_signals_stop_meshd_while_it_waits_for_its_runtime(mesh: LocalMesh) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        no_runtime = free_port()
        child = start_second(mesh, f"waiting-{sig.name}", {"runtime_port": no_runtime, "runtime_ready_timeout_s": 3600})
        wait_until(lambda c=child: "waiting for runtime" in c.log_path.read_text() or not c.alive(), 60, "the wait")  # type: ignore[misc]
        child.send_signal(sig)
        assert exit_code(child) == 0, child.log_tail()
        assert "Traceback" not in child.log_path.read_text()


def test_a_serving_port_nothing_answers_on_stops_start_up(mesh: LocalMesh) -> None:
    _, runtime_port = mesh.start_runtime("runtime")
    child = start_second(mesh, "wrong-serving", {"runtime_port": runtime_port, "serving_port": free_port()})
    assert exit_code(child) == 1, child.log_tail()
    out = child.log_path.read_text()
    assert "INTERNAL_SERVING_GRPC_PORT" in out.strip().splitlines()[-1] and "Traceback" not in out, out


def test_a_native_data_plane_whose_haproxy_fails_stops_start_up_before_the_runtime_is_touched(
    mesh: LocalMesh, start_node: NodeFactory, models: list[GeneratedModel], tmp_path: Path
) -> None:
    a: Client = start_node("inst-a")
    model = models[0]
    a.register(model, loadNow=True, sync=True)
    broken = tmp_path / "haproxy"
    broken.write_text("#!/bin/sh\necho 'not an haproxy' >&2\nexit 3\n")
    broken.chmod(0o755)
    # Pointed at the first one's runtime: a start that went on would make it purge its copies.
    settings: dict[str, str | int] = {
        "runtime_port": a.node.runtime_port,
        "data_plane": "native",
        "haproxy": str(broken),
    }
    second = start_second(mesh, "inst-b", settings)
    assert exit_code(second) == 2, second.log_tail()
    out = second.log_path.read_text()
    assert "Traceback" not in out, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("meshd serve: MESHD_DATAPLANE=native:") and "not an haproxy" in last, out
    assert a.runtime_loaded() == [model.id]
