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

import re
import sys
from pathlib import Path

import pytest

from meshd.testing.docs import Block, ServePorts, reader_env, run_blocks, shell_blocks, swap_ports
from meshd.testing.procs import free_ports

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"
SETUP = ("python3 scripts/dev.py demo", "pip install .")  # what the blocks skipped begin with
LIMIT_S = 120.0  # per block: a start-up and a load on 2 busy cores take seconds, a hang forever


def test_the_readme_runs_as_written_in_order(tmp_path: Path) -> None:
    blocks = shell_blocks(README.read_text())
    skipped = [b for b in blocks if b.text.startswith(SETUP)]
    assert [b.text.split("#")[0].strip() for b in skipped] == [
        "python3 scripts/dev.py demo",
        "pip install .",
    ], "the README's set-up blocks changed: say here what stands in for them"
    ports = ServePorts.free()
    runtime, second_runtime = free_ports(2)  # none of ports': handed out lately
    swap = {"8085": runtime, "8086": second_runtime, "8091": ports.http, "8033": ports.grpc}
    ran_blocks = []
    for b in (b for b in blocks if b not in skipped):
        text = swap_ports(b.text, swap)
        if not ran_blocks:  # the quickstart
            assert "\nmeshd serve --runtime-port" in text, "the quickstart starts no meshd"
            text = text.replace("\nmeshd serve ", f"\n{ports.settings()}meshd serve ", 1)
        ran_blocks.append(Block(b.index, b.line, text))
    env = reader_env(tmp_path / "home", Path(sys.executable).parent)
    env["MESHD_ADDRESS"] = f"localhost:{ports.grpc}"  # the CLI's default 8033, swapped
    work = tmp_path / "work"
    work.mkdir()
    ran = run_blocks(ran_blocks, work, env, LIMIT_S)
    assert [r.block.line for r in ran] == [b.line for b in ran_blocks]
    quickstart, grpcurl, second, _stop = (r.output for r in ran)
    assert '"model_name":"model-0000"' in quickstart and '"name":"y","datatype":"FP32","shape":[1,2]' in quickstart
    assert re.search(r"model-0000\s+demo\s+LOADED", quickstart), quickstart
    assert "vePsv7MMYb8=" in grpcurl, grpcurl  # the README's base64 answer, read as it says
    assert re.search(r"ready: grpc port \d+, peer port \d+, http port \d+, metrics port \d+", second), second
