"""Following upstream's run-time settings under `<key prefix>/config/` in etcd.

A mirror of that prefix (a `kv.Table` of raw text: it re-watches and re-lists as every table
does) is read whenever a key under it changes; `decisions.dynamic_config.resolve` says what the
stored values mean, and this module applies what changed: the level of meshd's loggers (the
`meshd` logger: a deleted key leaves it unset, so the level meshd was started with applies
again), the invoke log (`Invocations.set_log_each`, and the router's note of who served a
call, which that log reads) and the scaler's threshold. A value that changes nothing is logged
once as a warning naming the key and the value (again only after another value in between).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Collection

from meshd.decisions.dynamic_config import (
    CONFIG_DIR,
    FOLLOWED,
    LOG_EACH_INVOCATION,
    LOG_LEVELS,
    LOGGER_LEVEL,
    SCALEUP_RPM_THRESHOLD,
    Rejected,
    Settings,
    resolve,
)
from meshd.kv.store import KVStore, StoreError
from meshd.kv.table import Table
from meshd.loops.scaler import Scaler
from meshd.serving.invocations import Invocations
from meshd.serving.router import Router

log = logging.getLogger(__name__)

MESHD_LOGGER = "meshd"  # every meshd logger sits below it
RETRY_S = 1.0


def _text(value: bytes) -> str:
    return value.decode("utf-8", errors="replace")  # an undecodable value is reported as invalid


def _bytes(text: str) -> bytes:
    return text.encode()


class DynamicConfig:
    def __init__(
        self,
        store: KVStore,
        key_prefix: str,
        log_each_invoke: bool,
        scaleup_rpm_threshold: int,
        scaler: Scaler,
        router: Router,
        invocations: Invocations | None,
    ) -> None:
        """`key_prefix`: `Config.key_prefix`; `log_each_invoke` and `scaleup_rpm_threshold`:
        the configured values (MM_LOG_EACH_INVOKE, MM_SCALEUP_RPM_THRESHOLD), which a key that
        is absent or invalid leaves in force."""
        self.table: Table[str] = Table(store, f"{key_prefix}/{CONFIG_DIR}", _text, _bytes)
        self.configured = Settings(None, log_each_invoke, scaleup_rpm_threshold)
        self.current = self.configured
        self.scaler = scaler
        self.router = router
        self.invocations = invocations
        self._note_served = router.note_served  # as built: metrics or the configured invoke log
        self._warned: set[Rejected] = set()
        self.table.listeners.append(self._changed)

    async def run(self) -> None:
        """Follow the prefix until cancelled."""
        while True:  # the store answered a moment ago (start-up listed its tables); if not now, soon
            try:
                await self.table.start()  # the listing calls `_changed` for each key already stored
                break
            except StoreError as e:
                log.warning("cannot list %s yet (%s); retrying", self.table.prefix, e)
                await asyncio.sleep(RETRY_S)
        try:
            await asyncio.Event().wait()
        finally:
            await self.table.stop()

    def _changed(self, key: str, old: str | None, new: str | None) -> None:
        log.debug("%s%s: %s", CONFIG_DIR, key, "deleted" if new is None else f"now {new!r}")
        self.refresh()

    def refresh(self) -> None:
        """Apply what the mirror's values mean now."""
        stored = dict(self.table.items())
        settings, rejected = resolve(stored, self.configured)
        for r in rejected:
            if r not in self._warned:
                log.warning("%s", r.message())
        self._warned = set(rejected)
        self.apply(settings, {k for k in stored if k in FOLLOWED} - {r.key for r in rejected})

    def apply(self, settings: Settings, stored: Collection[str] = ()) -> None:
        """Make `settings` current; `stored`: the keys whose stored values they hold (for the log)."""
        was, self.current = self.current, settings

        def source(key: str) -> str:
            return f"{CONFIG_DIR}{key}" if key in stored else "configured"

        if settings.log_level != was.log_level:
            logging.getLogger(MESHD_LOGGER).setLevel(settings.log_level or logging.NOTSET)
            level = settings.log_level
            name = "as started" if level is None else next(n for n, v in LOG_LEVELS.items() if v == level)
            log.info("level of meshd's loggers: %s (%s)", name, source(LOGGER_LEVEL))
        if settings.log_each_invoke != was.log_each_invoke:
            if self.invocations is not None:
                self.invocations.set_log_each(settings.log_each_invoke)
            on = self._note_served or settings.log_each_invoke  # the invoke log reads who served
            self.router.note_served = self.router.forwarder.note_served = on
            log.info("invoke log: %s (%s)", "on" if settings.log_each_invoke else "off", source(LOG_EACH_INVOCATION))
        if settings.scaleup_rpm_threshold != was.scaleup_rpm_threshold:
            rpm = settings.scaleup_rpm_threshold
            self.scaler.config = dataclasses.replace(self.scaler.config, threshold_rpm=rpm)
            log.info("scale-up threshold: %d rpm (%s)", rpm, source(SCALEUP_RPM_THRESHOLD))
