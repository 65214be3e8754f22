"""meshd + `meshd adapter --server triton` + a real tritonserver (the `nvidia-pytriton` wheel, in
its own cached venv) serving Python-backend models: evictions with every answer checked,
ModelStreamInfer to a decoupled model, ModelConfig/ModelMetadata routed to a copy, the real
tritonclient (gRPC and HTTP) against meshd, and tritonserver SIGKILLed under traffic."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from meshd._proto.inference import grpc_predict_v2_pb2 as v2
from meshd._proto.inference import grpc_predict_v2_pb2_grpc as v2_grpc
from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc
from meshd.runtimes.models import DemoModel, GeneratedModel, decode_infer_response, generate_models
from meshd.runtimes.models import make_infer_request as make_request
from meshd.testing.cluster import LocalMesh
from meshd.testing.observers import ClientThreads
from meshd.testing.procs import Child, free_port, marked_pids, port_open, wait_until
from meshd.testing.triton import (
    TRITON_VERSION,
    TritonInstall,
    backend_directory,
    platform_problem,
    remove_shm,
    stub_pids,
    triton_command,
    triton_venv,
    write_python_model,
)
from meshd.testing.venvs import ensure_venv

from .conftest import close_enough

pytestmark = pytest.mark.slow

DECLARED_SIZE = 8 << 20  # each model says it takes 8 MiB ...
CAPACITY = 20 << 20  # ... and the server has room for two: four models force evictions
OVERHEAD = 256 << 20
REPEATS = 3  # responses per request from the decoupled model
MAX_BATCH = 8  # the decoupled model's max_batch_size (the others: 0, the proto's default)
ROWS = [[0.5, -1.0, 2.0, 0.25], [0.0, 0.0, 0.0, 0.0]]  # an all-zero row answers bias: which model served
CLIENTS = Path(__file__).resolve().parent / "clients"
ST = mm.ModelStatusInfo


@dataclass
class Model:
    id: str
    folder: Path
    rule: DemoModel

    def expected(self, rows: list[list[float]], k: int = 0) -> list[list[float]]:
        return [[v + k for v in row] for row in self.rule.predict(rows)]


@dataclass
class Stack:
    meshd: Child
    adapter: Child
    grpc_port: int
    http_port: int
    triton_port: int
    pid_file: Path
    shm_prefix: str
    models: list[Model]
    streaming: Model
    repository: Path

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")

    def triton_pid(self) -> int | None:
        """The running server's PID; None between servers (the supervisor removes the file)."""
        return read_pid(self.pid_file)


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> tuple[TritonInstall, Path]:
    problem = platform_problem()
    if problem is not None:  # a platform limit, not a failure: the wheels do not exist here
        pytest.skip(f"no Triton venv on this platform: {problem}")
    install = triton_venv()  # built on first use (~10 s), then cached under .venvs/
    return install, backend_directory(install, tmp_path_factory.mktemp("triton-backends"))


def test_platform_problem_names_what_is_missing() -> None:
    assert platform_problem("x86_64", ("glibc", "2.35"), (3, 11)) is None if sys.platform == "linux" else True
    assert "x86_64 only" in (platform_problem("aarch64", ("glibc", "2.39"), (3, 11)) or "")
    assert "glibc >= 2.35" in (platform_problem("x86_64", ("glibc", "2.31"), (3, 11)) or "")
    assert "glibc >= 2.35" in (platform_problem("x86_64", ("", ""), (3, 11)) or "")  # musl
    assert "CPython 3.9-3.12" in (platform_problem("x86_64", ("glibc", "2.35"), (3, 13)) or "")


def test_this_machine_runs_the_triton_tests() -> None:
    """Here (Linux x86_64, glibc >= 2.35, CPython 3.11) the Triton tests must run, not skip."""
    if sys.platform == "linux" and platform.machine() == "x86_64" and sys.version_info[:2] == (3, 11):
        name, glibc = platform.libc_ver()
        if name == "glibc" and tuple(int(p) for p in glibc.split(".")[:2]) >= (2, 35):
            assert platform_problem() is None


