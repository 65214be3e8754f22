"""docs/storage.md's shell blocks, run as a reader runs them (meshd.testing.docs): in order, as
written, in one shell session in an empty directory, each with a time limit.

What is not as written, and why: meshd is not installed by the page (it is already installed in
the venv running this test, first on PATH); the HTTP server's port (8000 in the text) is swapped
for a free one, since other processes on this host may hold it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from meshd.testing.docs import Block, reader_env, run_blocks, shell_blocks, swap_ports
from meshd.testing.procs import free_port

PAGE = Path(__file__).resolve().parents[2] / "docs" / "storage.md"
LIMIT_S = 60.0  # per block: a pull of 64 KiB from loopback takes milliseconds, a hang forever


def test_the_storage_page_runs_as_written_in_order(tmp_path: Path) -> None:
    port = free_port()
    blocks = [Block(b.index, b.line, swap_ports(b.text, {"8000": port})) for b in shell_blocks(PAGE.read_text())]
    work = tmp_path / "work"
    work.mkdir()
    (ran,) = run_blocks(blocks, work, reader_env(tmp_path / "home", Path(sys.executable).parent), LIMIT_S)
    pulled = work / "models" / "mnist-svm" / "mnist-svm.joblib"
    assert pulled.read_bytes() == (work / "store" / "sklearn" / "mnist-svm.joblib").read_bytes()
    decoder, text, answers = json.JSONDecoder(), ran.output, []
    for start in (i for i, c in enumerate(text) if c == "{" and (i == 0 or text[i - 1] == "\n")):
        answers.append(decoder.raw_decode(text, start)[0])
    pull, inventory = answers
    assert pull["local_path"] == "models/mnist-svm/mnist-svm.joblib" and pull["disk_size_bytes"] == 65536, pull
    assert [(m["model_id"], m["size_bytes"]) for m in inventory["models"]] == [("mnist-svm", 65536)], inventory
