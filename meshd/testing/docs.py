"""The shell blocks of a Markdown page, run as a reader runs them: in order, in one shell session
(jobs started with `&` in one block are `%N` in the next), each with a time limit, so a block
that fails fails the run and one that hangs is stopped instead of hanging it.

Blocks fenced ```bash, ```sh or ```console are shell; ```text, ```yaml, ```python and the rest
are not run. The session runs under `set -e`: a command that fails ends it, as a reader would
stop there. Whatever the session started is stopped by its process group at the end, even
when a block failed.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SHELL_FENCES = ("bash", "sh", "console")
_FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)


@dataclass(frozen=True, slots=True)
class Block:
    index: int  # among the page's shell blocks, from 0
    line: int  # where its fence opens in the page, from 1
    text: str


def shell_blocks(markdown: str) -> list[Block]:
    """The page's shell blocks, in order."""
    found: list[Block] = []
    for match in _FENCE.finditer(markdown):
        if match.group(1) in SHELL_FENCES:
            line = markdown.count("\n", 0, match.start()) + 1
            found.append(Block(len(found), line, match.group(2)))
    return found


class BlockFailed(AssertionError):
    """A block ended the session (a command failed) or ran past its time limit."""


@dataclass
class Ran:
    block: Block
    output: str
    seconds: float


def run_blocks(
    blocks: Sequence[Block],
    cwd: Path,
    env: Mapping[str, str],
    timeout_s: float | Callable[[Block], float],
    stop_grace_s: float = 30.0,
) -> list[Ran]:
    """Run `blocks` in order in one `bash` session in `cwd`; each block's output.

    BlockFailed naming the block, with the whole session's output, when one fails or runs past
    its limit. At the end (or on failure) the session's process group is sent SIGTERM, given
    `stop_grace_s` to stop (meshd drains), then SIGKILL."""
    proc = subprocess.Popen(
        ["bash", "--noprofile", "--norc"],
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, name="docs-session-output", daemon=True).start()
    assert proc.stdin is not None
    every: list[str] = []
    ran: list[Ran] = []
    try:
        proc.stdin.write("set -e\n")
        for block in blocks:
            limit = timeout_s(block) if callable(timeout_s) else timeout_s
            mark = f"__meshd_docs_block_{block.index}_done__"
            # The block as written, then a line saying it finished (its own line: the block's
            # last command may leave no newline).
            proc.stdin.write(block.text + f"\necho; echo {mark}\n")
            proc.stdin.flush()
            began = time.monotonic()
            out: list[str] = []
            while True:
                left = began + limit - time.monotonic()
                try:
                    # Short waits: a shell ended by `set -e` closes no pipe while the jobs it
                    # started hold it, so its end is seen by its exit status.
                    line = lines.get(timeout=min(max(left, 0.0), 0.5)) if left > 0 else None
                except queue.Empty:
                    if proc.poll() is None and left > 0:
                        continue
                    line = None
                if line is None:
                    every += out
                    ended = proc.poll()
                    why = "ran past its limit" if ended is None else f"ended the session (exit {ended})"
                    raise BlockFailed(
                        f"block {block.index} (line {block.line}) {why} ({limit:g} s):\n{block.text}\n"
                        f"--- session output ---\n{''.join(every)}"
                    )
                if line.strip() == mark:
                    break
                out.append(line)
            every += out
            ran.append(Ran(block, "".join(out), time.monotonic() - began))
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.write("exit 0\n")
            proc.stdin.flush()
        return ran
    finally:
        stop_group(proc, stop_grace_s)


def stop_group(proc: subprocess.Popen[str], grace_s: float) -> None:
    """SIGTERM to the session's process group (what it left running), then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _group_alive(proc.pid):
        proc.poll()  # reaps the shell: a zombie would count as alive
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