def write_models(directory: Path, count: int) -> tuple[list[Model], Model]:
    generated: list[GeneratedModel] = generate_models(directory / "rules", count + 1, prefix="tm-")
    models = []
    for i, g in enumerate(generated):
        rule = DemoModel.load(g.path)
        streaming = i == count
        folder = write_python_model(
            directory / g.id, rule, repeats=REPEATS if streaming else 0, max_batch_size=MAX_BATCH if streaming else 0
        )
        models.append(Model(g.id, folder, rule))
    return models[:count], models[count]


@contextlib.contextmanager
def start_stack(tmp_path: Path, etcd_url: str, triton: tuple[TritonInstall, Path]) -> Iterator[Stack]:
    """tritonserver under `meshd adapter`, and one meshd in front; all stopped by PID at the end
    (meshd, the adapter, which stops tritonserver's group, then any server or stub left)."""
    install, backends = triton
    models, streaming = write_models(tmp_path / "models", 4)
    triton_port, triton_http, adapter_port = free_port(), free_port(), free_port()
    shm_prefix = f"meshd-test-{uuid.uuid4().hex[:12]}-"
    repository = tmp_path / "repository"
    argv, server_env = triton_command(install, repository, backends, triton_port, triton_http, shm_prefix)
    pid_file = tmp_path / "tritonserver.pid"
    mesh = LocalMesh(tmp_path / "mesh", service=f"adapter-triton-{uuid.uuid4().hex[:8]}")
    mesh.etcd_url = etcd_url
    adapter_argv = [sys.executable, "-m", "meshd", "adapter", "--server", "triton"]
    adapter_argv += ["--server-grpc", f"127.0.0.1:{triton_port}", "--repository", str(repository)]
    adapter_argv += ["--port", str(adapter_port), "--memory-bytes", str(CAPACITY + OVERHEAD)]
    adapter_argv += ["--memory-overhead-bytes", str(OVERHEAD), "--pid-file", str(pid_file)]
    adapter_argv += ["--reconcile-interval-s", "1", "--", *argv]
    try:
        adapter = mesh.children.start("adapter", adapter_argv, server_env, cwd=tmp_path)
        wait_until(lambda: port_open(adapter_port) and port_open(triton_port), 60, "adapter and tritonserver")
        grpc_port, http_port = free_port(), free_port()
        settings: dict[str, str | int] = {"serving_port": triton_port, "rate_check_ms": 600_000}
        meshd = mesh.start_meshd("inst-a", adapter_port, settings, grpc_port=grpc_port, http_port=http_port)
        yield Stack(
            meshd, adapter, grpc_port, http_port, triton_port, pid_file, shm_prefix, models, streaming, repository
        )
    finally:
        # Each step on its own: one failing must not skip the next.
        try:
            mesh.stop()
        finally:
            try:  # tritonserver itself, had the adapter died first (it removes the file on stop)
                pid = read_pid(pid_file)
                if pid is not None and runs(pid, install.server):
                    _kill(pid)
            finally:
                try:
                    for pid in stub_pids(shm_prefix):  # and any stub that outlived its server
                        _kill(pid)
                finally:
                    remove_shm(shm_prefix)


def read_pid(pid_file: Path) -> int | None:
    """The PID in the file; None when there is none (or it is not a number)."""
    try:
        return int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None


def runs(pid: int, binary: Path) -> bool:
    """Whether process `pid` runs `binary` (a reused PID belongs to someone else)."""
    try:
        argv0 = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False
    return argv0 == os.fsencode(str(binary))


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_runs_checks_the_binary(tmp_path: Path) -> None:
    """The cleanup's guard: a PID is only killed when it runs the server binary."""
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        wait_until(lambda: runs(sleeper.pid, Path("sleep")), 10, "sleep to exec")  # until then: python's argv
        assert not runs(sleeper.pid, Path("/no/such/tritonserver"))
    finally:
        sleeper.kill()
        sleeper.wait(10)
    assert not runs(sleeper.pid, Path("sleep"))  # reaped
    (tmp_path / "pid").write_text("")  # half written
    assert read_pid(tmp_path / "pid") is None and read_pid(tmp_path / "missing") is None


