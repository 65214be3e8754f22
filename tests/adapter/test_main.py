"""`meshd adapter` start-up with bad input: one clear line and an exit code, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshd.testing.procs import free_port


def adapter(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "meshd", "adapter", "--server", "mlserver", "--server-grpc", "127.0.0.1:1"]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--repository", "/proc/no/such", "--port", "0"], 1, "No such file or directory"),
        (["--repository", "{tmp}/repo", "--model-root", "{tmp}", "--port", "0"], 2, "must not contain each other"),
        (["--repository", "{tmp}/repo"], 2, "give --port and/or --socket"),
        (["--repository", "{tmp}/repo", "--port", "0", "--size-multiplier", "0"], 1, "multiplier must be > 0"),
        (["--repository", "{tmp}/repo", "--port", "0", "--", "no-such-server-meshd"], 2, "is not an executable"),
    ],
)
def test_bad_start_up_input_is_one_clear_line(tmp_path: Path, args: list[str], code: int, message: str) -> None:
    done = adapter(*[a.format(tmp=tmp_path) for a in args])
    assert done.returncode == code, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr


def test_a_port_in_use_is_one_clear_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
        s.listen()
        port = s.getsockname()[1]
        done = adapter("--repository", str(tmp_path / "repo"), "--port", str(port))
    assert done.returncode == 1 and "Failed to bind" in done.stderr and "Traceback" not in done.stderr


def test_the_pulled_models_folder_and_the_repository_stay_apart(tmp_path: Path) -> None:
    from meshd.adapter.main import storage_problem

    root = tmp_path / "models"
    assert storage_problem(tmp_path / "repo", None) is None
    assert storage_problem(tmp_path / "repo", root) is None
    assert storage_problem(root / "_mlserver_models", root) is None  # upstream's layout
    assert "named _" in (storage_problem(root / "repo", root) or "")  # the helper would take it for a model
    assert "would hold" in (storage_problem(root, root) or "")
    assert "would hold" in (storage_problem(tmp_path, root) or "")


def test_a_repository_among_the_pulled_models_is_refused_at_start(tmp_path: Path) -> None:
    root = tmp_path / "models"
    argv = ["--server", "mlserver", "--server-grpc", "127.0.0.1:1", "--repository", str(root / "repo")]
    proc = subprocess.run(
        [sys.executable, "-m", "meshd", "adapter", *argv, "--port", "0", "--root-model-dir", str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "must be named _" in proc.stderr and "Traceback" not in proc.stderr


def test_defaults_are_upstreams(tmp_path: Path) -> None:
    from meshd.adapter.main import build_parser, config_from

    a = build_parser().parse_args(
        ["--server", "triton", "--server-grpc", "x:1", "--repository", str(tmp_path), "--port", "1"]
    )
    config = config_from(a, {})
    # model-mesh-*-adapter/server/config.go: DEFAULT_MODELSIZE 1000000; LOADTIME_TIMEOUT as
    # modelmesh-serving sets it (90000; the adapters' own default, 30000, includes no pull)
    assert (config.default_model_size, config.loading_timeout_ms) == (1_000_000, 90_000)
    config = config_from(a, {"DEFAULT_MODELSIZE": "7", "LOADTIME_TIMEOUT": "90000"})
    assert (config.default_model_size, config.loading_timeout_ms) == (7, 90_000)
