"""Upstream's run-time settings under `config/` followed from the store (meshd.loops.dynamic_config)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import pytest

from meshd.kv.memory import MemoryStore
from meshd.kv.store import Delete
from meshd.loops.dynamic_config import MESHD_LOGGER, DynamicConfig
from meshd.loops.scaler import Scaler, ScalerConfig
from meshd.observability.metrics import NO_METRICS
from meshd.serving.invocations import Invocations
from meshd.testing.procs import wait_until_async

PREFIX = "/tas-runtime/svc"
CONFIG = f"{PREFIX}/config/"


class Fixture:
    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.scaler = Scaler(ScalerConfig(threshold_rpm=2000), *cast(Any, (None, None, None, None)))
        self.router = SimpleNamespace(note_served=False, forwarder=SimpleNamespace(note_served=False))
        self.invocations = Invocations(NO_METRICS, False, "inst-a")
        self.loop = DynamicConfig(store, PREFIX, False, 2000, self.scaler, cast(Any, self.router), self.invocations)
        self.seen = 0

    async def put(self, key: str, value: str) -> None:
        await self.store.put(CONFIG + key, value.encode())
        await self._applied()

    async def delete(self, key: str) -> None:
        await self.store.txn([], [Delete(CONFIG + key)])
        await self._applied()

    async def _applied(self) -> None:
        revision = self.store.revision
        await wait_until_async(lambda: self.loop.table.revision >= revision, 5, "the watch to apply it")


@pytest.fixture
async def fx() -> AsyncIterator[Fixture]:
    store = MemoryStore()
    f = Fixture(store)
    task = asyncio.create_task(f.loop.run())
    await wait_until_async(f.loop.table.synced.is_set, 5, "the first listing")
    try:
        yield f
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        logging.getLogger(MESHD_LOGGER).setLevel(logging.NOTSET)


async def test_logger_level_sets_meshds_loggers_and_deleting_it_restores_the_start_level(fx: Fixture) -> None:
    meshd = logging.getLogger(MESHD_LOGGER)
    assert meshd.level == logging.NOTSET
    await fx.put("logger_level", "debug")
    assert meshd.level == logging.DEBUG
    assert logging.getLogger("meshd.serving.router").isEnabledFor(logging.DEBUG)
    await fx.put("logger_level", "WARN")
    assert meshd.level == logging.WARNING
    await fx.delete("logger_level")
    assert meshd.level == logging.NOTSET  # the root's level, as meshd was started, applies again


async def test_log_each_invocation_turns_the_invoke_log_and_the_served_note_on_and_off(fx: Fixture) -> None:
    assert not fx.invocations.active
    await fx.put("log_each_invocation", "true")
    assert fx.invocations.log_each and fx.invocations.active
    assert fx.router.note_served and fx.router.forwarder.note_served
    await fx.delete("log_each_invocation")
    assert not fx.invocations.log_each and not fx.invocations.active
    assert not fx.router.note_served and not fx.router.forwarder.note_served


async def test_scaleup_rpm_threshold_sets_the_scalers_and_deleting_it_restores_the_configured(fx: Fixture) -> None:
    await fx.put("scaleup_rpm_threshold", "40")
    assert fx.scaler.config.threshold_rpm == 40
    await fx.delete("scaleup_rpm_threshold")
    assert fx.scaler.config.threshold_rpm == 2000


async def test_an_invalid_value_changes_nothing_and_is_warned_once(
    fx: Fixture, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="meshd.loops.dynamic_config")
    await fx.put("scaleup_rpm_threshold", "5")
    await fx.put("scaleup_rpm_threshold", "5")  # stored again: not warned again
    await fx.put("log_each_invocation", "yes")
    assert fx.scaler.config.threshold_rpm == 2000 and not fx.invocations.log_each
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "config/scaleup_rpm_threshold" in warnings[0] and "'5'" in warnings[0]
    assert "config/log_each_invocation" in warnings[1] and "'yes'" in warnings[1]
    # A valid value then an invalid one: upstream's rule, the configured value (not the last valid one).
    await fx.put("scaleup_rpm_threshold", "300")
    assert fx.scaler.config.threshold_rpm == 300
    await fx.put("scaleup_rpm_threshold", "lots")
    assert fx.scaler.config.threshold_rpm == 2000


async def test_values_stored_before_start_apply_at_start() -> None:
    store = MemoryStore()
    await store.put(CONFIG + "scaleup_rpm_threshold", b"75")
    f = Fixture(store)
    task = asyncio.create_task(f.loop.run())
    try:
        await wait_until_async(lambda: f.scaler.config.threshold_rpm == 75, 5, "the stored threshold")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