@pytest.fixture(scope="module")
def shared_stack(
    triton: tuple[TritonInstall, Path], tmp_path_factory: pytest.TempPathFactory, etcd_server: object
) -> Iterator[Stack]:
    """One stack for the tests that leave it as they found it (the crash test has its own)."""
    with start_stack(tmp_path_factory.mktemp("triton-stack"), etcd_server.url, triton) as stack:  # type: ignore[attr-defined]
        yield stack


def register(channel: grpc.Channel, model: Model) -> None:
    key = json.dumps({"model_type": {"name": "python"}, "meshd": {"size_bytes": DECLARED_SIZE}})
    info = mm.ModelInfo(type="python", path=str(model.folder), key=key)
    mm_grpc.ModelMeshStub(channel).registerModel(mm.RegisterModelRequest(modelId=model.id, modelInfo=info), timeout=30)


def unregister(channel: grpc.Channel, model: Model) -> None:
    """Unregister `model` if it is registered."""
    try:
        mm_grpc.ModelMeshStub(channel).unregisterModel(mm.UnregisterModelRequest(modelId=model.id), timeout=30)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.NOT_FOUND:
            raise


def infer(channel: grpc.Channel, model: Model, timeout: float = 60) -> list[list[float]]:
    req = make_request("the-header-decides", ROWS)  # meshd writes the id into field 1
    resp = v2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
        req, metadata=(("mm-model-id", model.id),), timeout=timeout
    )
    return decode_infer_response(resp)


def triton_index(stack: Stack) -> dict[str, str]:
    """Triton's own repository index: name -> state."""
    with grpc.insecure_channel(f"127.0.0.1:{stack.triton_port}") as ch:
        resp = v2_grpc.GRPCInferenceServiceStub(ch).RepositoryIndex(v2.RepositoryIndexRequest(), timeout=10)
    return {m.name: m.state for m in resp.models}


def loaded_in_triton(stack: Stack) -> set[str]:
    return {name for name, state in triton_index(stack).items() if state == "READY"}


def loaded_in_triton_once_up(stack: Stack) -> set[str]:
    """`loaded_in_triton`, or nothing while a restarted server does not answer yet."""
    try:
        return loaded_in_triton(stack)
    except grpc.RpcError:
        return set()


def reported_loaded(channel: grpc.Channel, models: list[Model]) -> set[str]:
    stub = mm_grpc.ModelMeshStub(channel)
    return {
        m.id for m in models if stub.getModelStatus(mm.GetStatusRequest(modelId=m.id), timeout=10).status == ST.LOADED
    }


def test_triton_through_meshd_with_evictions(shared_stack: Stack) -> None:
    stack = shared_stack
    with stack.channel() as ch:
        for m in stack.models:
            register(ch, m)
        # Two rounds over four models with room for two: every answer right, evictions between.
        for _ in range(2):
            for m in stack.models:
                assert close_enough(infer(ch, m), m.expected(ROWS)), m.id
        held = loaded_in_triton(stack)
        assert 1 <= len(held) <= 2, held
        wait_until(lambda: reported_loaded(ch, stack.models) == loaded_in_triton(stack), 10, "records to match")
        # The evicted ones are unloaded from Triton, and the adapter removed their folders.
        assert {n for n, state in triton_index(stack).items() if state == "READY"} == held
        assert {p.name for p in stack.repository.iterdir() if not p.name.startswith(".")} == held


