"""One engine process: started on a free port in its own process group, ready once it answers
`GET /v1/models`, stopped with its whole group, sized by the memory its processes hold.

Its output goes to a log file of its own; a start that fails says why with the log's tail.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import aiohttp

from meshd.adapter.llm.engines import READY_PATH
from meshd.core.hostport import join as host_port
from meshd.process.child import Child

READY_POLL_S = 0.05
STOP_GRACE_S = 5.0
LOG_TAIL_BYTES = 2000
PAGE = os.sysconf("SC_PAGE_SIZE")


class EngineStartError(Exception):
    """The engine exited or did not answer in time; the message ends with its log's tail."""


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EngineProcess:
    def __init__(self, argv: Sequence[str], host: str, port: int, log_path: Path, env: Mapping[str, str]) -> None:
        self.argv = list(argv)
        self.host = host
        self.port = port
        self.log_path = log_path
        self.env = dict(env)
        self.child: Child | None = None
        self.stopping = False

    @property
    def base_url(self) -> str:
        return f"http://{host_port(self.host, self.port)}"

    async def start(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        """Start it and wait until it answers; EngineStartError (the process stopped) if not."""
        self.child = self._spawn()
        deadline = time.monotonic() + timeout_s
        url = self.base_url + READY_PATH
        while True:
            if self.child.returncode is not None:
                raise EngineStartError(f"the engine exited ({describe_exit(self.child.returncode)}): {self.log_tail()}")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                await self.stop()
                raise EngineStartError(
                    f"the engine did not answer {READY_PATH} within {timeout_s:g} s: {self.log_tail()}"
                )
            await asyncio.sleep(READY_POLL_S)

    def _spawn(self) -> Child:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:  # a local file, opened once per start
            return Child.start(self.argv, stdout=out, stderr=out, env=self.env, new_session=True)

    async def wait(self) -> int:
        assert self.child is not None
        return await self.child.wait()

    @property
    def running(self) -> bool:
        return self.child is not None and self.child.returncode is None

    async def stop(self) -> None:
        """SIGTERM to its group, SIGKILL after a grace period; also reaps what the leader left."""
        self.stopping = True
        child = self.child
        if child is None:
            return
        child.signal_group(signal.SIGTERM)
        try:
            await asyncio.wait_for(child.wait(), STOP_GRACE_S)
        except TimeoutError:
            pass
        child.signal_group(signal.SIGKILL)  # workers that outlived their leader too
        await child.wait()

    def rss_bytes(self) -> int:
        """Resident memory of every process in its group (the engine and any workers)."""
        if self.child is None:
            return 0
        return group_rss_bytes(self.child.pid)

    def pids(self) -> list[int]:
        """Every process in its group (where its GPU memory is held: vLLM's workers)."""
        if self.child is None:
            return []
        return [pid for pid, _rss in _group(self.child.pid)]

    def log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
                return f.read().decode(errors="replace").strip() or "(no output)"
        except OSError:
            return "(no log)"


def group_rss_bytes(pgid: int) -> int:
    return sum(rss for _pid, rss in _group(pgid))


def _group(pgid: int) -> list[tuple[int, int]]:
    """(pid, resident bytes) of every process in the process group."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) "
        if len(fields) > 21 and int(fields[2]) == pgid:  # fields[2]: pgrp; fields[21]: rss pages
            found.append((int(entry), int(fields[21]) * PAGE))
    return found


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
