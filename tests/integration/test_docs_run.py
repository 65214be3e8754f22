"""README.md's shell blocks, run as a new user runs them: in order, as written, in one shell
session in an empty directory, each with a time limit (meshd.testing.docs). docs/llm.md's:
tests/llm/test_docs_llm.py.

What is not as written, and why:
- the set-up blocks (`scripts/dev.py`, `pip install .`) are not run: meshd is already installed
  in the venv running this test, which is first on PATH;
- the default ports (8085, 8086, 8091, 8033 in the text; 8080, 2112, 8089, 8090 taken by
  default) are swapped for free ones, since other processes on this host may hold them: in the
  text, and through the same settings a reader would use on the first `meshd serve` line.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from meshd.testing.docs import Block, run_blocks, shell_blocks
from meshd.testing.procs import free_ports

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"
SETUP = ("python3 scripts/dev.py demo", "pip install .")  # what the blocks skipped begin with
LIMIT_S = 120.0  # per block: a start-up and a load on 2 busy cores take seconds, a hang forever


def session_env(tmp_path: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "HOME": str(tmp_path / "home"),  # a new user's: nothing of ours in it
    }
    for name in list(env):  # no setting of ours leaks into the reader's session
        if name.startswith(("MM_", "MESHD_", "KV_STORE")):
            del env[name]
    (tmp_path / "home").mkdir()
    return env


def test_the_readme_runs_as_written_in_order(tmp_path: Path) -> None:
    blocks = shell_blocks(README.read_text())
    skipped = [b for b in blocks if b.text.startswith(SETUP)]
    assert [b.text.split("#")[0].strip() for b in skipped] == [
        "python3 scripts/dev.py demo",
        "pip install .",
    ], "the README's set-up blocks changed: say here what stands in for them"
    runtime, second_runtime, http, grpc_port, peer, metrics, probe, prestop = free_ports(8)
    swap = {"8085": runtime, "8086": second_runtime, "8091": http, "8033": grpc_port}
    first_serve = (
        f"MM_SVC_GRPC_PORT={grpc_port} MESHD_PEER_PORT={peer} MESHD_HTTP_PORT={http} "
        f"MM_METRICS='prometheus:port={metrics};scheme=http' MM_PROBE_PORT={probe} MM_PRESTOP_WAIT_PORT={prestop} "
    )
    ran_blocks = []
    for b in (b for b in blocks if b not in skipped):
        text = b.text
        for default, port in swap.items():
            text = re.sub(rf"\b{default}\b", str(port), text)
        if not ran_blocks:  # the quickstart
            assert "\nmeshd serve --runtime-port" in text, "the quickstart starts no meshd"
            text = text.replace("\nmeshd serve ", f"\n{first_serve}meshd serve ", 1)
        ran_blocks.append(Block(b.index, b.line, text))
    env = session_env(tmp_path) | {"MESHD_ADDRESS": f"localhost:{grpc_port}"}  # the CLI's default 8033, swapped
    work = tmp_path / "work"
    work.mkdir()
    ran = run_blocks(ran_blocks, work, env, LIMIT_S)
    assert [r.block.line for r in ran] == [b.line for b in ran_blocks]
    quickstart, grpcurl, second, _stop = (r.output for r in ran)
    assert '"model_name":"model-0000"' in quickstart and '"name":"y","datatype":"FP32","shape":[1,2]' in quickstart
    assert re.search(r"model-0000\s+demo\s+LOADED", quickstart), quickstart
    assert "vePsv7MMYb8=" in grpcurl, grpcurl  # the README's base64 answer, read as it says
    assert re.search(r"ready: grpc port \d+, peer port \d+, http port \d+, metrics port \d+", second), second
