"""LocalModels on the in-process store with a fake runtime: the races a real process
cannot reproduce on demand (each was found by review and confirmed before the fix)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from meshd.core.errors import LoadFailed, NotFound, Unavailable
from meshd.core.records import ModelRecord, VModelRecord
from meshd.decisions.cache import Eviction, State
from meshd.decisions.ids import ModelInfo
from meshd.kv.memory import MemoryStore
from meshd.kv.store import StoreError
from meshd.kv.table import Table
from meshd.registry.models import Registry
from meshd.runtime.loader import LoadQueue
from meshd.serving.local import LocalModels
from meshd.testing.fake_runtime import FakeRuntime, runtime_info


@dataclass
class Rig:
    store: MemoryStore
    registry: Registry
    runtime: FakeRuntime
    local: LocalModels
    now: list[int]

    async def register(self, model_id: str, last_used: int | None = None) -> ModelRecord:
        return await self.registry.register(model_id, ModelInfo("demo", f"/{model_id}"), last_used or self.now[0])

    async def close(self) -> None:
        await self.local.close(deregister=False)
        await self.registry.models.stop()
        await self.registry.vmodels.stop()
        await self.store.close()

    def units_consistent(self) -> bool:
        return sum(e.units for e in self.local.cache.entries()) == self.local.cache.used_units


async def make_rig(capacity_models: int = 4, loading_timeout_ms: int = 2000, eviction: Eviction = Eviction.LRU) -> Rig:
    store = MemoryStore()
    models = Table(store, "/t/registry/", ModelRecord.decode, ModelRecord.encode)
    vmodels = Table(store, "/t/vmodels/", VModelRecord.decode, VModelRecord.encode)
    await models.start()
    await vmodels.start()
    registry = Registry(models, vmodels)
    runtime = FakeRuntime()
    now = [10_000_000]
    local = LocalModels(
        "me",
        registry,
        runtime,  # type: ignore[arg-type]
        runtime_info(capacity_models, loading_timeout_ms=loading_timeout_ms),
        failure_expiry_ms=900_000,
        clock=lambda: now[0],
        eviction=eviction,
    )
    return Rig(store, registry, runtime, local, now)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = await make_rig()
    try:
        yield r
    finally:
        await r.close()


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_hit_miss_load_and_record(rig: Rig) -> None:
    rec = await rig.register("a")
    entry = await rig.local.ensure("a", rec)
    assert entry.state is State.LOADED and rig.runtime.loaded == {"a"}
    assert "me" in rig.registry.get("a").instance_ids  # type: ignore[union-attr]
    await rig.local.ensure("a", rec)
    c = rig.local.counters
    assert (c.hits, c.misses, c.loads) == (1, 1, 1)


async def test_a_cancelled_load_future_keeps_the_copy_it_loaded(rig: Rig) -> None:
    rec = await rig.register("a")
    gate = rig.runtime.hold("a")
    fut = rig.local.start_load("a", rec, rig.now[0])
    await settle()
    fut.cancel()  # what an unshielded caller's deadline used to do to the shared future
    gate.set()
    await asyncio.gather(*rig.local._tasks, return_exceptions=True)
    entry = rig.local.cache.get("a")
    assert entry is not None and entry.state is State.LOADED
    assert await rig.local.ensure("a", rec) is entry
    assert [op for op in rig.runtime.log if op[0] == "load"] == [("load", "a")]  # loaded once, kept
    assert "me" in rig.registry.get("a").instance_ids  # type: ignore[union-attr]


async def test_a_store_failure_while_recording_a_load_failure_still_answers(rig: Rig) -> None:
    rec = await rig.register("bad")
    rig.runtime.fail.add("bad")

    async def broken(*args: object, **kw: object) -> None:
        raise StoreError("etcd NOSPACE")

    rig.registry.record_failure = broken  # type: ignore[method-assign]
    with pytest.raises(LoadFailed):
        await asyncio.wait_for(rig.local.ensure("bad", rec), 5)


async def test_an_old_unload_never_overtakes_a_newer_load(rig: Rig) -> None:
    rig.runtime.unload_delay_s = 0.1
    rec = await rig.register("m")
    gate = rig.runtime.hold("m")
    first = rig.local.start_load("m", rec, rig.now[0])
    await settle()
    rig.local.drop("m")  # unregistered while loading: the load ends in an unload
    gate.set()
    with pytest.raises(NotFound):  # "unregistered while loading"
        await asyncio.wait_for(asyncio.shield(first), 5)
    del rig.runtime.gates["m"]
    entry = await asyncio.wait_for(rig.local.ensure("m", rec), 5)  # re-requested at once
    await settle()
    await asyncio.gather(*rig.local._tasks, return_exceptions=True)
    assert entry.state is State.LOADED
    assert rig.runtime.loaded == {"m"}, rig.runtime.log
    assert rig.runtime.log[-2:] == [("unload", "m"), ("load", "m")], rig.runtime.log


async def test_a_failed_load_is_unloaded_before_the_retry_loads(rig: Rig) -> None:
    rig.local.failure_expiry_ms = 0  # retry at once
    rig.runtime.unload_delay_s = 0.1
    rec = await rig.register("f")
    rig.runtime.fail.add("f")
    with pytest.raises(LoadFailed):
        await rig.local.ensure("f", rec)
    rig.runtime.fail.clear()
    rec = rig.registry.get("f")
    assert rec is not None
    await rig.local.ensure("f", rec)
    await asyncio.gather(*rig.local._tasks, return_exceptions=True)
    assert rig.runtime.log == [("load", "f"), ("unload-start", "f"), ("unload", "f"), ("load", "f")]
    assert rig.runtime.loaded == {"f"}


async def test_a_background_load_dated_in_the_past_does_not_block_a_request() -> None:
    r = await make_rig(capacity_models=2, loading_timeout_ms=3000)
    try:
        for mid in ("a", "b"):
            await r.local.ensure(mid, await r.register(mid))
        old = await r.register("old", last_used=r.now[0] - 3_600_000)
        background = r.local.start_load("old", old, old.last_used)  # registerModel(loadNow)
        with pytest.raises(Unavailable):
            await asyncio.wait_for(asyncio.shield(background), 1)  # refused at once, not after 3 s
        entry = await asyncio.wait_for(r.local.ensure("old", old), 1)  # a request may evict
        assert entry.state is State.LOADED and r.local.counters.evictions == 1
        assert r.units_consistent()
    finally:
        await r.close()


async def test_dropping_a_model_wakes_a_load_waiting_for_room() -> None:
    r = await make_rig(capacity_models=1, loading_timeout_ms=5000)
    try:
        a = await r.register("a")
        gate = r.runtime.hold("a")
        loading_a = r.local.start_load("a", a, r.now[0])
        await settle()
        b = await r.register("b")
        waiting_b = asyncio.create_task(r.local.ensure("b", b))  # full of a loading model
        await settle()
        assert not waiting_b.done()
        r.local.drop("a")
        entry = await asyncio.wait_for(waiting_b, 1)  # not after the 5 s timeout
        assert entry.state is State.LOADED
        gate.set()
        with pytest.raises(NotFound):
            await asyncio.wait_for(asyncio.shield(loading_a), 5)
        assert r.units_consistent()
    finally:
        await r.close()


async def test_a_load_its_requests_wait_on_is_used_now_each_time_it_tries_for_room() -> None:
    """Issue 33: a request waits for room while the only other copy loads; that copy is then
    used more recently than the request arrived. The waiting request is in use now, so it
    evicts it, rather than failing for good as "full of more recently used models"."""
    r = await make_rig(capacity_models=1, loading_timeout_ms=5000)
    try:
        c = await r.register("c")
        gate = r.runtime.hold("c")
        loading_c = r.local.start_load("c", c, r.now[0] + 5_000)  # asked for later than b
        await settle()
        b = await r.register("b")
        waiting_b = asyncio.create_task(r.local.ensure("b", b))  # no room until c has loaded
        await settle()
        assert not waiting_b.done()
        r.now[0] += 10_000
        gate.set()
        await asyncio.wait_for(asyncio.shield(loading_c), 5)
        entry = await asyncio.wait_for(waiting_b, 5)
        assert entry.state is State.LOADED and "c" not in r.local.cache
        assert r.units_consistent()
    finally:
        await r.close()


async def test_evicting_a_failed_entry_is_not_counted_as_an_eviction() -> None:
    r = await make_rig(capacity_models=1)
    try:
        r.local.failure_expiry_ms = 10**9
        bad = await r.register("bad")
        r.runtime.fail.add("bad")
        with pytest.raises(LoadFailed):
            await r.local.ensure("bad", bad)
        await r.local.ensure("good", await r.register("good"))
        assert r.local.counters.evictions == 0 and "bad" not in r.local.cache
    finally:
        await r.close()


async def test_a_loads_cost_is_the_runtimes_time_not_its_wait_for_a_loading_slot() -> None:
    """GDSF weighs copies by load time: a load that queued behind another must not look slow."""
    runtime = FakeRuntime()
    info = dataclasses.replace(runtime_info(), max_loading_concurrency=1)
    queue = LoadQueue(runtime, info, lambda model_id: None)  # type: ignore[arg-type]
    gate = runtime.hold("slow")
    slow = asyncio.create_task(queue.load("slow", "demo", "/slow", ""))
    await settle()
    quick = asyncio.create_task(queue.load("quick", "demo", "/quick", ""))  # waits for the one slot
    await asyncio.sleep(0.3)
    gate.set()
    slow_loaded, quick_loaded = await slow, await quick
    assert slow_loaded.load_ms >= 250
    assert quick_loaded.load_ms < slow_loaded.load_ms  # its 300 ms in the queue are not counted


@pytest.mark.parametrize("eviction", [Eviction.GDSF, Eviction.LRFU])
async def test_requests_that_join_a_load_count_as_uses(eviction: Eviction) -> None:
    """GDSF and LRFU rank copies by uses: a burst that waited on one load must not look like one use."""
    r = await make_rig(eviction=eviction)
    try:
        rec = await r.register("a")
        gate = r.runtime.hold("a")
        first = asyncio.create_task(r.local.ensure("a", rec))
        await settle()
        joined = [asyncio.create_task(r.local.ensure("a", rec)) for _ in range(3)]
        await settle()
        gate.set()
        await asyncio.gather(first, *joined)
        entry = r.local.cache.get("a")
        assert entry is not None
        assert (entry.uses if eviction is Eviction.GDSF else entry.score) == 4  # no eviction yet: no decay
    finally:
        await r.close()


async def test_a_capped_copy_leaves_the_runtime_before_its_record_and_the_janitor_waits_for_it(rig: Rig) -> None:
    """Issue 34: the record is what lets another instance load a capped model, so it names
    this instance until the runtime has let the copy go; a janitor run meanwhile leaves it."""
    rec = await rig.registry.register("c", ModelInfo("demo", "/c", key='{"meshd": {"max_copies": 1}}'), rig.now[0])
    await rig.local.ensure("c", rec)
    rig.runtime.unload_delay_s = 0.2
    assert rig.local.shed("c")
    await settle()
    assert "c" in rig.runtime.loaded  # still unloading
    assert "me" in (await rig.registry.fetch("c")).instance_ids
    assert rig.local.releasing("c") is not None
    await rig.local.reconcile()
    assert "me" in (await rig.registry.fetch("c")).instance_ids  # the janitor left it
    await asyncio.gather(*rig.local._tasks, return_exceptions=True)
    assert "c" not in rig.runtime.loaded and "me" not in (await rig.registry.fetch("c")).instance_ids
    assert rig.local.releasing("c") is None


async def test_an_uncapped_copy_leaves_its_record_first(rig: Rig) -> None:
    rec = await rig.register("u")
    await rig.local.ensure("u", rec)
    rig.runtime.unload_delay_s = 0.2
    assert rig.local.shed("u")
    await settle()
    assert "u" in rig.runtime.loaded and "me" not in (await rig.registry.fetch("u")).instance_ids
    assert rig.local.releasing("u") is None  # nobody waits: other copies may load at once
