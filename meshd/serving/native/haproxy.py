"""The HAProxy process the native data plane runs, and its runtime API (unix socket).

One process per meshd, in the foreground (`-db`) as meshd's child: meshd writes its
configuration and empty maps, checks the configuration (`-c`), starts it, and talks to it
only through the runtime API (maps and server addresses change without reloads). If it
exits, `running` says so and the plane starts it again from scratch.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
from pathlib import Path

log = logging.getLogger("meshd.native")

START_TIMEOUT_S = 10.0
STOP_GRACE_S = 5.0
COMMANDS_PER_CALL = 200  # runtime API commands joined by ';' on one connection


class HAProxyError(Exception):
    pass


PR_SET_PDEATHSIG = 1
# Resolved here, in the parent: the child of a threaded process (gRPC's threads) must not load
# a library between fork and exec. It did (ctypes.CDLL in the child), and a child that forked
# while another thread held the loader's lock hung before exec, and meshd with it, in Popen,
# waiting for that exec. (meshd.adapter.supervisor resolves its own the same way.)
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when meshd dies, however it dies (kill -9 included),
    so no HAProxy outlives its control plane holding the external port."""
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)


def find_haproxy(setting: str) -> str | None:
    """The executable `setting` names (a path, or a name looked up on PATH), or None."""
    if os.sep in setting:
        return setting if os.access(setting, os.X_OK) else None
    return shutil.which(setting)


async def haproxy_version(executable: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        executable, "-v", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    first = out.decode(errors="replace").splitlines()[:1]
    if proc.returncode != 0 or not first:
        raise HAProxyError(f"{executable} -v failed: {out.decode(errors='replace').strip()[:300]}")
    return first[0]


class HAProxy:
    def __init__(
        self, executable: str, config_text: str, workdir: Path, empty_maps: list[str], api_socket: str
    ) -> None:
        self.executable = executable
        self.config_text = config_text
        self.workdir = workdir
        self.config_path = workdir / "haproxy.cfg"
        self.log_path = workdir / "haproxy.log"
        self.empty_maps = empty_maps
        self.api_socket = api_socket
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def _write_files(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.config_text)
        for path in self.empty_maps:
            Path(path).write_text("")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.api_socket)

    async def check(self) -> str:
        """HAProxy's version line, once it has accepted the configuration (written first, with
        empty maps). HAProxyError says why not."""
        try:
            version = await haproxy_version(self.executable)
        except OSError as e:
            raise HAProxyError(f"{self.executable} does not run: {e}") from None
        self._write_files()  # a few small local files: not worth a thread
        check = await asyncio.create_subprocess_exec(
            self.executable, "-c", "-f", str(self.config_path),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await check.communicate()
        if check.returncode != 0:
            lines = out.decode(errors="replace").splitlines()
            alerts = [line for line in lines if "ALERT" in line] or lines
            raise HAProxyError(f"haproxy rejected its configuration: {' | '.join(alerts)[:800]}")
        return version

    async def start(self) -> None:
        """Check the configuration, start, wait for the runtime API."""
        await self.check()
        logfile = self.log_path.open("ab")  # the child holds it open
        try:
            self.proc = await asyncio.create_subprocess_exec(
                self.executable, "-db", "-f", str(self.config_path),
                stdin=asyncio.subprocess.DEVNULL, stdout=logfile, stderr=logfile, preexec_fn=_die_with_parent,
            )  # fmt: skip
        finally:
            logfile.close()
        self.starts += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT_S
        while True:
            if not self.running:
                raise HAProxyError(f"haproxy exited at start-up ({self._log_tail()})")
            try:
                await self.command("show info")
                return
            except OSError:
                if loop.time() > deadline:
                    await self.stop()
                    raise HAProxyError(f"haproxy's runtime API did not answer in {START_TIMEOUT_S:.0f} s") from None
                await asyncio.sleep(0.02)

    def _log_tail(self) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-4:])
        except OSError:
            return "no log"

    async def command(self, command: str) -> str:
        """One runtime API command (or several joined by ';'); its whole answer."""
        reader, writer = await asyncio.open_unix_connection(self.api_socket)
        try:
            writer.write(command.encode() + b"\n")
            await writer.drain()
            return (await reader.read()).decode(errors="replace")
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def commands(self, commands: list[str]) -> None:
        """Run commands in batches; raises HAProxyError when one answers with an error."""
        for i in range(0, len(commands), COMMANDS_PER_CALL):
            answer = await self.command(";".join(commands[i : i + COMMANDS_PER_CALL]))
            for line in answer.splitlines():
                low = line.lower()
                if low.startswith(("unknown", "error", "no such", "'")) or "not found" in low or "invalid" in low:
                    raise HAProxyError(f"haproxy runtime API: {line.strip()}")

    async def stop(self) -> None:
        """Soft stop (SIGUSR1: stop listening, let streams in flight finish), then SIGKILL."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGUSR1)
        try:
            await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
