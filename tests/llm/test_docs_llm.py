"""docs/llm.md's shell blocks, run as a reader runs them (meshd.testing.docs): in order, as
written, in one shell session, in a directory holding a tiny GGUF this test makes as the
reader's `my-llm.gguf`, each block with a time limit.

What is not as written, and why:
- the set-up block (a venv compiling llama.cpp, ~9 min) is not run: `~/.venvs/llama` (HOME is
  a fresh folder) is the llama.cpp venv the tests already built (.venvs/), linked there;
- the default ports (8085, 8091, the store's 8000 in the text; 8033, 8080, 2112, 8089, 8090 taken by default)
  are swapped for free ones, in the text and by settings on the `meshd serve` line, as in
  tests/integration/test_docs_run.py.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from meshd.testing.docs import ServePorts, reader_env, run_blocks, shell_blocks, with_ports
from meshd.testing.llm import make_gguf
from meshd.testing.procs import free_ports

pytestmark = pytest.mark.slow

PAGE = Path(__file__).resolve().parents[2] / "docs" / "llm.md"
SETUP = "# llama.cpp (llama-cpp-python's server) in a venv of its own"
LIMIT_S = 180.0  # per block: an engine's first start on 2 busy cores takes seconds, a hang forever


def test_the_llm_page_runs_as_written_in_order(llama_python: Path, tmp_path: Path) -> None:
    blocks = shell_blocks(PAGE.read_text())
    assert blocks and blocks[0].text.startswith(SETUP), "the page's set-up block changed: say what stands in for it"
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".venvs").mkdir(parents=True)
    work.mkdir()
    (home / ".venvs" / "llama").symlink_to(llama_python.parent.parent)
    (made,) = make_gguf(llama_python, tmp_path / "gguf", 1)
    shutil.move(made, work / "my-llm.gguf")
    ports, (runtime, store) = ServePorts.free(), free_ports(2)
    swap = {"8085": runtime, "8091": ports.http, "8000": store}
    run = with_ports(blocks[1:], swap, ports, serves=2)  # a meshd, then one whose runtime pulls
    env = reader_env(home, Path(sys.executable).parent)
    env["MESHD_ADDRESS"] = f"localhost:{ports.grpc}"  # the CLI's default 8033, swapped
    ran = run_blocks(run, work, env, LIMIT_S)
    started, stored = (r.output.replace(" ", "") for r in ran[:2])
    assert '"object":"chat.completion"' in started and '"model":"my-llm"' in started, started
    assert '"object":"chat.completion"' in stored and '"model":"stored-llm"' in stored, stored
    assert (work / "models" / "stored-llm" / "my-llm.gguf").is_file()  # pulled from the store
