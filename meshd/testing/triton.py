"""A real Triton Inference Server (from the `nvidia-pytriton` wheel) for tests, the demo and benchmarks.

The `nvidia-pytriton` wheel (0.7.0: Triton 2.51.0, manylinux_2_35, x86_64) ships a complete
`tritonserver` binary with its libraries (`nvidia_pytriton.libs`), the Python backend and
one backend stub per CPython version. This module finds those pieces in a Python environment,
assembles a backend directory for the stub of that environment's Python, and says how to start
the server in explicit model-control mode. It runs on CPU; no GPU is needed.

Two traps, handled here:
- the backend stub embeds its own libpython and does not see the environment's packages, so
  the Python models written here put `MESHD_TRITON_SITE` (the environment's site-packages,
  set in the server's environment, which the stub inherits) on `sys.path` before importing
  numpy; PYTHONPATH does not reach the stub;
- the Python backend of Triton 2.51 is built against numpy 1.x: under numpy 2 its output
  tensors come out empty ("output tensor shape does not match size of output"), so numpy < 2.

For tests the wheel lives in its own cached venv (`meshd.testing.venvs`, built on first use
from PyPI, ~10 s, ~250 MB), installed without its declared dependencies (tritonclient, grpcio,
... which only PyTriton's own Python API needs, not the server binary), from wheels only: where
none fits (not Linux x86_64, glibc < 2.35, a CPython without a numpy 1.26.4 wheel: 3.13 and
later) `platform_problem` says so, and the tests skip, rather than pip trying a source build.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from meshd.runtimes.models import DemoModel
from meshd.testing.cluster import LocalMesh, Node, StartFailed
from meshd.testing.procs import free_ports, port_open, wait_until
from meshd.testing.venvs import ensure_venv

PYTRITON = "nvidia-pytriton==0.7.0"
TRITON_VERSION = "2.51.0"
# numpy < 2: see the module docstring. 1.26.4 is the last 1.x, with wheels for CPython 3.9-3.12.
TRITON_REQUIREMENTS: tuple[str, ...] = (PYTRITON, "numpy==1.26.4")
TRITON_PIP_OPTIONS: tuple[str, ...] = ("--no-deps", "--only-binary=:all:")
TEST_VENV_PYTHONS = ((3, 9), (3, 12))  # the CPython versions numpy 1.26.4 has wheels for (inclusive)
MIN_GLIBC = (2, 35)  # the wheel is manylinux_2_35
INSTALL_HINT = (
    f"install the Triton server wheel into that Python's environment: "
    f"pip install --no-deps {PYTRITON} 'numpy<2'  (Linux x86_64, glibc >= 2.35, CPython 3.8-3.12: "
    f"the wheel has backend stubs for 3.8-3.13, but numpy < 2 has no wheel for 3.13)"
)
SITE_ENV = "MESHD_TRITON_SITE"  # read by the Python models below
EXIT_TIMEOUT_S = 2  # tritonserver waits this long for in-flight work on SIGTERM (its default: 30)

_PROBE = """
import importlib.util, json, sys, sysconfig
spec = importlib.util.find_spec("pytriton")
print(json.dumps({
    "pytriton": list(spec.submodule_search_locations or []) if spec else [],
    "numpy": importlib.util.find_spec("numpy") is not None,
    "site": sysconfig.get_paths()["purelib"],
    "version": "%d.%d" % sys.version_info[:2],
    "libdir": sysconfig.get_config_var("LIBDIR") or "",
    "shared": bool(sysconfig.get_config_var("Py_ENABLE_SHARED")),
}))
"""


class TritonMissing(RuntimeError):
    """No usable Triton server in the Python environment asked about (the message says why)."""


@dataclass(frozen=True)
class TritonInstall:
    """The pieces of one installed `nvidia-pytriton` wheel."""

    python: Path  # the environment's python
    root: Path  # <site-packages>/pytriton/tritonserver
    libraries: Path  # <site-packages>/nvidia_pytriton.libs
    site_packages: Path  # holds numpy: put on the Python backend's sys.path
    python_version: str  # "3.11": which backend stub
    python_libdir: Path | None  # where this Python's libpython is, when built shared

    @property
    def server(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def stub(self) -> Path:
        return self.root / "python_backend_stubs" / self.python_version / "triton_python_backend_stub"


def find_triton(python: Path | str = sys.executable) -> TritonInstall:
    """The Triton server installed in `python`'s environment; TritonMissing if none is usable."""
    try:
        proc = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=60, check=False)
    except OSError as e:
        raise TritonMissing(f"cannot run {python}: {e}") from None
    if proc.returncode != 0:
        raise TritonMissing(f"cannot run {python}: {proc.stderr.strip()[-500:]}")
    info = json.loads(proc.stdout)
    roots = [Path(p) / "tritonserver" for p in info["pytriton"]]
    root = next((r for r in roots if (r / "bin" / "tritonserver").is_file()), None)
    if root is None:
        raise TritonMissing(f"no tritonserver in {python}'s environment; {INSTALL_HINT}")
    install = TritonInstall(
        python=Path(python),
        root=root,
        libraries=root.parent.parent / "nvidia_pytriton.libs",
        site_packages=Path(info["site"]),
        python_version=info["version"],
        python_libdir=Path(info["libdir"]) if info["shared"] and info["libdir"] else None,
    )
    if not install.stub.is_file():
        raise TritonMissing(f"the wheel has no Python backend stub for Python {install.python_version}")
    if not info["numpy"]:
        raise TritonMissing(f"numpy is missing in {python}'s environment (the Python backend needs it); {INSTALL_HINT}")
    return install


