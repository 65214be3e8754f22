"""What the benchmark scripts share: the event loop they drive load with, stopping every
child they started even when interrupted (SIGTERM is taken as Ctrl-C), per-process CPU and
memory from /proc, and the warning lines of a failed run's logs."""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from types import FrameType
from typing import Any, TypeVar

from meshd.testing.cluster import LocalMesh

T = TypeVar("T")

CLK_TCK = os.sysconf("SC_CLK_TCK")


def asyncio_run(coro: Coroutine[Any, Any, T]) -> T:
    """uvloop when available: the load generator should not be the bottleneck it can avoid being."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    result: T = uvloop.run(coro)
    return result


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces this run, for the printed results."""
    return shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join([script, *argv])


def log(msg: str) -> None:
    """Progress goes to stderr, so stdout holds only the figures."""
    print(msg, file=sys.stderr, flush=True)


def sigterm_as_interrupt() -> None:
    """SIGTERM takes the same path as Ctrl-C, so the finally blocks stop every child."""
    signal.signal(signal.SIGTERM, _raise_interrupt)


def stop_uninterrupted(mesh: LocalMesh) -> None:
    """mesh.stop() with SIGINT/SIGTERM held back until it is done.

    A second Ctrl-C (or the SIGTERM after one) arriving while children are being stopped
    would otherwise abort the stop half-way and leave the rest running; the held signal
    is delivered (as KeyboardInterrupt) once every child is gone.
    """
    held = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        mesh.stop()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# ---- per-process figures from /proc ---------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process (all threads), in seconds; NaN if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return float("nan")
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = data[data.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS), in bytes; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs; NaN with fewer than two distinct xs."""
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return float("nan")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def dump_logs(mesh: LocalMesh, log: Callable[[str], None], per_file: int = 30) -> None:
    """The warning/error lines of every child's log (stderr), for a failed run."""
    log_dir = mesh.workdir / "logs"
    if not log_dir.is_dir():
        return
    keys = ("ERROR", "WARNING", "Traceback", "Error", "CRITICAL")
    for path in sorted(log_dir.glob("*.log")):
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        hits = [ln for ln in lines if any(k in ln for k in keys)]
        if hits:
            log(f"  --- {path} ({len(hits)} warning/error lines, last {min(per_file, len(hits))}) ---")
            for ln in hits[-per_file:]:
                log(f"    {ln}")
