"""The supervisor against a real child process: start, health, restart after a kill -9 or a
hang, generations, backoff, and a clean stop."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from meshd.adapter.supervisor import Supervisor, SupervisorConfig, next_backoff
from meshd.testing.procs import free_port

FAST = SupervisorConfig(check_interval_s=0.1, failures_before_restart=3, startup_timeout_s=20, backoff_initial_s=0.1)
# Answers "ok" to every connection: a stopped (SIGSTOP) process answers nothing.
SERVER = (
    "import socket\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', {port})); s.listen()\n"
    "while True:\n    c, _ = s.accept(); c.sendall(b'ok'); c.close()"
)


async def answers(port: int) -> bool:
    try:
        async with asyncio.timeout(0.5):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            data = await reader.read(2)
            writer.close()
            return data == b"ok"
    except (OSError, TimeoutError):
        return False


def test_backoff_doubles_up_to_the_cap() -> None:
    cfg = SupervisorConfig(backoff_initial_s=0.5, backoff_max_s=4)
    steps = [0.0]
    for _ in range(5):
        steps.append(next_backoff(steps[-1], cfg))
    assert steps == [0.0, 0.5, 1.0, 2.0, 4.0, 4.0]


async def wait_for(check: object, timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():  # type: ignore[operator]  # noqa: ASYNC110 - polls another process's state
            await asyncio.sleep(0.05)


async def test_a_killed_or_hung_server_is_restarted_and_models_restored(tmp_path: Path) -> None:
    port = free_port()
    recovered: list[int] = []

    async def healthy() -> bool:
        return await answers(port)

    pid_file = tmp_path / "server.pid"
    sup = Supervisor(
        healthy,
        lambda: _note(recovered, sup),
        [sys.executable, "-c", SERVER.format(port=port)],
        dict(os.environ),
        FAST,
        pid_file,
    )
    task = asyncio.create_task(sup.run())
    try:
        assert await sup.wait_up(20)
        first = int(pid_file.read_text())
        assert sup.generation == 0 and recovered == []
        os.kill(first, signal.SIGKILL)
        await wait_for(lambda: not sup.up)
        await wait_for(lambda: sup.up and sup.generation == 1)
        second = int(pid_file.read_text())
        assert second != first and recovered == [1]
        # A server that hangs (stops answering) is killed and replaced too.
        os.kill(second, signal.SIGSTOP)
        await wait_for(lambda: sup.generation == 2 and sup.up)
        assert int(pid_file.read_text()) not in (first, second)
        with pytest.raises(ProcessLookupError):
            os.kill(second, 0)  # the hung one is gone, not orphaned
        last = int(pid_file.read_text())
        assert [n for n in os.listdir(tmp_path) if n.startswith(".server.pid")] == []  # temporary file renamed
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    with pytest.raises(ProcessLookupError):
        os.kill(last, 0)  # stopping the supervisor stops the server
    assert not pid_file.exists()  # and its PID, free for reuse, is no longer named


async def _note(recovered: list[int], sup: Supervisor) -> None:
    recovered.append(sup.generation)


async def test_an_external_server_is_only_watched() -> None:
    state = {"up": False}
    recovered: list[int] = []

    async def healthy() -> bool:
        return state["up"]

    sup = Supervisor(healthy, lambda: _note(recovered, sup), None, None, FAST)
    task = asyncio.create_task(sup.run())
    try:
        assert not await sup.wait_up(0.3)
        state["up"] = True
        assert await sup.wait_up(5) and sup.generation == 0
        state["up"] = False
        await wait_for(lambda: not sup.up)
        state["up"] = True
        await wait_for(lambda: sup.up and recovered == [1])
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_live_server_that_is_not_ready_is_left_alone(tmp_path: Path) -> None:
    """Readiness turns false while a model loads: only liveness decides a restart."""
    port = free_port()
    ready = {"value": True}

    async def live() -> bool:
        return await answers(port)

    async def is_ready() -> bool:
        return ready["value"]

    pid_file = tmp_path / "server.pid"
    restored: list[int] = []
    sup = Supervisor(
        live,
        lambda: _note(restored, sup),
        [sys.executable, "-c", SERVER.format(port=port)],
        dict(os.environ),
        FAST,
        pid_file,
        ready=is_ready,
    )
    task = asyncio.create_task(sup.run())
    try:
        assert await sup.wait_up(20)
        first = int(pid_file.read_text())
        ready["value"] = False  # a model loading
        await asyncio.sleep(FAST.check_interval_s * (FAST.failures_before_restart + 3))
        assert sup.up and sup.restarts == 0 and int(pid_file.read_text()) == first
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_server_left_by_a_killed_adapter_is_killed_at_start(tmp_path: Path) -> None:
    port = free_port()
    command = [sys.executable, "-c", SERVER.format(port=port)]
    leftover = await asyncio.create_subprocess_exec(*command, start_new_session=True)
    pid_file = tmp_path / "server.pid"
    pid_file.write_text(f"{leftover.pid}\n")

    async def live() -> bool:
        return await answers(port)

    sup = Supervisor(live, lambda: _note([], sup), command, dict(os.environ), FAST, pid_file)
    task = asyncio.create_task(sup.run())
    try:
        assert await sup.wait_up(20)
        assert await leftover.wait() == -signal.SIGKILL
        assert int(pid_file.read_text()) != leftover.pid
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
