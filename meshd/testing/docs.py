"""The shell blocks of a Markdown page, run as a reader runs them: in order, in one shell session
(jobs started with `&` in one block are `%N` in the next), each with a time limit, so a block
that fails fails the run and one that hangs is stopped instead of hanging it.

Blocks fenced ```bash, ```sh, ```shell or ```console are shell; ```text, ```yaml, ```python and
the rest are not run, and neither is a shell block whose fence says why after its language
(```` ```bash (not run: needs a Kubernetes cluster) ````: GitHub still highlights it as bash).
The session runs under `set -e`: a command that fails ends it, as a reader would
stop there. Whatever the session started is stopped by its process group at the end, even
when a block failed, and so is whatever escaped into a session of its own (`meshd demo`'s
processes do): every process of the session carries a marker in its environment, and what
still carries it at the end is killed by PID.
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
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from meshd.testing.procs import free_ports, marked_pids

SESSION_MARKER = "MESHD_DOCS_SESSION"  # in the environment of everything a session starts
SHELL_FENCES = ("bash", "sh", "shell", "console")
_FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)([^\n]*)\n(.*?)^```\s*$", re.S | re.M)
_NOT_RUN = re.compile(r"^\s*\(not run: ([^)]*\S[^)]*)\)\s*$")


@dataclass(frozen=True, slots=True)
class Block:
    index: int  # among the page's shell blocks, from 0
    line: int  # where its fence opens in the page, from 1
    text: str


@dataclass(frozen=True, slots=True)
class Fence:
    line: int  # where it opens in the page, from 1
    language: str  # "" when the fence names none
    not_run: str  # the reason a shell block gives for not being run, else ""
    text: str


def fences(markdown: str) -> list[Fence]:
    """Every fenced block of the page, in order."""
    found: list[Fence] = []
    for match in _FENCE.finditer(markdown):
        line = markdown.count("\n", 0, match.start()) + 1
        why = _NOT_RUN.match(match.group(2))
        found.append(Fence(line, match.group(1), why.group(1).strip() if why else "", match.group(3)))
    return found


def shell_blocks(markdown: str) -> list[Block]:
    """The page's shell blocks to run, in order (not those marked `(not run: why)`)."""
    found: list[Block] = []
    for fence in fences(markdown):
        if fence.language in SHELL_FENCES and not fence.not_run:
            found.append(Block(len(found), fence.line, fence.text))
    return found


def reader_env(home: Path, bin_dir: Path, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A new reader's environment: `bin_dir` (where meshd is installed) first on PATH, `home`
    (made here, empty) as HOME, and no meshd setting of ours (MM_*, MESHD_*, KV_STORE*)."""
    home.mkdir(parents=True, exist_ok=True)
    env = {name: value for name, value in base.items() if not name.startswith(("MM_", "MESHD_", "KV_STORE"))}
    return env | {"PATH": f"{bin_dir}{os.pathsep}{base.get('PATH', '')}", "HOME": str(home)}


def swap_ports(text: str, ports: Mapping[str, int]) -> str:
    """`text` with each default port (a whole number, as in `localhost:8091`) swapped."""
    for default, port in ports.items():
        text = re.sub(rf"\b{default}\b", str(port), text)
    return text


def before_serve(text: str, settings: str) -> str:
    """`text` with `settings` put before its first `meshd serve` command, as a reader would."""
    return re.sub(
        r"(^|[\s;&|(])meshd serve ", lambda m: f"{m.group(1)}{settings}meshd serve ", text, count=1, flags=re.M
    )


@dataclass(frozen=True, slots=True)
class ServePorts:
    """Free ports for every port a `meshd serve` takes by default (8033, 8080, 8091, 2112,
    8089, 8090), as the settings a reader would put before it on its command line."""

    grpc: int
    peer: int
    http: int
    metrics: int
    probe: int
    prestop: int

    @classmethod
    def free(cls) -> ServePorts:
        return cls(*free_ports(6))

    def settings(self) -> str:
        return (
            f"MM_SVC_GRPC_PORT={self.grpc} MESHD_PEER_PORT={self.peer} MESHD_HTTP_PORT={self.http} "
            f"MM_METRICS='prometheus:port={self.metrics};scheme=http' MM_PROBE_PORT={self.probe} "
            f"MM_PRESTOP_WAIT_PORT={self.prestop} "
        )


def with_ports(blocks: list[Block], swap: dict[str, int], ports: ServePorts, serves: int) -> list[Block]:
    """`blocks` as a reader on a busy host runs them: `swap`'s default ports replaced by free
    ones, `ports`' settings before each page's `meshd serve`; the page must start `serves`
    meshd, or the swap missed one (and the test would reach a stranger's port)."""
    run = [Block(b.index, b.line, before_serve(swap_ports(b.text, swap), ports.settings())) for b in blocks]
    started = sum(ports.settings() in b.text for b in run)
    assert started == serves, f"the page starts {started} meshd serve, not {serves}"
    return run


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
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(
        ["bash", "--noprofile", "--norc"],
        cwd=cwd,
        env={**env, SESSION_MARKER: marker},
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
        stop_group(proc, stop_grace_s, marker)


def stop_group(proc: subprocess.Popen[str], grace_s: float, marker: str = "") -> None:
    """SIGTERM to the session's process group (what it left running), then SIGKILL; then
    SIGKILL to what carries `marker` (escaped the group into a session of its own), before the
    pipes close: such a process holds the output pipe open, and closing it would wait on the
    reader."""
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
    escaped = marked_pids(SESSION_MARKER, marker) if marker else []
    for pid in escaped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10  # SIGKILL lands asynchronously; their pipes close when they are gone
    while time.monotonic() < deadline and any(_running(pid) for pid in escaped):
        time.sleep(0.05)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def _running(pid: int) -> bool:
    """Not gone and not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
