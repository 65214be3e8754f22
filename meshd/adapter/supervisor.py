"""Keeps the model server running: start it (optionally), watch its health, restart it.

With a command, the server is a child process in its own process group: started, waited
for (ServerReady), checked for liveness every second (ServerLive: readiness turns false
while any model loads, which is no reason to kill a server), and killed and restarted with
backoff when it exits or fails several checks in a row. Without one, the server is someone
else's and only its liveness is watched. Either way `up` says whether it answers, and every
return after an outage counts as a new `generation`: the adapter then restores the models it
had loaded (in a task of its own, so the watch goes on), since a restarted server holds none.

A launched server dies with the adapter (parent-death signal), and one left by an adapter
that was killed before that could be set up is found through the pid file and killed. The pid
file is written whole (renamed into place) and removed once its server is reaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from meshd.process.child import Child

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    check_interval_s: float = 1.0
    failures_before_restart: int = 5  # consecutive failed liveness checks (a busy server may be slow)
    startup_timeout_s: float = 180.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    healthy_reset_s: float = 60.0  # healthy this long: the next restart starts from the initial backoff
    stop_grace_s: float = 5.0


def next_backoff(current_s: float, config: SupervisorConfig) -> float:
    """Doubling backoff between restarts, capped (pure)."""
    return min(config.backoff_max_s, max(config.backoff_initial_s, current_s * 2))


class Supervisor:
    def __init__(
        self,
        healthy: Callable[[], Awaitable[bool]],
        on_recovered: Callable[[], Awaitable[None]],
        command: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
        config: SupervisorConfig | None = None,
        pid_file: Path | None = None,
        ready: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        """`healthy`: liveness (after start-up); `ready`: start-up readiness (default: `healthy`)."""
        self.healthy = healthy
        self.ready = ready or healthy
        self.on_recovered = on_recovered
        self.command = list(command) if command else None
        self.env = env
        self.config = config or SupervisorConfig()
        self.pid_file = pid_file
        self.up = False
        self.generation = 0  # bumped each time the server comes back after being down
        self.restarts = 0
        self.process: Child | None = None
        self._up_changed = asyncio.Event()
        self._seen_up = False
        self._restore: asyncio.Task[None] | None = None

    async def wait_up(self, timeout_s: float) -> bool:
        """Whether the server answers, waiting up to `timeout_s` for it."""
        return await self._wait(lambda: self.up, timeout_s)

    async def wait_recovered(self, after_generation: int, timeout_s: float) -> bool:
        """Whether the server came back from an outage (a generation after `after_generation`)
        and is up, waiting up to `timeout_s`."""
        return await self._wait(lambda: self.up and self.generation > after_generation, timeout_s)

    async def _wait(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not condition():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            event = self._up_changed  # replaced and set on every change of `up`
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await event.wait()
        return True

    @property
    def restoring(self) -> bool:
        return self._restore is not None and not self._restore.done()

    def _set_up(self, up: bool) -> None:
        if not up and self._restore is not None:
            self._restore.cancel()  # a restore against a dead server only forgets models
            self._restore = None
        if up != self.up:
            self.up = up
            event, self._up_changed = self._up_changed, asyncio.Event()
            event.set()

    async def run(self) -> None:
        """Supervise until cancelled (then stop the child, if any)."""
        try:
            if self.command:
                self._kill_leftover()
                await self._run_child()
            else:
                await self._watch()
        finally:
            self._set_up(False)
            await self.stop_child()

    async def _watch(self) -> None:
        failures = 0
        was_up = False
        while True:
            ok = await self._check(None if was_up else self.ready)
            failures = 0 if ok else failures + 1
            if ok and not was_up:
                await self._recovered()
                was_up = True
            elif not ok and failures >= self.config.failures_before_restart and was_up:
                log.warning("model server stopped answering")
                self._set_up(False)
                self.restarts += 1
                was_up = False
            await asyncio.sleep(self.config.check_interval_s)

    async def _run_child(self) -> None:
        backoff = 0.0
        loop = asyncio.get_running_loop()
        while True:
            await self._start_child()
            healthy_since = None
            if await self._wait_ready():
                healthy_since = loop.time()
                await self._recovered()
                await self._monitor_child()
            self._set_up(False)
            await self.stop_child(kill=True)
            self.restarts += 1
            long_healthy = healthy_since is not None and loop.time() - healthy_since > self.config.healthy_reset_s
            backoff = 0.0 if long_healthy else next_backoff(backoff, self.config)
            log.warning("model server down; restarting it in %.1f s (restart %d)", backoff, self.restarts)
            await asyncio.sleep(backoff)

    async def _recovered(self) -> None:
        restarted = self._seen_up  # it was up before: whatever it had loaded is gone
        self._seen_up = True
        if restarted:
            self.generation += 1
        self._set_up(True)
        log.info("model server up (generation %d)", self.generation)
        if restarted:
            self._restore = asyncio.create_task(self._restore_models())

    async def _restore_models(self) -> None:
        try:
            await self.on_recovered()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("restoring models after a model server restart failed")

    async def _start_child(self) -> None:
        assert self.command is not None
        self.process = Child.start(self.command, env=self.env, new_session=True)
        log.info("started model server (pid %d): %s", self.process.pid, " ".join(self.command))
        self._write_pid_file(self.process.pid)

    def _write_pid_file(self, pid: int) -> None:
        """Whole or not at all (a temporary file renamed over it): a reader never sees it half written."""
        if self.pid_file is None:
            return
        temporary = self.pid_file.with_name(f".{self.pid_file.name}.{os.getpid()}.tmp")
        temporary.write_text(f"{pid}\n")
        os.replace(temporary, self.pid_file)

    def _remove_pid_file(self, pid: int) -> None:
        """Once the server is reaped its PID may be reused by any process: the file goes with it
        (only if it still names that server)."""
        if self.pid_file is None:
            return
        with contextlib.suppress(OSError, ValueError):
            if int(self.pid_file.read_text().strip()) == pid:
                self.pid_file.unlink()

    async def _wait_ready(self) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.startup_timeout_s
        while loop.time() < deadline:
            if self.process is not None and self.process.returncode is not None:
                log.warning("model server exited with %s while starting", self.process.returncode)
                return False
            if await self._check(self.ready):
                return True
            await asyncio.sleep(min(0.2, self.config.check_interval_s))
        log.warning("model server not ready after %.0f s", self.config.startup_timeout_s)
        return False

    async def _monitor_child(self) -> None:
        failures = 0
        while True:
            await asyncio.sleep(self.config.check_interval_s)
            if self.process is not None and self.process.returncode is not None:
                log.warning("model server exited with %s", self.process.returncode)
                return
            failures = 0 if await self._check() else failures + 1
            if failures >= self.config.failures_before_restart:
                log.warning("model server failed %d liveness checks", failures)
                return

    async def _check(self, probe: Callable[[], Awaitable[bool]] | None = None) -> bool:
        try:
            return await (probe or self.healthy)()
        except Exception:
            return False

    def _kill_leftover(self) -> None:
        """Kill a server (and its workers) left running by an earlier adapter that was killed:
        the process group named in the pid file, if a member of it runs our command."""
        if self.pid_file is None or not self.pid_file.exists() or not self.command:
            return
        try:
            group = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return
        if group in (os.getpid(), os.getpgrp()):
            return
        wanted = [os.fsencode(c) for c in self.command]
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                stat = (proc / "stat").read_text()
                pgrp = int(stat[stat.rindex(")") + 2 :].split()[2])
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            if pgrp == group and argv[: len(wanted)] == wanted:
                log.warning("killing model server group %d left by an earlier adapter", group)
                _signal_group(group, signal.SIGKILL)
                return

    async def stop_child(self, kill: bool = False) -> None:
        proc, self.process = self.process, None
        if proc is None:
            return
        if proc.returncode is not None:
            _signal_group(proc.pid, signal.SIGKILL)  # its workers may outlive it
            self._remove_pid_file(proc.pid)
            return
        _signal_group(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
        try:
            async with asyncio.timeout(self.config.stop_grace_s):
                await proc.wait()
        except TimeoutError:
            _signal_group(proc.pid, signal.SIGKILL)
            await proc.wait()
        _signal_group(proc.pid, signal.SIGKILL)  # whatever of its group is left
        self._remove_pid_file(proc.pid)


def _signal_group(pid: int, sig: int) -> None:
    # The server may have children (worker processes): signal its whole group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
