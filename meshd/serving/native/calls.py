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

RECEIVE_BUFFER_BYTES = 4 << 20  # a burst of lines waits here while the event loop is busy
MAX_LINE_BYTES = 4096


class CarriedCalls:
    def __init__(self, path: Path, record: Callable[[CarriedCall], None]) -> None:
        self.path = path
        self.record = record
        self.lines = 0  # lines read (tests, benchmarks)
        self._sock: socket.socket | None = None

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        sock.bind(str(self.path))
        sock.setblocking(False)
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._read)

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
        self._sock = None
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(sock.fileno())
        sock.close()
