"""The runtime watch: its decision (pure) and `RuntimeWatch.check` applied to the local
copies with a fake runtime: busy is not down, down drops every copy, nothing loaded around an
outage lands, and recovery starts from an empty cache."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from meshd.core.errors import LoadFailed, Unavailable
from meshd.decisions.cache import State
from meshd.loops.runtime_watch import DOWN_AFTER_PROBES, Action, Probe, RuntimeHealth, RuntimeWatch, judge
from meshd.serving.local import RECORD_REMOVALS_AT_ONCE
from tests.serving.test_local import Rig, make_rig, settle


def test_a_runtime_is_down_only_after_several_missed_probes_in_a_row() -> None:
    health = RuntimeHealth()
    for _ in range(DOWN_AFTER_PROBES - 1):
        health, action = judge(health, Probe.NO_ANSWER)
        assert health.up and action is Action.NONE
    health, action = judge(health, Probe.NO_ANSWER)
    assert not health.up and action is Action.DROP_ALL
    # An answer in between starts the count again.
    health, _ = judge(RuntimeHealth(misses=DOWN_AFTER_PROBES - 1), Probe.ANSWERED)
    assert health == RuntimeHealth()


def test_a_busy_probe_is_not_a_miss() -> None:
    health = RuntimeHealth(misses=DOWN_AFTER_PROBES - 1)
    assert judge(health, Probe.BUSY) == (RuntimeHealth(), Action.NONE)


def test_a_lost_copy_is_checked_and_a_down_runtime_recovers_on_ready() -> None:
    assert judge(RuntimeHealth(), Probe.LOST_COPY) == (RuntimeHealth(), Action.CHECK_COPIES)
    down = RuntimeHealth(up=False, misses=DOWN_AFTER_PROBES)
    assert judge(down, Probe.NO_ANSWER) == (down, Action.NONE)
    assert judge(down, Probe.ANSWERED) == (RuntimeHealth(), Action.RECOVERED)


# ---- RuntimeWatch.check on LocalModels with a fake runtime (in-process store) ----------------


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = await make_rig(capacity_models=12)
    try:
        yield r
    finally:
        await r.close()


async def loaded(rig: Rig, *model_ids: str) -> None:
    for model_id in model_ids:
        await rig.local.ensure(model_id, await rig.register(model_id))


def holds(rig: Rig, model_id: str) -> bool:
    """The cache holds it LOADED or the record names this instance."""
    entry = rig.local.cache.get(model_id)
    record = rig.registry.get(model_id)
    return (entry is not None and entry.state is State.LOADED) or (record is not None and "me" in record.instance_ids)


async def go_down(rig: Rig, watch: RuntimeWatch) -> None:
    rig.runtime.down = True
    for _ in range(DOWN_AFTER_PROBES):
        await watch.check()
    assert not watch.up and not rig.local.runtime_up


async def quiet(rig: Rig) -> None:
    """Let every background task (record removals, unloads, loads) finish."""
    while rig.local._tasks:
        await asyncio.gather(*rig.local._tasks, return_exceptions=True)


async def test_a_busy_runtime_keeps_its_copies(rig: Rig) -> None:
    await loaded(rig, "a", "b")
    watch = RuntimeWatch(rig.local, 1.0)
    rig.runtime.busy = True  # every probe times out: a loaded runtime, not a dead one
    for _ in range(DOWN_AFTER_PROBES * 2):
        await watch.check()
    await quiet(rig)
    assert watch.up and rig.local.runtime_up
    assert holds(rig, "a") and holds(rig, "b")
    assert ("purge", "") not in rig.runtime.log  # runtimeStatus never asked: nothing purged


async def test_a_dead_runtime_drops_its_copies_and_refuses_loads(rig: Rig) -> None:
    await loaded(rig, "a", "b")
    watch = RuntimeWatch(rig.local, 1.0)
    changes: list[bool] = []
    watch.on_change = lambda: changes.append(watch.up)
    await go_down(rig, watch)
    await quiet(rig)
    assert not holds(rig, "a") and not holds(rig, "b") and rig.local.cache.entries() == []
    assert changes == [False]
    with pytest.raises(Unavailable, match="runtime is not answering"):
        await rig.local.ensure("c", await rig.register("c"))


async def test_record_removals_run_in_parallel_and_do_not_stall_the_watch(rig: Rig) -> None:
    """etcd down too: a removal that never ends must not hold the watch loop, and removals
    go a bounded few at a time."""
    ids = [f"m{n}" for n in range(RECORD_REMOVALS_AT_ONCE + 3)]
    await loaded(rig, *ids)
    started: list[str] = []
    never = asyncio.Event()

    async def stuck(model_id: str, instance_id: str) -> None:
        started.append(model_id)
        await never.wait()

    rig.registry.remove_copy = stuck  # type: ignore[method-assign]
    watch = RuntimeWatch(rig.local, 1.0)
    await asyncio.wait_for(go_down(rig, watch), 30)  # a guard against a hang, not a timing check
    await settle()
    assert len(started) == RECORD_REMOVALS_AT_ONCE
    assert rig.local.cache.entries() == []


async def test_a_load_in_flight_when_the_runtime_goes_down_never_lands(rig: Rig) -> None:
    rec = await rig.register("slow")
    gate = rig.runtime.hold("slow")
    fut = rig.local.start_load("slow", rec, rig.now[0])
    await settle()
    assert "me" in rig.registry.get("slow").instance_ids  # type: ignore[union-attr]
    watch = RuntimeWatch(rig.local, 1.0)
    await go_down(rig, watch)
    rig.runtime.down = False  # it answers again (not yet READY-checked) and the load completes
    gate.set()
    with pytest.raises(Unavailable, match="stopped answering"):
        await fut
    await quiet(rig)
    assert not holds(rig, "slow") and rig.local.view("slow") is None
    assert "slow" not in rig.runtime.loaded  # what landed was unloaded: nobody counts it


async def test_recovery_starts_from_an_empty_cache(rig: Rig) -> None:
    await loaded(rig, "a")
    rig.runtime.fail.add("bad")
    with pytest.raises(LoadFailed):
        await rig.local.ensure("bad", await rig.register("bad"))
    rec = await rig.register("late")
    gate = rig.runtime.hold("late")
    late = rig.local.start_load("late", rec, rig.now[0])
    await settle()
    watch = RuntimeWatch(rig.local, 1.0)
    await go_down(rig, watch)
    rig.runtime.down = False
    await watch.check()  # runtimeStatus READY: the runtime purged
    assert watch.up and rig.local.runtime_up
    assert rig.local.cache.entries() == []  # no copy, no stale failure, no load from before
    gate.set()  # the load sent before the outage lands after the purge
    with pytest.raises(Unavailable):
        await late
    await quiet(rig)
    assert "late" not in rig.runtime.loaded and not holds(rig, "late")
    entry = await rig.local.ensure("a", rig.registry.get("a"))  # type: ignore[arg-type]
    assert entry.state is State.LOADED and "a" in rig.runtime.loaded
    assert [op for op in rig.runtime.log if op == ("load", "a")] == [("load", "a")] * 2


async def test_a_suspicion_confirms_a_dead_runtime_at_once_and_waits_for_its_copies_to_leave(rig: Rig) -> None:
    """A call refused by the runtime (router.runtime_refused): probes now, a few in quick
    succession, not at the interval; every caller shares the one round, and it returns once
    the copies have left the records (a capped model may then load elsewhere)."""
    await loaded(rig, "a", "b")
    watch = RuntimeWatch(rig.local, 3600.0)  # the interval never comes in this test
    rig.runtime.down = True
    await asyncio.wait_for(asyncio.gather(watch.suspect(), watch.suspect()), 30)  # a guard, not a timing check
    assert not watch.up and not rig.local.runtime_up
    for m in ("a", "b"):  # gone from the records in etcd (the store), not only from the mirror
        assert "me" not in (await rig.registry.fetch(m)).instance_ids
    probes = [e for e in rig.runtime.log if e[0] == "probe"]
    assert len(probes) == DOWN_AFTER_PROBES, probes  # one round for both callers


async def test_a_suspicion_of_a_runtime_that_answers_changes_nothing(rig: Rig) -> None:
    await loaded(rig, "a")
    watch = RuntimeWatch(rig.local, 3600.0)
    await watch.suspect()  # the runtime answers the first probe: the failed call was something else
    assert watch.up and holds(rig, "a")
    assert len([e for e in rig.runtime.log if e[0] == "probe"]) == 1