def platform_problem(
    machine: str | None = None, libc: tuple[str, str] | None = None, version: tuple[int, int] | None = None
) -> str | None:
    """Why the test venv's wheels cannot install here (None: they can). Arguments: for tests."""
    machine = machine if machine is not None else platform.machine()
    if sys.platform != "linux" or machine != "x86_64":
        return f"{PYTRITON} has a wheel for Linux x86_64 only (this is {sys.platform} {machine})"
    name, glibc = libc if libc is not None else platform.libc_ver()
    try:
        found = tuple(int(p) for p in glibc.split(".")[:2])
    except ValueError:
        found = ()
    if name != "glibc" or found < MIN_GLIBC:
        return f"{PYTRITON} is manylinux_2_35: it needs glibc >= 2.35 (this has {name or 'no glibc'} {glibc})"
    version = version if version is not None else (sys.version_info.major, sys.version_info.minor)
    low, high = TEST_VENV_PYTHONS
    if not low <= version <= high:
        return (
            f"numpy 1.26.4 (numpy < 2, which Triton {TRITON_VERSION}'s Python backend needs) has wheels for "
            f"CPython {low[0]}.{low[1]}-{high[0]}.{high[1]} only (this is {version[0]}.{version[1]})"
        )
    return None


def triton_venv() -> TritonInstall:
    """The test venv's Triton (the venv is built on first use from PyPI, wheels only: check
    `platform_problem` first)."""
    python = ensure_venv("triton", TRITON_REQUIREMENTS, pip_options=TRITON_PIP_OPTIONS)
    return find_triton(python)


def backend_directory(install: TritonInstall, directory: Path) -> Path:
    """A `--backend-directory` with the Python backend and the stub for the install's Python
    (the wheel keeps stubs apart, one per Python version). Symlinks into the wheel; idempotent."""
    python_dir = directory / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    wanted = {p.name: p for p in (install.root / "backends" / "python").iterdir() if p.is_file()}
    wanted[install.stub.name] = install.stub
    for name, target in wanted.items():
        link = python_dir / name
        if link.is_symlink() and link.resolve() == target.resolve():
            continue
        link.unlink(missing_ok=True)
        link.symlink_to(target.resolve())
    return directory