def test_stream_infer_to_a_decoupled_model_and_config_routed_to_a_copy(shared_stack: Stack) -> None:
    stack, m = shared_stack, shared_stack.streaming
    with stack.channel() as ch:
        register(ch, m)
        stub = v2_grpc.GRPCInferenceServiceStub(ch)
        requests = [make_request("ignored", [row]) for row in ROWS]
        for i, r in enumerate(requests):
            r.id = f"req-{i}"
        answers = list(stub.ModelStreamInfer(iter(requests), metadata=(("mm-model-id", m.id),), timeout=60))
        assert [a.error_message for a in answers] == [""] * (REPEATS * len(ROWS))
        by_request: dict[str, list[list[list[float]]]] = {}
        for a in answers:
            by_request.setdefault(a.infer_response.id, []).append(decode_infer_response(a.infer_response))
        # Each request got REPEATS answers, the k-th being the rule's answer + k, in order.
        assert sorted(by_request) == ["req-0", "req-1"]
        for i, row in enumerate(ROWS):
            got = by_request[f"req-{i}"]
            assert len(got) == REPEATS
            for k in range(REPEATS):
                assert close_enough(got[k], m.expected([row], k)), (i, k, got[k])

        # ModelConfig and ModelMetadata reach the copy, which answers with the model's id.
        config = stub.ModelConfig(v2.ModelConfigRequest(name="x"), metadata=(("mm-model-id", m.id),), timeout=30)
        assert config.config.name == m.id and config.config.backend == "python"
        # The model's own config, not a default (meshd's trimmed ModelConfig has no transaction policy field).
        assert config.config.max_batch_size == MAX_BATCH
        meta = stub.ModelMetadata(v2.ModelMetadataRequest(name="x"), metadata=(("mm-model-id", m.id),), timeout=30)
        assert meta.name == m.id and meta.platform == "python"
        assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("x", "FP32", [-1, 4])]
        assert [(t.name, t.datatype) for t in meta.outputs] == [("y", "FP32")]
        assert mm_grpc.ModelMeshStub(ch).getModelStatus(mm.GetStatusRequest(modelId=m.id), timeout=10).status == (
            ST.LOADED
        )


