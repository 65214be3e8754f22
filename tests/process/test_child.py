"""meshd.process.child with real processes: exit seen and reaped, argv kept, a missing program
refused at start, death with the parent (kill -9 included), the guard's check of its parent,
and no fork handler run by a start (uvloop's own spawn, the control, runs them)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from meshd.process.child import GUARD_CANNOT_EXEC, GUARD_PARENT_GONE, Child, guarded_argv, resolve, run
from meshd.testing.procs import wait_until


def _gone(pid: int) -> bool:
    """Exited and reaped, or a zombie nobody reaps (a dead parent's child, before init does)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def _program(pid: int) -> bytes | None:
    cmdline = _cmdline(pid)
    return None if cmdline is None else cmdline[0]


def _cmdline(pid: int) -> list[bytes] | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return None


async def test_the_exit_status_is_seen_and_the_child_reaped() -> None:
    child = Child.start(["sh", "-c", "exit 3"])
    assert await asyncio.wait_for(child.wait(), 10) == 3
    assert child.returncode == 3
    assert _cmdline(child.pid) is None  # reaped: no zombie left


async def test_a_killed_child_reports_the_signal_and_is_never_signalled_once_it_exited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    child = Child.start(["sleep", "60"])
    await asyncio.to_thread(wait_until, lambda: _program(child.pid) == b"sleep", 10, "the exec")
    assert child.returncode is None
    child.kill()
    assert await asyncio.wait_for(child.wait(), 10) == -signal.SIGKILL
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    child.send_signal(signal.SIGTERM)  # its pid may belong to another process by now
    assert sent == []


async def test_argv_is_the_commands_own_after_the_guard(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with out.open("wb") as f:
        child = Child.start(["sh", "-c", 'echo "$0 $1"; sleep 30', "zero", "one"], stdout=f)
    try:
        wait_until(lambda: out.read_bytes() != b"", 10, "the child's output")
        cmdline = _cmdline(child.pid)
        assert cmdline is not None and cmdline[:2] == [b"sh", b"-c"]  # the real command in place of the guard, same pid
        assert out.read_text() == "zero one\n"
    finally:
        child.kill()
        await child.wait()


async def test_a_missing_program_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Child.start(["no-such-program-meshd"])
    with pytest.raises(FileNotFoundError):
        Child.start([str(tmp_path)])  # a directory
    with pytest.raises(FileNotFoundError):
        resolve("sh", env={"PATH": str(tmp_path)})  # looked up on the child's PATH
    assert resolve("sh") == resolve("sh", env={"PATH": os.environ["PATH"]})


async def test_a_program_that_cannot_be_executed_exits_127_with_the_reason(tmp_path: Path) -> None:
    script = tmp_path / "no-shebang"
    script.write_bytes(b"\x7fELF not really\n")
    script.chmod(0o755)
    err = tmp_path / "err"
    with err.open("wb") as f:
        child = Child.start([str(script)], stderr=f)
    assert await asyncio.wait_for(child.wait(), 30) == GUARD_CANNOT_EXEC
    assert "meshd guard: cannot run" in err.read_text()


async def test_the_command_gets_the_default_signal_dispositions_back(tmp_path: Path) -> None:
    """Python (the guard) ignores SIGPIPE and SIGXFSZ; an ignored signal survives exec."""
    out = tmp_path / "status"
    with out.open("wb") as f:
        child = Child.start(["cat", "/proc/self/status"], stdout=f)
    assert await asyncio.wait_for(child.wait(), 30) == 0
    ignored = int(next(line for line in out.read_text().splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        assert not ignored & (1 << (sig - 1)), sig


async def test_run_gives_the_status_and_both_streams() -> None:
    code, out = await run(["sh", "-c", "echo out; echo err >&2; exit 4"])
    assert code == 4
    assert sorted(out.split()) == ["err", "out"]


def test_the_guard_refuses_to_run_for_a_parent_that_is_gone(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    argv = guarded_argv("/bin/sh", ["sh", "-c", f"touch {marker}"], parent_pid=os.getpid() + 1_000_000)
    assert subprocess.run(argv, timeout=30).returncode == GUARD_PARENT_GONE
    assert not marker.exists()
    argv = guarded_argv("/bin/sh", ["sh", "-c", f"touch {marker}"], parent_pid=os.getpid())
    assert subprocess.run(argv, timeout=30).returncode == 0
    assert marker.exists()


PARENT = textwrap.dedent(
    """
    import asyncio, sys, uvloop
    from meshd.process.child import Child
    async def main():
        child = Child.start(["sleep", "120"])
        print(child.pid, flush=True)
        await asyncio.sleep(120)
    uvloop.run(main())
    """
)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_child_dies_with_its_parent(sig: int) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child_pid = 0
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        wait_until(lambda: Path(f"/proc/{child_pid}/cmdline").read_bytes().startswith(b"sleep\0"), 10, "the exec")
        parent.send_signal(sig)
        parent.wait(10)
        wait_until(lambda: _gone(child_pid), 10, "the child to die with its parent")
    finally:
        parent.kill()
        parent.wait()
        if child_pid and not _gone(child_pid):
            os.kill(child_pid, signal.SIGKILL)


FORKS = textwrap.dedent(
    """
    import asyncio, ctypes, sys, uvloop
    from meshd.process.child import Child, run
    forks = [0]
    counted = ctypes.CFUNCTYPE(None)(lambda: forks.__setitem__(0, forks[0] + 1))
    # A fork handler as gRPC's are (pthread_atfork): fork() runs it, vfork does not.
    assert ctypes.CDLL("libc.so.6").__register_atfork(counted, None, None, None) == 0
    async def main():
        if sys.argv[1] == "child":
            for _ in range(3):
                await Child.start(["true"]).wait()
                await run(["true"])
        else:  # the control: uvloop's own spawn forks
            proc = await asyncio.create_subprocess_exec("true")
            await proc.wait()
        print(forks[0])
    uvloop.run(main())
    """
)


@pytest.mark.parametrize(("how", "forks"), [("child", False), ("uvloop", True)])
def test_a_start_runs_no_fork_handler(how: str, forks: bool) -> None:
    """gRPC's fork handlers and Python code in a forked child of a threaded process are what hung
    a spawn; Child and run use vfork, which runs neither."""
    done = subprocess.run([sys.executable, "-c", FORKS, how], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (int(done.stdout) > 0) is forks
