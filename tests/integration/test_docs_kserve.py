"""docs/kserve.md's shell blocks, run as a reader runs them (meshd.testing.docs): in order, as
written, in one shell session in an empty directory, each with a time limit.

What is not as written, and why:
- meshd is not installed by the page: it is already installed in the venv running this test,
  which is first on PATH;
- the default ports (8085 and 8091 in the text; 8033, 8080, 2112, 8089, 8090 taken by default)
  are swapped for free ones, since other processes on this host may hold them: in the text, and
  by settings put before `meshd serve` on its line, as a reader would.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from meshd.testing.docs import ServePorts, reader_env, run_blocks, shell_blocks, with_ports
from meshd.testing.procs import free_port

pytestmark = pytest.mark.slow

PAGE = Path(__file__).resolve().parents[2] / "docs" / "kserve.md"
LIMIT_S = 120.0  # per block: a start-up and a load on 2 busy cores take seconds, a hang forever


def test_the_kserve_page_runs_as_written_in_order(tmp_path: Path) -> None:
    ports, runtime = ServePorts.free(), free_port()
    blocks = with_ports(shell_blocks(PAGE.read_text()), {"8085": runtime, "8091": ports.http}, ports, serves=1)
    work = tmp_path / "work"
    work.mkdir()
    env = reader_env(tmp_path / "home", Path(sys.executable).parent)
    ran = run_blocks(blocks, work, env, LIMIT_S)
    started, repository, infer, _stop = (r.output for r in ran)
    assert '{"ready": true}' in started, started
    answers = [line for line in repository.splitlines() if line.startswith(("{", "["))]  # not meshd's log
    assert [json.loads(a) for a in answers][:1] == [{}], repository
    assert [(m["name"], m["state"]) for m in json.loads(answers[1])] == [("m1", "READY")], repository
    answer = json.loads(next(line for line in infer.splitlines() if line.startswith("{")))
    assert answer["model_name"] == "m1" and answer["outputs"][0]["shape"] == [1, 2], infer