def triton_command(
    install: TritonInstall,
    repository: Path,
    backends: Path,
    grpc_port: int,
    http_port: int,
    shm_prefix: str,
    extra: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """Argv and extra environment (to merge over os.environ) for a tritonserver on 127.0.0.1
    in explicit model-control mode: it loads nothing until RepositoryModelLoad.

    `shm_prefix` names the Python backend's shared-memory regions (`/dev/shm/<prefix>*`), so
    whoever starts the server can remove what a killed one leaves (`remove_shm`). Metrics are
    off. Ready (gRPC ServerReady) ~1-3 s after exec; loading one Python-backend model takes
    ~1 s (a stub process per model instance).
    """
    argv = [
        str(install.server),
        f"--model-repository={repository}",
        "--model-control-mode=explicit",
        f"--backend-directory={backends}",
        "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}",
        "--http-address=127.0.0.1",
        f"--http-port={http_port}",
        "--allow-metrics=false",
        f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
        *extra,
    ]
    libs = [str(install.libraries)]
    if install.python_libdir is not None:
        libs.append(str(install.python_libdir))  # the stub's libpython, for a Python not on the system's path
    if os.environ.get("LD_LIBRARY_PATH"):
        libs.append(os.environ["LD_LIBRARY_PATH"])
    env = {"LD_LIBRARY_PATH": os.pathsep.join(libs), SITE_ENV: str(install.site_packages)}
    return argv, env


def remove_shm(prefix: str, shm: Path = Path("/dev/shm")) -> None:
    """Remove the shared-memory regions a (killed) server with this prefix left behind."""
    if not prefix:
        raise ValueError("an empty prefix would match every region")
    for region in shm.glob(f"{prefix}*"):
        region.unlink(missing_ok=True)


# ---- Python-backend models ---------------------------------------------------------------
# One model.py for both kinds: y = W x + b for each row of FP32 input "x" (a meshd demo model's
# rule, read from model.json beside it), answered as FP32 "y". A decoupled model (config.pbtxt's
# transaction policy) answers each request with `repeats` responses, the k-th being y + k.
MODEL_PY = """\
import json
import os
import sys

sys.path[:0] = [p for p in os.environ.get("MESHD_TRITON_SITE", "").split(os.pathsep) if p and p not in sys.path]

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        folder = os.path.join(args["model_repository"], args["model_version"])
        with open(os.path.join(folder, "model.json"), encoding="utf-8") as f:
            spec = json.load(f)
        self.weights = np.asarray(spec["weights"], dtype=np.float64)
        self.bias = np.asarray(spec["bias"], dtype=np.float64)
        self.repeats = int(spec.get("repeats", 1))
        ballast = os.path.join(folder, "ballast.npy")
        # Stands for model weights: read into memory, so the server's RSS grows by its size.
        self.ballast = np.load(ballast) if os.path.exists(ballast) else None
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)

    def _answer(self, request, k=0):
        x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy().astype(np.float64)
        y = x @ self.weights.T + self.bias + k
        return pb_utils.InferenceResponse([pb_utils.Tensor("y", y.astype(np.float32))])

    def execute(self, requests):
        if not self.decoupled:
            return [self._answer(r) for r in requests]
        for r in requests:
            sender = r.get_response_sender()
            for k in range(self.repeats):
                sender.send(self._answer(r, k))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

_CONFIG = """\
backend: "python"
max_batch_size: {max_batch_size}
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ {rows}{inputs} ] }} ]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ {rows}{outputs} ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""
_DECOUPLED = "model_transaction_policy { decoupled: true }\n"


def write_python_model(
    folder: Path, model: DemoModel, *, repeats: int = 0, ballast_bytes: int = 0, max_batch_size: int = 0
) -> Path:
    """A Triton Python-backend model folder answering `model`'s rule (see MODEL_PY):
    `config.pbtxt` (no name: the adapter sets it to the model id) and `1/` with model.py and
    model.json. `repeats` > 0: a decoupled model sending that many responses per request.
    `ballast_bytes`: a .npy array of that size, loaded into memory with the model.
    `max_batch_size` > 0: the rows are Triton's batch dimension (at most that many per request);
    0: they are the tensor's own first dimension, any number."""
    if model.kind != "linear":
        raise ValueError("only linear demo models have a rule to serve")
    version = folder / "1"
    version.mkdir(parents=True, exist_ok=True)
    spec = {"weights": [list(r) for r in model.weights], "bias": list(model.bias), "repeats": max(1, repeats)}
    (version / "model.json").write_text(json.dumps(spec) + "\n", encoding="utf-8")
    (version / "model.py").write_text(MODEL_PY, encoding="utf-8")
    if ballast_bytes > 0:
        _write_npy(version / "ballast.npy", ballast_bytes)
    rows = "" if max_batch_size > 0 else "-1, "  # with batching, Triton adds the batch dimension itself
    config = _CONFIG.format(max_batch_size=max_batch_size, rows=rows, inputs=model.inputs, outputs=model.outputs)
    (folder / "config.pbtxt").write_text(config + (_DECOUPLED if repeats > 0 else ""), encoding="utf-8")
    return folder


