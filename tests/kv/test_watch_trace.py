"""The watch trace: one line per applied watch batch of a mirror, read back by benchmarks."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from meshd.core.records import ModelRecord
from meshd.kv.memory import MemoryStore
from meshd.kv.table import Table
from meshd.kv.watch_trace import WatchTrace, read_trace


async def test_each_applied_watch_batch_is_traced_with_its_revision(tmp_path: Path) -> None:
    store = MemoryStore()
    before = await store.put("r/listed", ModelRecord(type="t").encode())
    table: Table[ModelRecord] = Table(store, "r/", ModelRecord.decode, ModelRecord.encode)
    trace = WatchTrace(tmp_path / "trace.txt")
    table.on_applied = trace
    await table.start()
    try:
        revs = [await store.put(f"r/m{i}", ModelRecord(type="t").encode()) for i in range(3)]
        await store.put("other/x", b"{}")  # outside the prefix: not this mirror's
        await table.wait_for(revs[-1])
    finally:
        await table.stop()
        trace.close()
        await store.close()
    lines = read_trace(tmp_path / "trace.txt")
    assert [rev for rev, _ in lines] == revs  # the listing at start is not a watch batch
    assert before not in [rev for rev, _ in lines]
    times = [ns for _, ns in lines]
    assert times == sorted(times) and times[0] > 0


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "trace.txt"
    path.write_text("5 1000\n6 2000\n7 ")
    assert read_trace(path) == [(5, 1000), (6, 2000)]


async def test_a_failing_write_turns_tracing_off_and_the_mirror_keeps_watching(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # /dev/full fails every write with ENOSPC, as a full disk would.
    store = MemoryStore()
    table: Table[ModelRecord] = Table(store, "r/", ModelRecord.decode, ModelRecord.encode)
    trace = WatchTrace(Path("/dev/full"))
    table.on_applied = trace
    await table.start()
    try:
        with caplog.at_level(logging.INFO):
            for i in range(3):
                rev = await store.put(f"r/m{i}", ModelRecord(type="t").encode())
                await table.wait_for(rev)
    finally:
        await table.stop()
        trace.close()  # the unwritten rest of the line is dropped, not raised
        await store.close()
    assert set(table.entries) == {"m0", "m1", "m2"}
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.name for r in warnings] == ["meshd.kv.watch_trace"], [r.getMessage() for r in warnings]
    assert "tracing is off" in warnings[0].getMessage()
