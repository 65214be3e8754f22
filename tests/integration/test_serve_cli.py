"""`meshd serve` on its embedded default etcd, its start-up errors, and `meshd demo`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc
from meshd.config import env_for
from meshd.kv.embedded import EmbeddedEtcd
from meshd.runtimes.models import generate_models
from meshd.testing.cluster import LocalMesh
from meshd.testing.procs import Children, free_port, port_open, wait_until

pytestmark = pytest.mark.slow


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_embedded_etcd_keeps_records_across_restarts_and_stops_with_meshd(tmp_path: Path, stop_signal: int) -> None:
    """Stopped or killed (-9: an OOM kill), meshd takes its etcd with it, and the next meshd's
    etcd gets the data directory (a leftover one would hold its lock) with the records in it."""
    model = generate_models(tmp_path / "models", 1)[0]
    with LocalMesh(tmp_path) as mesh, Children(tmp_path / "logs") as procs:
        _, runtime_port = mesh.start_runtime("runtime")
        grpc_port = free_port()
        env = env_for(
            {
                "kv_store": "",
                "grpc_port": grpc_port,
                "peer_port": free_port(),
                "http_port": "disabled",
                "runtime_port": runtime_port,
                "data_dir": str(tmp_path / "data"),
                "instance_id": "solo",
                "metrics": "disabled",  # port 2112 may be in use on a shared host
                "drain_grace_ms": 0,  # SIGTERM below: no wait for load balancers
                "probe_port": "disabled",  # and 8089, 8090
                "prestop_port": "disabled",
            }
        )
        etcd_pids: list[int] = []
        try:
            for run in range(2):
                meshd = procs.start(f"meshd-{run}", [sys.executable, "-m", "meshd", "serve"], env)
                wait_until(lambda m=meshd: port_open(grpc_port) or not m.alive(), 60, "meshd to serve")  # type: ignore[misc]
                assert meshd.alive(), meshd.log_tail()
                # The port opens before start-up ends; a SIGTERM before then has nothing to drain
                # and says so instead (seen once in a full suite run): stop it once it is ready.
                wait_until(
                    lambda m=meshd: "meshd solo ready:" in m.log_path.read_text() or not m.alive(),  # type: ignore[misc]
                    60,
                    "meshd to say it is ready",
                )
                found = re.search(r"embedded etcd pid (\d+)", meshd.log_path.read_text())
                assert found, meshd.log_tail()
                etcd_pids.append(int(found.group(1)))  # until seen gone
                with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
                    stub = mm_grpc.ModelMeshStub(ch)
                    if run == 0:
                        info = mm.ModelInfo(type="demo", path=str(model.path))
                        stub.registerModel(mm.RegisterModelRequest(modelId=model.id, modelInfo=info), timeout=30)
                    # Second run: the record written by the first is still there.
                    status = stub.getModelStatus(mm.GetStatusRequest(modelId=model.id), timeout=10).status
                    assert status == mm.ModelStatusInfo.NOT_LOADED
                assert (tmp_path / "data" / "etcd-url").read_text().startswith("http://127.0.0.1:")  # for --join
                code = meshd.stop(sig=stop_signal)
                assert code == (0 if stop_signal == signal.SIGTERM else -signal.SIGKILL), meshd.log_tail()
                if stop_signal == signal.SIGTERM:  # a drain says it started, how long it may take, and its end
                    log = meshd.log_path.read_text()
                    assert "SIGTERM: draining for up to 30 s (SHUTDOWN_TIMEOUT_MS)" in log, meshd.log_tail()
                    assert re.search(r"meshd solo stopped \([\d.]+ s after the signal\)", log), meshd.log_tail()
                    assert not (tmp_path / "data" / "etcd-url").exists(), "its etcd is gone: so is its address"
                wait_until(lambda: not pid_alive(etcd_pids[-1]), 15, "the embedded etcd to stop")
                etcd_pids.pop()  # gone: its pid may be anyone's now
        finally:  # an etcd that outlived its meshd (the failure this test looks for) is stopped too
            for pid in etcd_pids:
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)
        assert (tmp_path / "data" / "etcd").is_dir()


def run_meshd(args: list[str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshd", *args], capture_output=True, text=True, timeout=timeout_s)


def test_bad_flag_value_is_a_clear_cli_error() -> None:
    done = run_meshd(["serve", "--grpc-port", "abc"])
    assert done.returncode == 2
    assert "MM_SVC_GRPC_PORT" in done.stderr and "Traceback" not in done.stderr


def test_unreachable_runtime_is_a_clear_start_up_error(etcd_server: EmbeddedEtcd, tmp_path: Path) -> None:
    args = ["serve", "--kv-store", f"etcd:{etcd_server.url}", "--runtime-port", str(free_port())]
    args += ["--runtime-ready-timeout-s", "2", "--grpc-port", "0", "--peer-port", "0", "--data-dir", str(tmp_path)]
    done = run_meshd(args)
    assert done.returncode == 1
    assert "not READY" in done.stderr and "Traceback" not in done.stderr


def test_demo_runs_and_prints_its_summary() -> None:
    done = run_meshd(
        ["demo", "--requests", "80", "--models", "4", "--cache-models", "2", "--load-delay-ms", "20"], timeout_s=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for line in ("meshd demo summary", "wrong answers    0", "errors           0", "evictions", "latency p99"):
        assert line in done.stdout, done.stdout
    assert "stopped every process the demo started" in done.stdout


def _started_at(pid: int) -> str | None:
    """The process's start time (clock ticks after boot): with its pid, who it is."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]


