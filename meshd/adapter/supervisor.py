"""Keeps the model server running: start it (optionally), watch its health, restart it.

With a command, the server is a child process in its own process group: started, waited
for (ServerReady), health-checked every second, and killed and restarted with backoff when
it exits or stops answering. Without one, the server is someone else's and only its health
is watched. Either way `up` says whether it answers now, and every return to health after
an outage counts as a new `generation`: the adapter then restores the models it had
loaded, since a restarted server holds none.
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

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    check_interval_s: float = 1.0
    failures_before_restart: int = 3  # consecutive failed health checks
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
    ) -> None:
        self.healthy = healthy
        self.on_recovered = on_recovered
        self.command = list(command) if command else None
        self.env = env
        self.config = config or SupervisorConfig()
        self.pid_file = pid_file
        self.up = False
        self.generation = 0  # bumped each time the server comes back after being down
        self.restarts = 0
        self.process: asyncio.subprocess.Process | None = None
        self._up_changed = asyncio.Event()
        self._seen_up = False

    async def wait_up(self, timeout_s: float) -> bool:
        """Whether the server answers, waiting up to `timeout_s` for it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.up:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            event = self._up_changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await event.wait()
        return True

    def _set_up(self, up: bool) -> None:
        if up != self.up:
            self.up = up
            event, self._up_changed = self._up_changed, asyncio.Event()
            event.set()

    async def run(self) -> None:
        """Supervise until cancelled (then stop the child, if any)."""
        try:
            if self.command:
                await self._run_child()
            else:
                await self._watch()
        finally:
            await self.stop_child()

    async def _watch(self) -> None:
        failures = 0
        was_up = False
        while True:
            ok = await self._check()
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
            started = loop.time()
            if await self._wait_ready():
                await self._recovered()
                await self._monitor_child()
            self._set_up(False)
            await self.stop_child(kill=True)
            self.restarts += 1
            backoff = 0.0 if loop.time() - started > self.config.healthy_reset_s else next_backoff(backoff, self.config)
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
            try:
                await self.on_recovered()
            except Exception:
                log.exception("restoring models after a model server restart failed")

    async def _start_child(self) -> None:
        assert self.command is not None
        self.process = await asyncio.create_subprocess_exec(
            *self.command, env=self.env, start_new_session=True, stdin=asyncio.subprocess.DEVNULL
        )
        log.info("started model server (pid %d): %s", self.process.pid, " ".join(self.command))
        if self.pid_file is not None:
            self.pid_file.write_text(f"{self.process.pid}\n")

    async def _wait_ready(self) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.startup_timeout_s
        while loop.time() < deadline:
            if self.process is not None and self.process.returncode is not None:
                log.warning("model server exited with %s while starting", self.process.returncode)
                return False
            if await self._check():
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
            if failures:
                self._set_up(False)  # fail fast while it does not answer
            if failures >= self.config.failures_before_restart:
                log.warning("model server failed %d health checks", failures)
                return
            if not failures and not self.up:
                self._set_up(True)

    async def _check(self) -> bool:
        try:
            return await self.healthy()
        except Exception:
            return False

    async def stop_child(self, kill: bool = False) -> None:
        proc, self.process = self.process, None
        if proc is None or proc.returncode is not None:
            return
        _signal_group(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
        try:
            async with asyncio.timeout(self.config.stop_grace_s):
                await proc.wait()
        except TimeoutError:
            _signal_group(proc.pid, signal.SIGKILL)
            await proc.wait()


def _signal_group(pid: int, sig: int) -> None:
    # The server may have children (worker processes): signal its whole group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