def _write_npy(path: Path, size_bytes: int) -> None:
    """A version-1.0 .npy file of `size_bytes` uint8 values (non-zero, so pages are really used)."""
    header = f"{{'descr': '|u1', 'fortran_order': False, 'shape': ({size_bytes},), }}"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"  # the whole header: a multiple of 64
    pattern = bytes(range(1, 256))
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode("latin-1"))
        full, rest = divmod(size_bytes, len(pattern))
        chunk = pattern * 4096
        for _ in range(full // 4096):
            f.write(chunk)
        f.write(pattern * (full % 4096) + pattern[:rest])


# ---- processes ----------------------------------------------------------------------------
def stub_pids(shm_prefix: str, proc: Path = Path("/proc")) -> list[int]:
    """PIDs of the Python-backend stubs of the server started with `shm_prefix` (one per
    model instance; each names its shared-memory region, and so the prefix, in its argv)."""
    if not shm_prefix:
        raise ValueError("an empty prefix would match every stub")
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        stub = len(argv) > 2 and argv[0].endswith(b"triton_python_backend_stub")
        if stub and argv[2].startswith(shm_prefix.encode()):
            pids.append(int(entry.name))
    return sorted(pids)


def rss_bytes(pid: int, proc: Path = Path("/proc")) -> int:
    """Resident set size of one process (0 if it is gone)."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def start_triton_node(
    mesh: LocalMesh,
    instance_id: str,
    install: TritonInstall,
    backends: Path,
    capacity_bytes: int,
    overhead_bytes: int = 256 << 20,
) -> tuple[Node, str]:
    """One pod on `mesh`: tritonserver under `meshd adapter --server triton`, and a meshd using
    them (management through the adapter, inference straight to Triton). Returns the node (its
    runtime is the adapter) and the server's shared-memory prefix, for `remove_shm` after
    `mesh.stop()`. The adapter stops tritonserver's process group when it stops."""
    workdir = mesh.workdir / instance_id
    repository = workdir / "repository"
    triton_port, triton_http, adapter_port = free_ports(3)
    shm_prefix = f"meshd-{instance_id}-{uuid.uuid4().hex[:12]}-"
    argv, env = triton_command(install, repository, backends, triton_port, triton_http, shm_prefix)
    adapter_argv = [sys.executable, "-m", "meshd", "adapter", "--server", "triton"]
    adapter_argv += ["--server-grpc", f"127.0.0.1:{triton_port}", "--repository", str(repository)]
    adapter_argv += ["--port", str(adapter_port), "--memory-bytes", str(capacity_bytes + overhead_bytes)]
    adapter_argv += ["--memory-overhead-bytes", str(overhead_bytes), "--gpu-capacity", "off"]
    adapter_argv += ["--pid-file", str(workdir / "tritonserver.pid"), "--", *argv]
    workdir.mkdir(parents=True, exist_ok=True)
    adapter = mesh.children.start(f"{instance_id}-adapter", adapter_argv, env, cwd=workdir)

    def up() -> bool:
        if not adapter.alive():
            raise StartFailed(f"meshd adapter exited with {adapter.proc.returncode}:\n{adapter.log_tail()}")
        return port_open(adapter_port) and port_open(triton_port)

    try:
        wait_until(up, 60, f"{instance_id}'s adapter and tritonserver")
    except TimeoutError as e:
        raise StartFailed(f"{e}\n{adapter.log_tail()}") from None
    grpc_port, peer_port, http_port = free_ports(3, avoid=[triton_port, triton_http, adapter_port])
    settings: dict[str, str | int] = {"serving_port": triton_port}
    meshd = mesh.start_meshd(instance_id, adapter_port, settings, grpc_port, peer_port, http_port=http_port)
    node = Node(instance_id, grpc_port, peer_port, adapter_port, meshd, adapter, http_port)
    mesh.nodes.append(node)
    return node, shm_prefix
