"""Watching the local runtime after start-up: notice it gone, drop its copies, take it back.

`runtimeStatus` cannot be polled while serving (a runtime purges its models when it answers
READY, SPEC §1), so the probe asks `modelSize` of a held copy (of no model when none is
held): any answer means the runtime is there, NOT_FOUND for a held copy means it lost it
(it restarted). DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED is a runtime too busy to answer in
time: it is there, and keeps its copies. Only connection failures (UNAVAILABLE) count as
missed; `DOWN_AFTER_PROBES` of them in a row and the runtime is down. Then every copy leaves
the records and the cache (nothing may report LOADED where nothing is), loads in progress
fail instead of landing later, loads are refused and the instance record says it takes no
models. Once `runtimeStatus` answers READY again (the runtime has purged) the cache is
emptied and the instance takes loads again. `judge` is the decision, pure.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from meshd.decisions.cache import State
from meshd.runtime.client import RuntimeNotReady
from meshd.serving.local import LocalModels

log = logging.getLogger(__name__)

# Two refused connections could be a restart in progress; three in a row is a runtime that is not there.
DOWN_AFTER_PROBES = 3
# After a call to the runtime failed to connect, the probes come this far apart, not at the
# interval: a dead runtime's copies leave the records in about a second, so a capped model is
# loaded elsewhere before its requests run out of attempts. The misses then span a second: a
# connection reset that heals sooner (the channel reconnects within 0.2-0.5 s) is not taken
# for a dead runtime, whose copies would all be dropped and reloaded.
SUSPECT_PROBE_GAP_S = 0.5
RELEASE_WAIT_S = 3.0  # how long a suspicion waits for the dropped copies to leave the records
PROBE_TIMEOUT_S = 5.0
# A slow answer is a loaded runtime, not a dead one: dropping its copies would make it purge
# and reload everything (the recovery calls runtimeStatus).
_BUSY = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED})


class Probe(enum.Enum):
    ANSWERED = "answered"
    LOST_COPY = "lost a copy"  # NOT_FOUND for a copy this instance holds
    BUSY = "busy"  # connected, but no answer in time
    NO_ANSWER = "no answer"  # no connection


class Action(enum.Enum):
    NONE = "none"
    CHECK_COPIES = "check copies"  # find and drop the copies the runtime lost
    DROP_ALL = "drop all"  # the runtime is down: every copy goes
    RECOVERED = "recovered"  # READY again: take loads again


@dataclass(frozen=True, slots=True)
class RuntimeHealth:
    up: bool = True
    misses: int = 0  # probes in a row without a connection


def judge(health: RuntimeHealth, probe: Probe, down_after: int = DOWN_AFTER_PROBES) -> tuple[RuntimeHealth, Action]:
    """The next state and what to do. While down, a probe is `runtimeStatus`: ANSWERED = READY."""
    if not health.up:
        return (RuntimeHealth(), Action.RECOVERED) if probe is Probe.ANSWERED else (health, Action.NONE)
    if probe is Probe.BUSY:  # there, so the count starts again; its copies stay
        return RuntimeHealth(), Action.NONE
    if probe is Probe.NO_ANSWER:
        misses = health.misses + 1
        if misses >= down_after:
            return RuntimeHealth(up=False, misses=misses), Action.DROP_ALL
        return RuntimeHealth(misses=misses), Action.NONE
    return RuntimeHealth(), Action.CHECK_COPIES if probe is Probe.LOST_COPY else Action.NONE


class RuntimeWatch:
    """Probes the runtime every `interval_s` and applies `judge`'s actions to `local`."""

    def __init__(self, local: LocalModels, interval_s: float, on_change: Callable[[], None] = lambda: None) -> None:
        self.local = local
        self.interval_s = interval_s
        self.on_change = on_change  # up/down changed: publish the instance record soon
        self.health = RuntimeHealth()
        self._suspicion: asyncio.Task[None] | None = None
        # One check at a time: the periodic loop and a suspicion both probe, and a probe's
        # answer must be judged against the state it was asked in (a late "answered" from a
        # copy probe must not read as a down runtime's recovery, which needs runtimeStatus).
        self._checking = asyncio.Lock()

    @property
    def up(self) -> bool:
        return self.health.up

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check()
            except Exception:
                log.exception("runtime check failed")

    async def suspect(self) -> None:
        """A call to the runtime failed to connect: probe now and again shortly (one round for
        every caller at once). If the runtime is down, its copies are dropped and this returns
        once they have left the records (at most `RELEASE_WAIT_S`), so the caller's retry can
        load a capped model elsewhere instead of being refused at its max copies."""
        if self._suspicion is None or self._suspicion.done():
            self._suspicion = asyncio.get_running_loop().create_task(self._confirm())
        await asyncio.shield(self._suspicion)

    async def _confirm(self) -> None:
        for n in range(DOWN_AFTER_PROBES):
            if not self.health.up:
                break
            if n:
                await asyncio.sleep(SUSPECT_PROBE_GAP_S)
            try:
                await self.check()
            except Exception:
                log.exception("runtime check failed")
                return
            if self.health.up and self.health.misses == 0:
                return  # it answered: the failed call was something else
        if not self.health.up:
            await self.local.copies_released(RELEASE_WAIT_S)

    async def check(self) -> None:
        async with self._checking:
            await self._check()

    async def _check(self) -> None:
        probe = await (self._probe() if self.health.up else self._probe_ready())
        self.health, action = judge(self.health, probe)
        if action is Action.CHECK_COPIES:
            await self._drop_lost()
        elif action is Action.DROP_ALL:
            log.warning(
                "runtime at %s unreachable (%d probes): dropping its copies",
                self.local.runtime.endpoint,
                DOWN_AFTER_PROBES,
            )
            self.local.runtime_gone()  # record removals run in the background: etcd may be down too
            self.on_change()
        elif action is Action.RECOVERED:
            log.info("runtime at %s is READY again: taking loads", self.local.runtime.endpoint)
            self.local.runtime_back()
            self.on_change()

    async def _probe(self) -> Probe:
        held = [e.model_id for e in self.local.cache.entries() if e.state is State.LOADED]
        model_id = held[0] if held else ""
        try:
            await self.local.runtime.probe(model_id, PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                return Probe.NO_ANSWER
            if e.code() in _BUSY:
                log.debug("runtime at %s busy: %s", self.local.runtime.endpoint, e.code().name)
                return Probe.BUSY
            if e.code() == grpc.StatusCode.NOT_FOUND and model_id:
                return Probe.LOST_COPY
        return Probe.ANSWERED

    async def _probe_ready(self) -> Probe:
        try:
            await self.local.runtime.wait_ready(timeout_s=0, interval_s=PROBE_TIMEOUT_S)
        except RuntimeNotReady:
            return Probe.NO_ANSWER
        return Probe.ANSWERED

    async def _drop_lost(self) -> None:
        for entry in self.local.cache.entries():
            if entry.state is State.LOADED and await self.local.runtime.has_model(entry.model_id) is False:
                self.local.lost(entry.model_id, entry)
