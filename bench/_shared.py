"""What the benchmark scripts share: the event loop they drive load with and the worker pool
that sends it, the check of an answer and the tally of a run, stopping every child they
started even when interrupted (SIGTERM is taken as Ctrl-C), per-process CPU and memory from
/proc, and the warning lines of a failed run's logs."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shlex
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
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


@contextlib.contextmanager
def mesh_of_run(mesh: LocalMesh) -> Iterator[LocalMesh]:
    """The mesh of one run: its children's warning lines logged if the run fails (an interrupt
    too), every child stopped (stop_uninterrupted) after it either way."""
    try:
        yield mesh
    except BaseException:
        dump_logs(mesh, log)
        raise
    finally:
        stop_uninterrupted(mesh)


# ---- driving load ----------------------------------------------------------------------------
async def run_pool(n: int, concurrency: int, op: Callable[[int], Awaitable[None]]) -> None:
    """op(0) .. op(n-1), each started in order by the first of `concurrency` workers free."""
    next_i = 0

    async def worker() -> None:
        nonlocal next_i
        while next_i < n:
            i = next_i
            next_i += 1
            await op(i)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def answer_ok(got: Sequence[float], expected: Sequence[float]) -> bool:
    """One output row against the one the model file says, to float32 precision."""
    return len(got) == len(expected) and all(
        math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-4) for a, b in zip(got, expected, strict=True)
    )


FIRST_ERRORS = 5  # failures described one by one in a run's report; the rest are only counted


@dataclass
class Tally:
    """The answers of a run: right, wrong, failed by code, and the first few failures described."""

    ok: int = 0
    wrong: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    first_errors: list[str] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)

    @property
    def n_errors(self) -> int:
        return sum(self.errors.values())

    def failed(self, code: str, description: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1
        if len(self.first_errors) < FIRST_ERRORS:
            self.first_errors.append(description)

    def answered(self, ok: bool, what: str) -> None:
        """`what` names the request ("request 7 (model-0003)") for a wrong answer's description."""
        if ok:
            self.ok += 1
        else:
            self.wrong += 1
            if len(self.first_errors) < FIRST_ERRORS:
                self.first_errors.append(f"{what}: wrong answer")


def progress(label: str, total: int, say: Callable[[str], None] = log) -> Callable[[int], None]:
    """An on_done(n) that logs "label: n/total" at each quarter of the way."""
    shown = 0

    def on_done(n: int) -> None:
        nonlocal shown
        if n * 4 // total > shown:
            shown = n * 4 // total
            say(f"    {label}: {n}/{total}")

    return on_done


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


def system_seconds(pid: int) -> float:
    """stime of a whole process (all threads), in seconds: its time in the kernel (socket
    calls, for a relay); NaN if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return float("nan")
    return int(data[data.rindex(b")") + 2 :].split()[12]) / CLK_TCK


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
