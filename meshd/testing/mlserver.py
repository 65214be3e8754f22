"""A real MLServer (KServe V2 + model-repository extension) for integration tests, and
`meshd adapter` in front of it as the tests start it.

MLServer pulls protobuf 6 and ~500 MB of dependencies, so it never goes into meshd's venv: it
lives in its own cached venv (`meshd.testing.venvs`), built on first use. The sklearn models the
tests serve are trained in that venv too (by `_train_sklearn.py`, run as a script), and their
expected answers come back as JSON, so meshd's side needs neither numpy nor scikit-learn.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from meshd.testing.procs import Child, Children
from meshd.testing.venvs import ensure_venv

# mlserver 1.7.1 fails model loads under uvloop 0.22+; the rest is the set resolved and tested
# with it on Python 3.11 (pinned so a new release cannot break a cached-venv rebuild).
MLSERVER_REQUIREMENTS: tuple[str, ...] = (
    "mlserver==1.7.1",
    "mlserver-sklearn==1.7.1",
    "uvloop==0.21.0",
    "scikit-learn==1.9.1",
    "joblib==1.6.0",
    "numpy==2.4.6",
    "scipy==1.17.1",
    "pandas==3.1.1",
)

TRAIN_SCRIPT = Path(__file__).with_name("_train_sklearn.py")
MANIFEST_NAME = "trained-models.json"
TRAIN_TIMEOUT_S = 120.0

# The model-settings.json an adapter writes next to model.joblib (name filled in per model).
SKLEARN_IMPLEMENTATION = "mlserver_sklearn.SKLearnModel"


@dataclass(frozen=True)
class TrainedModel:
    """One model from `train_sklearn_models`: `path` is its folder (holding model.joblib)."""

    name: str
    path: Path
    inputs: list[list[float]]  # rows of 4 features: send as FP64, shape [len(inputs), 4]
    expected: list[int]  # model.predict(inputs): MLServer's INT64 output "predict"


def mlserver_python() -> Path:
    """The python of the MLServer venv (built on first use: ~55 s from PyPI, 528 MB)."""
    return ensure_venv("mlserver", MLSERVER_REQUIREMENTS)


def train_sklearn_models(python: Path, out_dir: Path, count: int) -> list[TrainedModel]:
    """Train `count` distinct tiny classifiers into `out_dir/<name>/model.joblib` with `python`.

    Model i answers only with labels 10*i .. 10*i+2, so answers also tell which model served.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = out_dir / MANIFEST_NAME
    argv = [str(python), str(TRAIN_SCRIPT), str(out_dir), str(count), str(manifest)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=TRAIN_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"training sklearn models failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [
        TrainedModel(
            name=str(entry["name"]),
            path=Path(entry["path"]),
            inputs=[[float(v) for v in row] for row in entry["inputs"]],
            expected=[int(v) for v in entry["expected"]],
        )
        for entry in json.loads(manifest.read_text(encoding="utf-8"))
    ]


def sklearn_model_settings(name: str, model_file: str = "./model.joblib") -> dict[str, object]:
    """The model-settings.json that serves `<folder>/model.joblib` under `name`."""
    return {"name": name, "implementation": SKLEARN_IMPLEMENTATION, "parameters": {"uri": model_file}}


def mlserver_command(
    python: Path, repository: Path, grpc_port: int, http_port: int
) -> tuple[list[str], dict[str, str]]:
    """Argv and extra environment (to merge over os.environ) for an MLServer on 127.0.0.1.

    It serves `repository` (any folder below it holding a model-settings.json is a model, named
    by that file's "name") but loads nothing until RepositoryModelLoad; inference runs in the
    server process (parallel_workers=0: one process, nothing to orphan); no metrics server.
    All settings come from MLSERVER_* variables, so no settings.json is needed anywhere. Start
    it in a scratch cwd: MLServer reads a `.env` file from its cwd and puts the cwd on sys.path.
    The script runs under `python` explicitly, as a long venv path can overflow a shebang line.
    Ready (gRPC ServerReady) ~1.5 s after exec; poll the port, or use wait_for_ready, as a
    channel that failed to connect backs off for seconds. SIGTERM: exit 0 within 1 s, but up
    to 5 s (gRPC grace) while a client channel is connected.
    """
    argv = [str(python), str(python.parent / "mlserver"), "start", str(repository)]
    env = {
        "MLSERVER_HOST": "127.0.0.1",
        "MLSERVER_GRPC_PORT": str(grpc_port),
        "MLSERVER_HTTP_PORT": str(http_port),
        "MLSERVER_LOAD_MODELS_AT_STARTUP": "false",
        "MLSERVER_PARALLEL_WORKERS": "0",
        "MLSERVER_METRICS_ENDPOINT": "",  # falsy: no metrics server, no gRPC metrics interceptor
        "MLSERVER_DEBUG": "false",  # INFO logging and no per-request access log
        "PYTHONUNBUFFERED": "1",
    }
    return argv, env


def start_mlserver_adapter(
    children: Children,
    python: Path,
    workdir: Path,
    ports: tuple[int, int, int],
    memory_bytes: int,
    pid_file: Path,
    options: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Child:
    """`meshd adapter --server mlserver` on `ports` (adapter, MLServer gRPC, MLServer HTTP),
    supervising an MLServer (mlserver_command with `python`) that serves workdir/repository;
    both run from workdir/scratch (MLServer reads .env from, and imports from, its cwd). The
    adapter writes MLServer's PID to `pid_file` (for kill_mlserver); `options`: more adapter flags;
    `env`: more environment (STORAGE_CONFIG_DIR, ...).
    """
    adapter_port, mlserver_port, http_port = ports
    repository = workdir / "repository"
    argv, server_env = mlserver_command(python, repository, mlserver_port, http_port)
    scratch = workdir / "scratch"
    scratch.mkdir(exist_ok=True)
    adapter_argv = [
        *(sys.executable, "-m", "meshd", "adapter", "--server", "mlserver"),
        *("--server-grpc", f"127.0.0.1:{mlserver_port}", "--repository", str(repository)),
        *("--port", str(adapter_port), "--memory-bytes", str(memory_bytes), "--pid-file", str(pid_file)),
        *options,
        "--",
        *argv,
    ]
    return children.start("adapter", adapter_argv, {**server_env, **(env or {})}, cwd=scratch)


def kill_mlserver(pid_file: Path) -> None:
    """SIGKILL the MLServer whose PID the adapter wrote, had the adapter died before stopping it."""
    if not pid_file.exists():
        return
    try:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
    except (ProcessLookupError, ValueError):
        pass