def test_real_tritonclient_grpc_and_http_against_meshd(shared_stack: Stack) -> None:
    stack = shared_stack
    m, other = stack.models[3], stack.models[0]
    with stack.channel() as ch:
        # Its own state, whatever ran before: only `m` and `other` registered, both loaded
        # (room for two), so loading one never evicts the other.
        for gone in (stack.models[1], stack.models[2], stack.streaming):
            unregister(ch, gone)
        for model in (m, other):
            register(ch, model)
            assert close_enough(infer(ch, model), model.expected(ROWS)), model.id
        wait_until(lambda: reported_loaded(ch, [m, other]) == {m.id, other.id}, 30, "both loaded")
    grpc_python = ensure_venv("tritonclient", ["tritonclient[grpc]==2.73.0"])  # as test_tritonclient.py
    batches = [ROWS[:1], ROWS, [[1.0, 2.0, 3.0, 4.0]] * 3]
    argv = [str(grpc_python), str(CLIENTS / "triton_infer.py"), "--url", f"127.0.0.1:{stack.grpc_port}"]
    argv += ["--model-id", m.id, "--mode", "both", "--batches", json.dumps(batches)]
    proc = run_tracked(argv, 120)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    out = json.loads(proc.stdout)
    for mode in ("infer", "stream"):
        assert [r["id"] for r in out[mode]] == [f"{mode}-{i}" for i in range(len(batches))]
        for r, rows in zip(out[mode], batches, strict=True):
            assert close_enough(r["outputs"], m.expected(rows)), (mode, r)

    # tritonclient.http against meshd's REST port: the load goes through meshd and the adapter
    # to Triton, the unload too, and the index agrees with Triton's own.
    http_python = ensure_venv("tritonclient-http", ["tritonclient[http]==2.73.0"])  # as test_http_api.py
    steps = ["live", "ready", f"unload:{other.id}", f"ready:{other.id}", f"load:{other.id}", f"ready:{other.id}"]
    steps += [f"ready:{m.id}", "load:no-such-model"]
    argv = [str(http_python), str(CLIENTS / "triton_http.py"), "--url", f"127.0.0.1:{stack.http_port}", *steps]
    proc = run_tracked(argv, 120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out[:7] == [True, True, "unloaded", False, "loaded", True, True], out
    assert out[7]["error"] == "404", out
    assert {other.id, m.id} <= loaded_in_triton(stack)


class Traffic(ClientThreads[int]):
    """Threads sending requests for the models in turn until stopped: outcome counts by status."""

    def __init__(self, stack: Stack, models: list[Model], threads: int = 2) -> None:
        super().__init__(range(threads), join_s=60)
        self.stack, self.models = stack, models
        self.outcomes: Counter[str] = Counter()
        self.wrong: list[str] = []

    def _run(self, n: int) -> None:
        with self.stack.channel() as ch:
            i = n
            while self._going():
                m = self.models[i % len(self.models)]
                i += 1
                try:
                    ok = close_enough(infer(ch, m, timeout=30), m.expected(ROWS))
                    self.outcomes["ok" if ok else "wrong"] += 1
                    if not ok:
                        self.wrong.append(m.id)
                except grpc.RpcError as e:
                    self.outcomes[e.code().name] += 1
                    time.sleep(0.1)


def test_tritonserver_sigkilled_under_traffic(
    triton: tuple[TritonInstall, Path], tmp_path: Path, etcd_server: object
) -> None:
    with start_stack(tmp_path, etcd_server.url, triton) as stack, stack.channel() as ch:  # type: ignore[attr-defined]
        models = stack.models[:2]  # both fit: traffic keeps them loaded
        for m in models:
            register(ch, m)
            assert close_enough(infer(ch, m), m.expected(ROWS))
        first_pid = stack.triton_pid()
        assert first_pid is not None
        stubs_before = stub_pids(stack.shm_prefix)
        assert len(stubs_before) == 2, stubs_before  # one stub process per loaded model
        with Traffic(stack, models) as traffic:
            wait_until(lambda: traffic.outcomes["ok"] > 0, 30, "traffic through the first server")
            os.kill(first_pid, signal.SIGKILL)
            # The supervisor starts a new server; the adapter loads both models again.
            wait_until(lambda: stack.triton_pid() not in (None, first_pid), 60, "a new tritonserver")
            wait_until(
                lambda: loaded_in_triton_once_up(stack) >= {m.id for m in models}, 90, "the models to be restored"
            )
            recovered_at = traffic.outcomes["ok"]
            wait_until(lambda: traffic.outcomes["ok"] >= recovered_at + 10, 60, "traffic to flow again")
        assert not traffic.wrong, traffic.wrong
        # Failures while it was down are UNAVAILABLE: none hung on the dead server until its
        # 30 s deadline (that would be DEADLINE_EXCEEDED).
        assert set(traffic.outcomes) <= {"ok", "UNAVAILABLE"}, traffic.outcomes
        # meshd's LOADED models are exactly what Triton's own index says is READY.
        wait_until(lambda: reported_loaded(ch, models) == loaded_in_triton(stack), 20, "meshd to match Triton")
        assert reported_loaded(ch, models) == {m.id for m in models}
        # The killed server's stubs are gone, not orphaned.
        wait_until(lambda: not set(stubs_before) & set(stub_pids(stack.shm_prefix)), 20, "old stubs to exit")
        assert stack.meshd.alive() and stack.adapter.alive()


MARKER_ENV = "MESHD_TEST_RUN"


def run_tracked(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run `argv` to completion; on a timeout (AssertionError) and in any case at the end,
    SIGKILL whatever it started that is still running. The demo's etcd, meshd, adapters and
    servers start sessions of their own, so neither its process group nor a parent-death signal
    reaches them: they are found by a marker in their inherited environment, and killed by PID."""
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER_ENV: marker}
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for pid in marked_pids(MARKER_ENV, marker):
                _kill(pid)
            out, err = proc.communicate(timeout=30)
            raise AssertionError(f"{argv[:4]} timed out after {timeout_s:.0f}s:\n{out}\n{err}") from None
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)
    finally:
        for pid in marked_pids(MARKER_ENV, marker):
            _kill(pid)
        if proc.returncode is None:  # not reaped: its group id cannot belong to anyone else yet
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def test_run_tracked_kills_what_escaped_into_its_own_session() -> None:
    escaper = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    with pytest.raises(AssertionError, match="timed out") as failed:
        run_tracked([sys.executable, "-c", escaper], timeout_s=5)
    grandchild = int(str(failed.value).split("\n")[1])
    wait_until(lambda: not runs(grandchild, Path("sleep")), 10, "the escaped sleep to die")


def test_demo_without_the_wheel_says_how_to_install_it(tmp_path: Path) -> None:
    # A Python known to lack the wheel (a bare venv, no site packages), whatever this venv holds.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=120)
    bare = tmp_path / "bare" / "bin" / "python"
    argv = [sys.executable, "-m", "meshd", "demo", "--runtime", "triton", "--triton-python", str(bare)]
    proc = run_tracked(argv, 60)
    assert proc.returncode == 2, proc.stderr
    assert f"no tritonserver in {bare}'s environment" in proc.stderr, proc.stderr
    assert "pip install --no-deps nvidia-pytriton==0.7.0 'numpy<2'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "etcd" not in proc.stdout  # nothing was started


def test_demo_on_real_triton(triton: tuple[TritonInstall, Path]) -> None:
    install, _ = triton
    argv = [sys.executable, "-m", "meshd", "demo", "--runtime", "triton", "--triton-python", str(install.python)]
    argv += ["--instances", "1", "--models", "3", "--cache-models", "2", "--requests", "30", "--concurrency", "2"]
    proc = run_tracked(argv, 180)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "correct answers  30" in proc.stdout and "wrong answers    0" in proc.stdout, proc.stdout
    assert f"Triton {TRITON_VERSION}" in proc.stdout
    assert "stopped every process the demo started" in proc.stdout


def test_configs_and_schemas_the_adapter_rewrites_load_in_real_triton(
    tmp_path: Path, triton: tuple[TritonInstall, Path]
) -> None:
    """A config.pbtxt whose name carries a comment or quotes differently, or whose only
    `name:` at column 0 is an input's, loads under the model id; a schema supplies the
    inputs and outputs (without the batch dimension when the config batches)."""
    from meshd.adapter import layout
    from meshd.adapter.layout import ModelSource, TritonLayout

    install, backends = triton
    rule = DemoModel.load(generate_models(tmp_path / "rules", 1, prefix="cfg-")[0].path)
    base = write_python_model(tmp_path / "base", rule).joinpath("config.pbtxt").read_text()
    one_line = base.replace("\n", " ").replace('"python"', "'python'")
    nested = base.replace("input [ { name", "input [\n{\nname")
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(
        json.dumps(
            {
                "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, rule.inputs]}],
                "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, rule.outputs]}],
            }
        )
    )
    no_tensors = 'backend: "python"\nmax_batch_size: 4\ninstance_group [ { kind: KIND_CPU count: 1 } ]\n'
    cases = {
        "commented": ('name: "old"  # exported name\n' + base, None),
        "quoted": ("name:'old' " + one_line, None),
        "nested": (nested, None),
        "schema": (no_tensors, schema_file),
    }
    repo = tmp_path / "repository"
    repo.mkdir()
    port, http_port, shm = free_port(), free_port(), f"meshd-test-{uuid.uuid4().hex[:12]}-"
    argv, env = triton_command(install, repo, backends, port, http_port, shm)
    with (tmp_path / "triton.log").open("w") as log:
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = v2_grpc.GRPCInferenceServiceStub(channel)
        wait_until(lambda: port_open(port), 60, "tritonserver")
        for label, (config, schema) in cases.items():
            folder = write_python_model(tmp_path / label, rule)
            (folder / "config.pbtxt").write_text(config)
            layout.install(TritonLayout(), repo, ModelSource(f"id-{label}", "python", folder, {}, schema))
            stub.RepositoryModelLoad(v2.RepositoryModelLoadRequest(model_name=f"id-{label}"), timeout=60)
            meta = stub.ModelMetadata(v2.ModelMetadataRequest(name=f"id-{label}"), timeout=10)
            assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("x", "FP32", [-1, rule.inputs])]
        batched = stub.ModelConfig(v2.ModelConfigRequest(name="id-schema"), timeout=10).config
        assert batched.max_batch_size == 4 and list(batched.input[0].dims) == [rule.inputs]
        channel.close()
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        remove_shm(shm)
