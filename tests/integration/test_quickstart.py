"""README.md's quickstart, run as written: the commands between its `<!-- quickstart -->`
markers, in an empty directory, with `meshd` on PATH. Only the port numbers are swapped for
free ones (other processes on this host may hold the defaults), through the same settings a
reader would use."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from meshd.testing.procs import free_port

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"<!-- quickstart -->\s*```bash\n(.*?)```\s*<!-- /quickstart -->", re.S)


def quickstart() -> str:
    found = BLOCK.search(README.read_text())
    assert found, "README.md has no <!-- quickstart --> block"
    return found.group(1)


def test_the_readme_is_a_front_door() -> None:
    text = README.read_text()
    assert len(text.encode()) <= 15 * 1024
    first = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split("#")[0].strip() for line in first] == [
        "python3 scripts/dev.py demo",
        "python3 scripts/dev.py test",
    ]
    for doc in re.findall(r"\]\((docs/[a-z]+\.md|CHANGELOG\.md)\)", text):
        assert (README.parent / doc).is_file(), doc


def test_the_quickstart_runs_as_written(tmp_path: Path) -> None:
    script = quickstart()
    ports = {"8085": free_port(), "8033": free_port(), "8091": free_port()}
    for default, port in ports.items():
        assert default in script or default == "8033"
        script = re.sub(rf"\b{default}\b", str(port), script)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "MM_SVC_GRPC_PORT": str(ports["8033"]),
        "MESHD_ADDRESS": f"localhost:{ports['8033']}",
        "MESHD_HTTP_PORT": str(ports["8091"]),
        "MESHD_PEER_PORT": str(free_port()),
        "MM_METRICS": f"prometheus:port={free_port()}",
        "MM_PROBE_PORT": str(free_port()),
        "MM_PRESTOP_WAIT_PORT": str(free_port()),
    }
    env.pop("KV_STORE", None)
    proc = subprocess.Popen(
        ["bash", "-e", "-c", script],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the script left behind
        proc.wait()
    assert proc.returncode == 0, out
    assert '"model_name":"model-0000"' in out and '"name":"y","datatype":"FP32","shape":[1,2]' in out, out
    assert re.search(r"model-0000\s+demo\s+LOADED", out), out
