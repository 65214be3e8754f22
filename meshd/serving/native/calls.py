"""The requests HAProxy carried natively, one log line each (a unix datagram socket meshd
owns), turned into the same per-call metrics and invoke log the Python path records."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

from meshd.serving.native.haproxy_config import CarriedCall, parse_log_line

log = logging.getLogger("meshd.native")

RECEIVE_BUFFER_BYTES = 8 << 20  # the lines of a drain interval (and a busy event loop) wait here
MAX_LINE_BYTES = 4096
# Read in batches on a timer, not on every datagram: a wake-up of the event loop per carried
# call cost meshd more than recording the call itself (bench/proxy_overhead.py).
DRAIN_INTERVAL_S = 0.05


class CarriedCalls:
    def __init__(self, path: Path, record: Callable[[CarriedCall], None]) -> None:
        self.path = path
        self.record = record
        self.lines = 0  # lines read (tests, benchmarks)
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        sock.bind(str(self.path))
        sock.setblocking(False)
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._drain_every(), name="native call log")

    async def _drain_every(self) -> None:
        while self._sock is not None:
            self._read()
            await asyncio.sleep(DRAIN_INTERVAL_S)

    def _read(self) -> None:
        sock = self._sock
        if sock is None:
            return
        while True:
            try:
                data = sock.recv(MAX_LINE_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("native data plane: reading HAProxy's log: %s", e)
                return
            self.lines += 1
            call = parse_log_line(data.decode("utf-8", "replace").strip())
            if call is not None:
                try:
                    self.record(call)
                except Exception:
                    log.exception("native data plane: recording a carried call failed")

    def close(self) -> None:
        sock = self._sock
        if sock is None:
            return
        self._read()  # the last lines
        self._sock = None
        if self._task is not None:
            self._task.cancel()
        sock.close()
