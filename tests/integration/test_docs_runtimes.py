"""docs/runtimes.md's shell blocks, run as a reader runs them (meshd.testing.docs): in order, as
written, in one shell session in an empty directory, each with a time limit.

What is not as written, and why:
- the set-up blocks (a venv for MLServer, one for Triton's wheel) are not run: `~/.venvs/mlserver`
  and `~/.venvs/triton` (HOME is a fresh folder) are the venvs the tests already built (.venvs/,
  the same releases, their dependencies pinned), linked there; meshd is already installed in the
  venv running this test, first on PATH;
- the first block (meshd beside *your* runtime and an etcd at etcd:2379) says it is not run,
  and why; the MLServer and Triton pods after it run whole;
- the default ports (8085, 8001, 8002, 8000, 8033 in the text; 8080, 8091, 2112, 8089, 8090 taken
  by default) are swapped for free ones, since other processes on this host may hold them: in the
  text, and by settings put before `meshd serve` on its line, as a reader would.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from meshd.testing.docs import ServePorts, reader_env, run_blocks, shell_blocks, with_ports
from meshd.testing.mlserver import mlserver_python
from meshd.testing.procs import free_ports
from meshd.testing.triton import platform_problem, triton_venv

pytestmark = pytest.mark.slow

PAGE = Path(__file__).resolve().parents[2] / "docs" / "runtimes.md"
SETUP = {
    "python3 -m venv ~/.venvs/mlserver ": "mlserver",
    "python3 -m venv ~/.venvs/triton ": "triton",
}  # what a set-up block begins with -> its venv
LIMIT_S = 300.0  # per block: the Triton demo takes ~1 min on 2 busy cores, a server's start seconds, a hang forever


def test_the_runtimes_page_runs_as_written_in_order(tmp_path: Path) -> None:
    problem = platform_problem()
    if problem is not None:  # a platform limit, not a failure: the wheels do not exist here
        pytest.skip(f"no Triton venv on this platform: {problem}")
    blocks = shell_blocks(PAGE.read_text())
    setup = [b for b in blocks if b.text.startswith(tuple(SETUP))]
    assert [next(v for k, v in SETUP.items() if b.text.startswith(k)) for b in setup] == list(SETUP.values()), (
        "the page's set-up blocks changed: say here what stands in for them"
    )
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".venvs").mkdir(parents=True)
    work.mkdir()
    (home / ".venvs" / "mlserver").symlink_to(mlserver_python().parent.parent)
    (home / ".venvs" / "triton").symlink_to(triton_venv().python.parent.parent)
    ports = ServePorts.free()
    runtime, server_grpc, server_http, triton_http = free_ports(4)  # none of ports': handed out lately
    swap = {"8085": runtime, "8001": server_grpc, "8002": server_http, "8000": triton_http, "8033": ports.grpc}
    run = with_ports([b for b in blocks if b not in setup], swap, ports, serves=2)  # the two pods' meshd
    env = reader_env(home, Path(sys.executable).parent) | {"MESHD_ADDRESS": f"localhost:{ports.grpc}"}
    ran = run_blocks(run, work, env, LIMIT_S)
    mlserver_pod, _stop, demo, triton_pod = (r.output for r in ran)
    assert re.search(r'name: "predict"\s+datatype: "INT64".*int64_contents: 0\n', mlserver_pod, re.S), mlserver_pod
    assert "correct answers  200" in demo and "wrong answers    0" in demo, demo
    assert "stopped every process the demo started" in demo, demo
    assert '"raw_output_contents": [\n    "AAAAQAAAQEA="' in triton_pod, triton_pod  # y = [2, 3]
