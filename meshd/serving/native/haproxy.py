"""The HAProxy process the native data plane runs, and its runtime API (unix socket).

One process per meshd, in the foreground (`-db`) as meshd's child: meshd writes its
configuration and empty maps, checks the configuration (`-c`), starts it, and talks to it
only through the runtime API (maps and server addresses change without reloads). If it
exits, `running` says so and the plane starts it again from scratch. It is started as a
`meshd.process.child.Child`: no fork of meshd's threads, and it dies with meshd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
from pathlib import Path

from meshd.process.child import Child, resolve, run

log = logging.getLogger("meshd.native")

START_TIMEOUT_S = 10.0
CHECK_TIMEOUT_S = 60.0  # `haproxy -v` and `-c`
STOP_GRACE_S = 5.0
COMMANDS_PER_CALL = 200  # runtime API commands joined by ';' on one connection


class HAProxyError(Exception):
    pass


def find_haproxy(setting: str) -> str | None:
    """The executable `setting` names (a path, or a name looked up on PATH), or None."""
    try:
        return resolve(setting)
    except FileNotFoundError:
        return None


async def haproxy_version(executable: str) -> str:
    """`haproxy -v`'s first line ("HAProxy version 2.6.12-1+deb12u3 2025/10/03 - ..."); HAProxyError
    when it does not run."""
    try:
        code, out = await run([executable, "-v"], CHECK_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        raise HAProxyError(f"{executable} does not run: {e}") from None
    first = out.splitlines()[:1]
    if code != 0 or not first:
        raise HAProxyError(f"{executable} -v failed: {out.strip()[:300]}")
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
        self.proc: Child | None = None
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
            self._write_files()  # a few small local files: not worth a thread
            code, out = await run([self.executable, "-c", "-f", str(self.config_path)], CHECK_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as e:
            raise HAProxyError(f"{self.executable} does not run: {e}") from None
        if code != 0:
            lines = out.splitlines()
            alerts = [line for line in lines if "ALERT" in line] or lines
            raise HAProxyError(f"haproxy rejected its configuration: {' | '.join(alerts)[:800]}")
        return version

    async def start(self) -> None:
        """Check the configuration, start, wait for the runtime API."""
        await self.check()
        logfile = self.log_path.open("ab")  # the child holds it open
        try:  # it dies with meshd, however meshd dies: no HAProxy left holding the external port
            self.proc = Child.start(
                [self.executable, "-db", "-f", str(self.config_path)], stdout=logfile, stderr=logfile
            )
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
        proc.send_signal(signal.SIGUSR1)
        try:
            await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
