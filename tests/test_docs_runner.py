"""The runner of the docs' shell blocks (meshd.testing.docs): a block that fails or hangs fails
the run at once or at its limit, never hangs it, and what the session started is stopped."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from meshd.testing.docs import BlockFailed, fences, run_blocks, shell_blocks

PAGE = """
text
```bash
sleep 300 &
echo started $!
```
```yaml
not: run
```
```sh
echo second; jobs
```
```text
false
```
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_shell_blocks_in_order_and_one_session(tmp_path: Path) -> None:
    blocks = shell_blocks(PAGE)
    assert [(b.index, b.line, b.text) for b in blocks] == [
        (0, 3, "sleep 300 &\necho started $!\n"),
        (1, 10, "echo second; jobs\n"),
    ]
    ran = run_blocks(blocks, tmp_path, dict(os.environ), 30, stop_grace_s=5)
    found = re.search(r"started (\d+)", ran[0].output)
    assert found and "Running" in ran[1].output  # the job of block 0 is %1 in block 1
    assert not alive(int(found.group(1)))  # stopped with the session


@pytest.mark.parametrize(
    ("last", "words"), [("false", "ended the session (exit 1)"), ("sleep 60", "ran past its limit")]
)
def test_a_failing_or_hanging_block_fails_the_run(tmp_path: Path, last: str, words: str) -> None:
    blocks = shell_blocks(f"```bash\nsleep 300 &\necho started $!\n```\n```bash\n{last}\n```\n")
    began = time.monotonic()
    with pytest.raises(BlockFailed, match=re.escape(words)) as failed:
        run_blocks(blocks, tmp_path, dict(os.environ), 2, stop_grace_s=5)
    assert time.monotonic() - began < 30
    found = re.search(r"started (\d+)", str(failed.value))
    assert found and not alive(int(found.group(1)))


def test_shell_fences_and_blocks_marked_not_run() -> None:
    page = (
        "```shell\necho a\n```\n"
        "```bash (not run: needs a Kubernetes cluster)\nkubectl apply -f x\n```\n"
        "```\nno language\n```\n"
        "```sh\necho b\n```\n"
    )
    assert [(b.index, b.line, b.text) for b in shell_blocks(page)] == [(0, 1, "echo a\n"), (1, 10, "echo b\n")]
    assert [(f.line, f.language, f.not_run) for f in fences(page)] == [
        (1, "shell", ""),
        (4, "bash", "needs a Kubernetes cluster"),
        (7, "", ""),
        (10, "sh", ""),
    ]


def test_what_escaped_into_a_session_of_its_own_is_stopped(tmp_path: Path) -> None:
    """As `meshd demo`'s processes do: neither the session's group nor its end reaches them."""
    page = "```bash\nsetsid sleep 300 &\nsleep 0.5; echo started $! sessions $(ps -o sid= -p $$ $!)\n```\n"
    ran = run_blocks(shell_blocks(page), tmp_path, dict(os.environ), 30, stop_grace_s=5)
    found = re.search(r"started (\d+) sessions (\d+) (\d+)", ran[0].output)
    assert found and found.group(2) != found.group(3), ran[0].output  # it did escape
    assert not alive(int(found.group(1)))
