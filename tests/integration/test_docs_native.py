"""docs/native.md's shell blocks, run as a reader runs them (meshd.testing.docs): in order, as
written, in one shell session in an empty directory, each with a time limit.

What is not as written, and why:
- the set-up block (`apt-get install haproxy`, which needs root) is not run: the HAProxy the
  native tests use (found, or fetched from Debian's packages without installing anything:
  meshd.testing.haproxy) is first on PATH instead, linked as `haproxy`, as an installed one
  would be; meshd is
  already installed in the venv running this test, next on PATH;
- the default ports (8085 and 8033 in the text; 8080, 8091, 2112, 8089, 8090 taken by default)
  are swapped for free ones, since other processes on this host may hold them: in the text, and
  by settings put before `meshd serve` on its line, as a reader would.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from meshd.testing.docs import ServePorts, reader_env, run_blocks, shell_blocks, with_ports
from meshd.testing.procs import free_port

pytestmark = pytest.mark.slow

PAGE = Path(__file__).resolve().parents[2] / "docs" / "native.md"
SETUP = "apt-get install haproxy"
LIMIT_S = 120.0  # per block: a start-up and a load on 2 busy cores take seconds, a hang forever


def test_the_native_page_runs_as_written_in_order(haproxy_path: str, tmp_path: Path) -> None:
    setup, *rest = shell_blocks(PAGE.read_text())
    assert setup.text.startswith(SETUP), "the page's set-up block changed: say here what stands in for it"
    ports, runtime = ServePorts.free(), free_port()
    blocks = with_ports(rest, {"8085": runtime, "8033": ports.grpc}, ports, serves=1)
    work = tmp_path / "work"
    work.mkdir()
    env = reader_env(tmp_path / "home", Path(sys.executable).parent)
    installed = tmp_path / "bin"  # where apt-get would have put it, under the name it would have
    installed.mkdir()
    (installed / "haproxy").symlink_to(haproxy_path)
    env["PATH"] = f"{installed}{os.pathsep}{env['PATH']}"
    env["MESHD_ADDRESS"] = f"localhost:{ports.grpc}"  # the CLI's default 8033, swapped
    (ran,) = run_blocks(blocks, work, env, LIMIT_S)
    assert "data plane: native (HAProxy version " in ran.output, ran.output
    assert f"{installed}/haproxy, port {ports.grpc}), meshd its control plane" in ran.output, ran.output
    answer = json.loads(ran.output[ran.output.index('{\n  "model_name"') :].split("\n}\n")[0] + "\n}")
    assert answer["model_name"] == "model-0000" and answer["outputs"][0]["shape"] == ["1", "2"], answer
