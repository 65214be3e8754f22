"""A child process that cannot hang its parent while starting, and whose exit is always seen.

Not `asyncio.create_subprocess_exec`: under uvloop every spawn is a fork() of the whole
process that runs Python in the child before exec (uvloop's at-fork hook calls
PyOS_AfterFork_Child, then any preexec_fn), after gRPC's fork handlers have run in the parent.
In a process with gRPC's threads that can deadlock, and the parent's event loop waits for the
exec: one stuck child froze meshd for good. `subprocess.Popen` without a preexec_fn uses
vfork: the child runs only C code up to exec, and no fork handler runs at all.

The parent-death signal needs code in the child, so a small guard program sets it: a fresh
Python (no site, no environment) that sets it, checks that the parent that started it is
still there, and execs the real command in place (same pid, same argv). A thread of the
child's own waits for it, so its exit is known whatever the event loop tracks.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO

GUARD_PARENT_GONE = 125  # the guard's exit status when its parent died before it could exec
GUARD_CANNOT_EXEC = 127  # ... when the exec failed (as a shell's "command not found")

# argv: parent pid, executable, the command's argv (argv[0] as given). Python ignores SIGPIPE
# and SIGXFSZ, and an ignored signal stays ignored across exec: the command gets the defaults
# back, as Popen's restore_signals gives them.
_GUARD = f"""\
import ctypes, os, signal, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # PR_SET_PDEATHSIG
    sys.stderr.write("meshd guard: no parent-death signal: %s\\n" % os.strerror(ctypes.get_errno()))
if os.getppid() != int(sys.argv[1]):
    os._exit({GUARD_PARENT_GONE})  # the parent died before the signal was set
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
try:
    os.execv(sys.argv[2], sys.argv[3:])
except OSError as e:
    sys.stderr.write("meshd guard: cannot run %s: %s\\n" % (sys.argv[2], e))
    os._exit({GUARD_CANNOT_EXEC})
"""

Output = int | IO[bytes] | None


def resolve(program: str, env: Mapping[str, str] | None = None) -> str:
    """The executable `program` names (a path, or a name looked up on the PATH the child gets);
    FileNotFoundError if there is none, so a missing program fails at start, not in the guard."""
    search = (os.environ if env is None else env).get("PATH", os.defpath)
    path = program if os.sep in program else shutil.which(program, path=search)
    if path is None or not os.access(path, os.X_OK) or os.path.isdir(path):
        raise FileNotFoundError(errno.ENOENT, "no such executable", program)
    return path


def guarded_argv(executable: str, argv: Sequence[str], parent_pid: int) -> list[str]:
    """The guard's command line: it sets the parent-death signal, then execs `argv`."""
    return [sys.executable, "-I", "-S", "-c", _GUARD, str(parent_pid), executable, *argv]


def popen_args(
    argv: Sequence[str], env: Mapping[str, str] | None = None, die_with_parent: bool = True
) -> tuple[str, list[str]]:
    """Popen's `executable` and `args` for `argv`: its program resolved (FileNotFoundError if
    there is none), behind the guard when it should die with its parent (Linux only)."""
    executable = resolve(argv[0], env)
    if die_with_parent and sys.platform == "linux":
        return sys.executable, guarded_argv(executable, argv, os.getpid())
    return executable, list(argv)


class Child:
    """A started child. `start` from the event loop's thread: the parent-death signal follows
    the thread that spawned the child (PR_SET_PDEATHSIG), and the loop's thread lives as long as
    the process."""

    def __init__(self, popen: subprocess.Popen[bytes], loop: asyncio.AbstractEventLoop) -> None:
        self._popen = popen
        self.pid = popen.pid
        self._exited: asyncio.Future[int] = loop.create_future()
        self._lock = threading.Lock()  # a signal is sent only while the pid is still this child's
        self._reaped = False
        threading.Thread(target=self._reap, args=(loop,), name=f"reap-{self.pid}", daemon=True).start()

    @classmethod
    def start(
        cls,
        argv: Sequence[str],
        *,
        stdout: Output = None,
        stderr: Output = None,
        env: Mapping[str, str] | None = None,
        new_session: bool = False,
        die_with_parent: bool = True,
    ) -> Child:
        """Start `argv` (blocks until the exec of the guard, or of the command: a few ms). On Linux
        the command dies with the thread that started it (the parent-death signal, unless
        `die_with_parent` is False)."""
        loop = asyncio.get_running_loop()
        executable, args = popen_args(argv, env, die_with_parent)
        popen = subprocess.Popen(
            args, executable=executable, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
            env=env, start_new_session=new_session, close_fds=True,
        )  # fmt: skip
        return cls(popen, loop)

    def _reap(self, loop: asyncio.AbstractEventLoop) -> None:
        # Wait for the exit without reaping (the pid stays this child's, a zombie), close the
        # door on signals, then reap: a signal never reaches a pid the system may have reused.
        with contextlib.suppress(ChildProcessError, InterruptedError):
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        with self._lock:
            self._reaped = True
        code = self._popen.wait()
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
            loop.call_soon_threadsafe(self._set_exited, code)

    def _set_exited(self, code: int) -> None:
        if not self._exited.done():
            self._exited.set_result(code)

    @property
    def returncode(self) -> int | None:
        """The exit status once it has exited (minus the signal that killed it), else None."""
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        """Signal it, unless it has exited (then its pid may be reused: nothing is sent)."""
        with self._lock:
            if self._reaped:
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def signal_group(self, sig: int) -> None:
        """Signal its process group (a child started with `new_session`), the leader gone or not:
        servers that start workers of their own (vLLM) leave them behind when only the leader
        dies. Safe after the leader is reaped: Linux reuses no pid while a group of that id has
        a member, and with none left the signal reaches nobody."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)


async def run(argv: Sequence[str], timeout_s: float = 60.0) -> tuple[int, str]:
    """Run a short command to its end (vfork, in a worker thread); its exit status and its
    output, stdout and stderr together."""
    done = await asyncio.to_thread(
        subprocess.run, list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        timeout=timeout_s, check=False,
    )  # fmt: skip
    return done.returncode, done.stdout.decode(errors="replace")
