"""Child processes that are always stopped (by PID), and free loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from meshd.process.child import popen_args

# Ports this process handed out lately. Nothing holds a port between the moment it is found
# free and the moment its user binds it, so the kernel may offer it again: a test that takes
# one port for a setting and then starts a node (which takes five more) once got the same port
# twice, and the node refused to start. Never handing out a port twice in a while closes that.
_HANDED_OUT: dict[int, None] = {}  # insertion order: the oldest first
_HANDED_OUT_MAX = 4096  # of ~28,000 ephemeral ports: long gone by the time one comes back
_LOCK = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago and that this process has not
    handed out lately."""
    return free_ports(1)[0]


def free_ports(n: int, avoid: Iterable[int] = ()) -> list[int]:
    """`n` distinct TCP ports on 127.0.0.1 that were free a moment ago, none in `avoid` and
    none handed out by this process lately (see `_HANDED_OUT`)."""
    held: list[socket.socket] = []
    with _LOCK:
        taken = set(avoid) | _HANDED_OUT.keys()
        try:
            while len(held) < n:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.bind(("127.0.0.1", 0))
                if s.getsockname()[1] in taken:
                    s.close()
                    continue
                taken.add(s.getsockname()[1])
                held.append(s)
            ports = [int(s.getsockname()[1]) for s in held]
        finally:
            for s in held:
                s.close()
        for port in ports:
            _HANDED_OUT[port] = None
        while len(_HANDED_OUT) > _HANDED_OUT_MAX:
            del _HANDED_OUT[next(iter(_HANDED_OUT))]
    return ports


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def marked_pids(name: str, value: str, proc: Path = Path("/proc")) -> list[int]:
    """Processes whose environment carries `name=value`: inherited by every descendant, so it
    finds what a test started even after it left the process group (a new session, a daemon)."""
    wanted = f"{name}={value}".encode()
    found = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                if wanted in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue  # gone meanwhile, or not ours to read
    return found


def wait_until(check: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


async def wait_until_async(check: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.02) -> None:
    """`wait_until` on an event loop: polls without blocking it (mirrors catching up, tasks)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        await asyncio.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


STARTED: list[Child] = []  # every child this test process started, for logs shown on a failure


class Child:
    """One child process with its output in a log file; `stop()` is idempotent."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        die_with_parent: bool = False,
    ) -> None:
        """`die_with_parent`: SIGKILL when the thread that starts it ends (`meshd.process.child`'s
        guard): for a program's children (`meshd demo`), not a test's, which stops them by PID."""
        self.name = name
        self.argv = list(argv)
        self.log_path = log_dir / f"{name}.log"
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # closed in stop()
        full_env = {**os.environ, **(env or {})}
        self.teardown_signal = signal.SIGTERM  # what `Children.stop_all` sends
        executable, argv = popen_args(self.argv, full_env, die_with_parent)
        self.proc = subprocess.Popen(
            argv, executable=executable, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
            start_new_session=True, cwd=cwd,
        )  # fmt: skip
        self.pid = self.proc.pid
        STARTED.append(self)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send_signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def stop(self, timeout_s: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(5)
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(timeout_s=5, sig=signal.SIGKILL)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Children:
    """A group of children stopped together, in reverse start order, even on failure."""

    def __init__(self, log_dir: Path, die_with_parent: bool = False) -> None:
        self.log_dir = log_dir
        self.die_with_parent = die_with_parent
        self.items: list[Child] = []

    def start(
        self, name: str, argv: Sequence[str], env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> Child:
        child = Child(name, argv, self.log_dir, env, cwd, self.die_with_parent)
        self.items.append(child)
        return child

    def python(self, name: str, module: str, args: Sequence[str], env: dict[str, str] | None = None) -> Child:
        return self.start(name, [sys.executable, "-m", module, *args], env)

    def stop_all(self) -> None:
        for child in reversed(self.items):
            child.stop(sig=child.teardown_signal)

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


@contextlib.contextmanager
def children(log_dir: Path) -> Iterator[Children]:
    group = Children(log_dir)
    try:
        yield group
    finally:
        group.stop_all()
