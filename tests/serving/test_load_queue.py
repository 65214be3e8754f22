"""The daemon's load queue under MESHD_LOAD_QUEUE=value (issue 24): the most valuable load
gets the next thread, a waiting load takes no room, a load that cannot start in time is
refused at once with RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest

from meshd.core.errors import LoadFailed, NotFound, ResourceExhausted
from meshd.core.records import ModelRecord, VModelRecord
from meshd.decisions.cache import State
from meshd.decisions.ids import ModelInfo
from meshd.decisions.placement import loading
from meshd.kv.memory import MemoryStore
from meshd.kv.table import Table
from meshd.registry.models import CopyAdded, Registry
from meshd.runtime.loader import LoadQueue
from meshd.serving.local import LocalModels
from meshd.testing.fake_runtime import FakeRuntime, runtime_info


async def settle() -> None:
    for _ in range(30):
        await asyncio.sleep(0)


async def test_a_freed_thread_goes_to_the_most_valuable_waiting_load() -> None:
    runtime = FakeRuntime()
    info = dataclasses.replace(runtime_info(), max_loading_concurrency=1)
    queue = LoadQueue(runtime, info, lambda model_id: None)  # type: ignore[arg-type]
    gate = runtime.hold("first")
    first = asyncio.create_task(queue.load("first", "demo", "/first", ""))
    await settle()
    order: list[str] = []

    async def wait(model_id: str, value: float) -> None:
        await queue.slot(model_id, lambda: value)
        order.append(model_id)
        queue.release()

    cold = asyncio.create_task(wait("cold", 1.0))  # queued first
    await settle()
    hot = asyncio.create_task(wait("hot", 5.0))
    await settle()
    assert queue.waiting == 2 and queue.busy == 1
    gate.set()
    await asyncio.gather(first, cold, hot)
    assert order == ["hot", "cold"]
    assert queue.waiting == 0 and queue.busy == 0


async def test_a_displaced_waiting_load_is_refused() -> None:
    runtime = FakeRuntime()
    info = dataclasses.replace(runtime_info(), max_loading_concurrency=1)
    queue = LoadQueue(runtime, info, lambda model_id: None)  # type: ignore[arg-type]
    gate = runtime.hold("first")
    first = asyncio.create_task(queue.load("first", "demo", "/first", ""))
    await settle()
    waiting = asyncio.create_task(queue.slot("cold"))
    await settle()
    assert queue.displace("cold", ResourceExhausted("a hotter load took its place"))
    with pytest.raises(ResourceExhausted):
        await waiting
    gate.set()
    await first
    assert queue.busy == 0


async def test_a_thread_freed_while_a_cancelled_waiter_has_not_left_goes_to_the_next() -> None:
    """A waiter cancelled in the same loop step as a load ends is still in the table when the
    load's `finally` frees its thread: the thread must go to a live waiter (or the pool), and
    the finished load must not fail (it did, with InvalidStateError, in CI)."""
    runtime = FakeRuntime()
    info = dataclasses.replace(runtime_info(), max_loading_concurrency=1)
    queue = LoadQueue(runtime, info, lambda model_id: None)  # type: ignore[arg-type]
    gate = runtime.hold("first")
    first = asyncio.create_task(queue.load("first", "demo", "/first", ""))
    await settle()
    gone = asyncio.create_task(queue.slot("gone", lambda: 9.0))  # the more valuable waiter
    await settle()
    later = asyncio.create_task(queue.slot("later", lambda: 1.0))
    await settle()
    assert queue.waiting == 2
    gate.set()  # the first load's step comes first: it ends and its `finally` frees the thread
    gone.cancel()  # in the same loop step: `gone`'s future is cancelled, its clean-up not yet run
    await first  # the load the runtime did ends as done, not failed
    await settle()
    assert gone.cancelled()
    assert later.done() and later.exception() is None  # the live waiter got the thread
    assert queue.waiting == 0 and queue.busy == 1
    queue.release()
    assert queue.busy == 0


async def test_finished_loads_teach_the_assume_loaded_horizon() -> None:
    runtime = FakeRuntime(fail={"broken"})
    info = runtime_info(loading_timeout_ms=120_000)
    queue = LoadQueue(runtime, info, lambda model_id: None)  # type: ignore[arg-type]
    assert queue.assume_loaded.ms("demo") == 40_000  # max(3 s, timeout / 3) until loads finish
    for i in range(4):
        await queue.load(f"m{i}", "demo", f"/m{i}", "")
    with pytest.raises(LoadFailed):
        await queue.load("broken", "demo", "/broken", "")
    assert queue.assume_loaded.types["demo"].count == 4, "a failed load is not a load time"
    # Four fake loads take milliseconds: mean + 5 sigma of them, far below the default.
    assert queue.assume_loaded.ms("demo") < 40_000 // 10
    assert queue.assume_loaded.ms("other") == 40_000


@pytest.fixture
async def local() -> AsyncIterator[tuple[LocalModels, FakeRuntime, Registry]]:
    store = MemoryStore()
    models = Table(store, "/t/registry/", ModelRecord.decode, ModelRecord.encode)
    vmodels = Table(store, "/t/vmodels/", VModelRecord.decode, VModelRecord.encode)
    await models.start()
    await vmodels.start()
    registry = Registry(models, vmodels)
    runtime = FakeRuntime()
    info = dataclasses.replace(runtime_info(2), max_loading_concurrency=1)
    now = [10_000_000]
    lm = LocalModels(
        "me",
        registry,
        runtime,  # type: ignore[arg-type]
        info,
        failure_expiry_ms=900_000,
        clock=lambda: now[0],
        load_queue=True,
        load_wait_limit_ms=10_000,
    )
    try:
        yield lm, runtime, registry
    finally:
        await lm.close(deregister=False)
        await models.stop()
        await vmodels.stop()
        await store.close()


async def test_a_waiting_load_takes_no_room_so_the_serving_copy_stays(
    local: tuple[LocalModels, FakeRuntime, Registry],
) -> None:
    lm, runtime, registry = local
    recs = {m: await registry.register(m, ModelInfo("demo", f"/{m}"), 1) for m in ("hot", "c1", "c2")}
    await lm.ensure("hot", recs["hot"], 100)
    gate = runtime.hold("c1")
    c1 = asyncio.create_task(lm.ensure("c1", recs["c1"], 200))  # takes the free half and the thread
    await settle()
    c2 = asyncio.create_task(lm.ensure("c2", recs["c2"], 300))  # waits for the thread
    await settle()
    assert lm.queue.waiting == 1
    hot = lm.cache.get("hot")
    assert hot is not None and hot.state is State.LOADED  # upstream's queue would have evicted it
    assert "c2" not in lm.cache
    gate.set()
    await asyncio.gather(c1, c2)
    assert "c2" in lm.cache  # room taken once its load started (evicting the LRU then)


async def test_a_waiting_load_is_in_the_record_so_requests_elsewhere_join_it(
    local: tuple[LocalModels, FakeRuntime, Registry],
) -> None:
    """Before it waits for a thread the copy is recorded (as the simulator always had it): a
    peer reading the record sends its requests here instead of loading a second copy. On a
    bench whose hot set jumps, recording only once the load began cost 7 % more loads."""
    lm, runtime, registry = local
    recs = {m: await registry.register(m, ModelInfo("demo", f"/{m}"), 1) for m in ("c1", "c2")}
    gate = runtime.hold("c1")
    c1 = asyncio.create_task(lm.ensure("c1", recs["c1"], 200))
    await settle()
    c2 = asyncio.create_task(lm.ensure("c2", recs["c2"], 300))
    await settle()
    try:
        assert lm.queue.waiting == 1 and "c2" not in lm.cache
        waiting = registry.get("c2")
        assert waiting is not None and "me" in waiting.instance_ids
        await lm.reconcile()  # the janitor leaves it: not in the cache yet, but loading here
        await settle()
        still = registry.get("c2")
        assert still is not None and "me" in still.instance_ids
    finally:
        gate.set()
    await asyncio.wait_for(asyncio.gather(c1, c2), timeout=5)
    loaded = registry.get("c2")
    assert loaded is not None and "me" in loaded.instance_ids


async def test_a_load_refused_while_it_waited_for_its_record_gives_its_thread_back(
    local: tuple[LocalModels, FakeRuntime, Registry], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load queues for a thread while its record is written: when the write finds the model
    unregistered, the thread it was handed meanwhile goes back and the next load takes it."""
    lm, _runtime, registry = local
    recs = {m: await registry.register(m, ModelInfo("demo", f"/{m}"), 1) for m in ("gone", "next")}
    written = asyncio.Event()
    add_copy = registry.add_copy

    async def unregistered_meanwhile(model_id: str, *args: object, **kwargs: object) -> CopyAdded | None:
        if model_id == "gone":
            await written.wait()
            return None  # what add_copy says when the record went
        return await add_copy(model_id, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(registry, "add_copy", unregistered_meanwhile)
    gone = asyncio.create_task(lm.ensure("gone", recs["gone"], 200))
    await settle()
    assert lm.queue.busy == 1  # the thread is its own while the write is under way
    written.set()
    with pytest.raises(NotFound, match="unregistered"):
        await asyncio.wait_for(gone, timeout=5)
    assert lm.queue.busy == 0 and lm.queue.waiting == 0
    loaded = await asyncio.wait_for(lm.ensure("next", recs["next"], 300), timeout=5)
    assert loaded.state is State.LOADED and "gone" not in lm.cache


async def test_a_load_that_cannot_start_within_the_limit_is_refused_at_once(
    local: tuple[LocalModels, FakeRuntime, Registry],
) -> None:
    lm, runtime, registry = local
    lm.load_wait_limit_ms = 1_000  # one 1 s load running: a new one would wait past half of it
    recs = {m: await registry.register(m, ModelInfo("demo", f"/{m}"), 1) for m in ("c1", "c2")}
    gate = runtime.hold("c1")
    c1 = asyncio.create_task(lm.ensure("c1", recs["c1"], 200))
    await settle()
    with pytest.raises(ResourceExhausted) as refused:
        await asyncio.wait_for(lm.ensure("c2", recs["c2"], 300), timeout=5)
    msg = refused.value.message
    assert "load capacity exhausted" in msg and "'c2'" in msg and "retry after" in msg
    assert "c2" not in lm.cache and lm.queue.waiting == 0
    gate.set()
    await c1


async def test_a_load_requests_waited_on_is_dated_when_it_starts_not_when_asked(
    local: tuple[LocalModels, FakeRuntime, Registry],
) -> None:
    """Its requests' clock was read before the load was queued (here 5 ms before, as a
    request's or a peer's is): the copies used while it waited must not refuse it room."""
    lm, runtime, registry = local
    clock = lm.clock
    recs = {m: await registry.register(m, ModelInfo("demo", f"/{m}"), 1) for m in ("a", "b", "new")}
    gate = runtime.hold("b")
    await lm.ensure("a", recs["a"], clock() - 10)
    b = asyncio.create_task(lm.ensure("b", recs["b"], clock() - 10))  # fills the cache, holds the thread
    await settle()
    new = asyncio.create_task(lm.ensure("new", recs["new"], clock() - 5))  # waits for the thread
    await settle()
    assert lm.queue.waiting == 1
    for used in ("a", "b"):  # both used while "new" waits: newer than its request
        lm.cache.touch(used, clock())
    gate.set()
    loaded = await asyncio.wait_for(new, timeout=5)
    await b
    assert loaded.state is State.LOADED and "new" in lm.cache


async def _cold_waiting_behind_a_load(
    lm: LocalModels, runtime: FakeRuntime, registry: Registry
) -> tuple[dict[str, ModelRecord], asyncio.Event, asyncio.Task[object], asyncio.Task[object]]:
    """One load running, one cold load waiting: the queue is at its bound (a second waiter
    would start 2 s from now, past half of the 3 s limit)."""
    lm.load_wait_limit_ms = 3_000
    recs = {m: await registry.register(m, ModelInfo("demo", f"/{m}"), 1) for m in ("c1", "cold", "hot")}
    for _ in range(5):
        lm.popularity.count("hot")  # asked for here before: worth more than the cold one
    gate = runtime.hold("c1")
    running = asyncio.create_task(lm.ensure("c1", recs["c1"], 200))
    await settle()
    cold = asyncio.create_task(lm.ensure("cold", recs["cold"], 300))
    await settle()
    assert lm.queue.waiting == 1
    return recs, gate, running, cold  # type: ignore[return-value]


async def test_a_hotter_miss_displaces_a_load_that_just_began_waiting(
    local: tuple[LocalModels, FakeRuntime, Registry],
) -> None:
    lm, runtime, registry = local
    recs, gate, running, cold = await _cold_waiting_behind_a_load(lm, runtime, registry)
    hot = asyncio.create_task(lm.ensure("hot", recs["hot"], 400))
    try:
        with pytest.raises(ResourceExhausted, match="'hot' is wanted more than it"):
            await asyncio.wait_for(cold, timeout=5)
    finally:
        gate.set()
    await asyncio.wait_for(asyncio.gather(running, hot), timeout=5)
    assert "hot" in lm.cache and "cold" not in lm.cache
    await settle()
    displaced = registry.get("cold")  # recorded while it waited; gone with the load
    assert displaced is not None and "me" not in displaced.instance_ids


async def test_a_load_that_has_waited_keeps_its_place_and_the_newcomer_is_refused_fast(
    local: tuple[LocalModels, FakeRuntime, Registry],
) -> None:
    """Its requests have waited: refused now, they would fail slowly (issue 24: failures are
    only fast refusals). The newcomer is refused at once and may try another copy."""
    lm, runtime, registry = local
    recs, gate, running, cold = await _cold_waiting_behind_a_load(lm, runtime, registry)
    await asyncio.sleep((loading.DISPLACE_WITHIN_MS + 50) / 1000)
    hot = asyncio.create_task(lm.ensure("hot", recs["hot"], 400))
    await settle()
    try:
        assert hot.done() and not cold.done() and lm.queue.waiting == 1
        with pytest.raises(ResourceExhausted, match="load capacity exhausted: cannot load 'hot'"):
            hot.result()
    finally:
        gate.set()
    await asyncio.wait_for(asyncio.gather(running, cold), timeout=5)
    assert "cold" in lm.cache and "hot" not in lm.cache


async def test_a_miss_whose_deadline_comes_before_its_load_could_end_is_refused_at_once(
    local: tuple[LocalModels, FakeRuntime, Registry],
) -> None:
    """A load that would only end after its request gave up is refused (RESOURCE_EXHAUSTED,
    saying so) instead of holding a place in the queue; with time enough it queues."""
    lm, runtime, registry = local
    recs = {m: await registry.register(m, ModelInfo("demo", f"/{m}"), 1) for m in ("c1", "short", "long")}
    gate = runtime.hold("c1")
    c1 = asyncio.create_task(lm.ensure("c1", recs["c1"], 200))  # holds the one loading thread
    await settle()
    soon = asyncio.get_running_loop().time() + 0.5  # the loop's clock is time.monotonic()
    with pytest.raises(ResourceExhausted, match=r"deadline is 0\.5 s away") as refused:
        await asyncio.wait_for(lm.ensure("short", recs["short"], 300, deadline=soon), timeout=5)
    assert "load capacity exhausted" in refused.value.message
    assert "short" not in lm.cache and lm.queue.waiting == 0
    later = asyncio.create_task(lm.ensure("long", recs["long"], 300, deadline=soon + 60))
    await settle()
    assert lm.queue.waiting == 1  # room for its wait and its load before its deadline
    gate.set()
    await asyncio.wait_for(asyncio.gather(c1, later), timeout=5)
    assert "long" in lm.cache


async def test_a_load_that_starts_at_once_is_not_refused_for_a_short_deadline(
    local: tuple[LocalModels, FakeRuntime, Registry],
) -> None:
    """Nothing waits: the load starts whatever the deadline (the copy serves the next requests)."""
    lm, _runtime, registry = local
    rec = await registry.register("m", ModelInfo("demo", "/m"), 1)
    soon = asyncio.get_running_loop().time() + 0.001
    loaded = await asyncio.wait_for(lm.ensure("m", rec, 300, deadline=soon), timeout=5)
    assert loaded.state is State.LOADED


async def test_a_patient_request_waits_for_its_load_beyond_the_wait_limit(
    local: tuple[LocalModels, FakeRuntime, Registry],
) -> None:
    """Issue 33: the wait limit (here 10 s, stretched by nothing: the mean load is 1 s) stops
    a load that waited 10 s; a request whose deadline is a minute away keeps its load waiting,
    and so does one that joins a waiting load with such a deadline."""
    lm, runtime, registry = local
    recs = {
        m: await registry.register(m, ModelInfo("demo", f"/{m}"), 1) for m in ("c1", "hurried", "patient", "joined")
    }
    gate = runtime.hold("c1")
    c1 = asyncio.create_task(lm.ensure("c1", recs["c1"], 200))  # holds the one loading thread
    await settle()
    lm.load_wait_limit_ms = 200  # 0.2 s ...
    lm.queue.mean_load_ms = 10.0  # as if loads took 10 ms: the limit stays 0.2 s
    loop = asyncio.get_running_loop()
    hurried = asyncio.create_task(lm.ensure("hurried", recs["hurried"], 300))
    patient = asyncio.create_task(lm.ensure("patient", recs["patient"], 300, deadline=loop.time() + 60))
    joined = asyncio.create_task(lm.ensure("joined", recs["joined"], 300))  # no deadline at first
    await settle()
    assert lm.queue.waiting == 3
    late_joiner = asyncio.create_task(lm.ensure("joined", recs["joined"], 400, deadline=loop.time() + 60))
    await asyncio.sleep(0.5)  # past the 0.2 s limit
    try:
        assert hurried.done()
        with pytest.raises(ResourceExhausted, match=r"waited 0\.2 s for a loading thread"):
            hurried.result()
        assert not patient.done() and not joined.done() and lm.queue.waiting == 2
    finally:
        gate.set()
    await asyncio.wait_for(asyncio.gather(c1, patient, joined, late_joiner), timeout=5)
    assert "patient" in lm.cache and "joined" in lm.cache and "hurried" not in lm.cache