def test_a_demo_killed_outright_leaves_nothing_running(tmp_path: Path) -> None:
    """A newcomer's demo killed (or its terminal closed) takes etcd, the runtime and meshd with it."""
    argv = ["demo", "--instances", "1", "--requests", "1000000", "--workdir", str(tmp_path)]
    demo = subprocess.Popen(
        [sys.executable, "-m", "meshd", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    started: dict[int, str | None] = {}
    try:
        assert demo.stdout is not None
        for line in demo.stdout:  # the demo prints each process it starts
            started.update((int(p), _started_at(int(p))) for p in re.findall(r"pid (\d+)", line))
            if "runtime pid" in line:
                break
        assert len(started) == 3, started  # etcd, meshd, runtime
        demo.kill()
        demo.wait(10)
        for pid in started:
            wait_until(lambda p=pid: not pid_alive(p), 15, f"process {pid} to die with the demo")  # type: ignore[misc]
    finally:
        demo.kill()
        demo.wait()
        for pid, at in started.items():  # left by the failure this test looks for (the same process)
            if at is not None and pid_alive(pid) and _started_at(pid) == at:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def test_a_lone_idle_instance_stops_at_once_and_one_with_a_peer_keeps_its_grace(
    etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    """The drain grace keeps the ports open after NOT_SERVING so a load balancer can move the
    clients to other instances (issue 15). With no other instance and no request coming there
    is nothing to wait for: the instance stops at once, not after the grace (issue 45: every
    stop of the quickstart took 10 s). With a peer, the grace runs as before."""
    long_grace: dict[str, str | int] = {"drain_grace_ms": 60_000, "shutdown_timeout_ms": 90_000}
    with LocalMesh(tmp_path / "lone", service=f"lone-{tmp_path.name}") as mesh:
        mesh.etcd_url = etcd_server.url
        lone = mesh.add_node("lone", settings=long_grace)
        lone.meshd.send_signal(signal.SIGTERM)
        try:
            lone.meshd.proc.wait(30)  # before: the ports stayed open for the whole 60 s grace
        except subprocess.TimeoutExpired:
            pytest.fail(f"a lone idle meshd still running 30 s after SIGTERM:\n{lone.meshd.log_tail()}")
        assert lone.meshd.proc.returncode == 0, lone.meshd.log_tail()
        log = lone.meshd.log_path.read_text()
        assert "only while requests keep arriving" in log and "meshd lone stopped (" in log, log
    with LocalMesh(tmp_path / "pair", service=f"pair-{tmp_path.name}") as mesh:
        mesh.etcd_url = etcd_server.url
        a = mesh.add_node("a", settings={"drain_grace_ms": 4000})
        mesh.add_node("b")
        wait_until(lambda: "b" in _instance_ids(a.target), 30, "a to see b")
        a.meshd.send_signal(signal.SIGTERM)
        wait_until(lambda: "draining for up to" in a.meshd.log_path.read_text(), 30, "the drain to begin")
        time_in_grace = 2.0  # of its 4 s: its clients may still be on their way
        with contextlib.suppress(subprocess.TimeoutExpired):
            a.meshd.proc.wait(time_in_grace)
        assert a.meshd.alive() and port_open(a.grpc_port), a.meshd.log_tail()
        a.meshd.proc.wait(60)
        assert a.meshd.proc.returncode == 0, a.meshd.log_tail()


def _instance_ids(target: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-m", "meshd", "instances", "list", "--json", "--address", target],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        return set()
    return {i["instanceId"] for i in json.loads(out.stdout)["instances"]}
