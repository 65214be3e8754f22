"""A model's max copies on the in-process store: the compare-and-set rule in the registry
(instances adding a copy at once), the load path that honours it, and the janitor's
surplus rule (only serving holders count; re-checked before a copy is shed)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from meshd.core.records import ModelRecord
from meshd.decisions.cache import CacheEntry, State
from meshd.decisions.ids import ModelInfo
from meshd.decisions.janitor import plan_repairs
from meshd.decisions.placement.view import ClusterView, InstanceView
from meshd.kv.memory import MemoryStore
from meshd.registry.models import CopiesFull, CopyAdded, Registry
from meshd.serving.local import LocalModels
from meshd.testing.fake_runtime import FakeRuntime, runtime_info
from tests.registry.rig import new_registry

MAX_ONE = '{"meshd": {"max_copies": 1}}'
MAX_TWO = '{"meshd": {"max_copies": 2}}'
NOW = 10_000_000


def cluster(self_id: str, *ids: str, leaving: frozenset[str] = frozenset()) -> ClusterView:
    return ClusterView(self_id, NOW, {i: InstanceView(i, shutdown=i in leaving) for i in ids})


@pytest.fixture
async def store() -> AsyncIterator[MemoryStore]:
    s = MemoryStore()
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def registries(store: MemoryStore) -> AsyncIterator[tuple[Registry, Registry]]:
    """Two instances' registries: each its own mirror of one store (as two processes)."""
    a, b = await new_registry(store), await new_registry(store)
    try:
        yield a, b
    finally:
        for r in (a, b):
            await r.models.stop()
            await r.vmodels.stop()


async def register(registry: Registry, model_id: str, key: str) -> ModelRecord:
    return await registry.register(model_id, ModelInfo("demo", f"/{model_id}", key), NOW)


# ---- the compare-and-set rule -----------------------------------------------------------
async def test_two_instances_adding_a_max_one_copy_at_once_only_one_wins(
    registries: tuple[Registry, Registry],
) -> None:
    ra, rb = registries
    await register(ra, "m", MAX_ONE)
    await rb.models.wait_for(ra.models.revision)
    serving = {"a", "b"}
    # Both mirrors show no holder; the second write conflicts, re-reads, and is refused.
    results = await asyncio.gather(
        ra.add_copy("m", "a", NOW, serving), rb.add_copy("m", "b", NOW, serving), return_exceptions=True
    )
    refused = [r for r in results if isinstance(r, CopiesFull)]
    assert len(refused) == 1 and sum(isinstance(r, CopyAdded) for r in results) == 1, results
    kv = await ra.fetch("m")
    assert len(kv.instance_ids) == 1
    assert refused[0].holders == kv.instance_ids  # the winner, for the request to go to


async def test_only_serving_holders_count_toward_the_max(registries: tuple[Registry, Registry]) -> None:
    ra, _ = registries
    await register(ra, "m", MAX_ONE)
    await ra.add_copy("m", "gone", NOW)  # no check without `serving`: as the reconcile at start
    # A gone holder's id lingers until pruned; a leaving (draining) holder is not in `serving`.
    assert await ra.add_copy("m", "a", NOW, serving={"a", "draining"})
    with pytest.raises(CopiesFull):
        await ra.add_copy("m", "b", NOW, serving={"a", "b"})
    assert await ra.add_copy("m", "a", NOW + 1, serving={"a", "b"})  # already named: a re-add


async def test_the_limit_is_the_policy_max_and_uncapped_models_have_none(
    registries: tuple[Registry, Registry],
) -> None:
    ra, _ = registries
    await register(ra, "two", MAX_TWO)
    await register(ra, "free", "")
    serving = {"a", "b", "c"}
    for iid in ("a", "b"):
        assert await ra.add_copy("two", iid, NOW, serving)
        assert await ra.add_copy("free", iid, NOW, serving)
    with pytest.raises(CopiesFull):
        await ra.add_copy("two", "c", NOW, serving)
    assert await ra.add_copy("free", "c", NOW, serving)
    assert not await ra.add_copy("unregistered", "a", NOW, serving)


# ---- the load path ----------------------------------------------------------------------
def local_models(iid: str, registry: Registry, view: Callable[[], ClusterView]) -> tuple[LocalModels, FakeRuntime]:
    runtime = FakeRuntime()
    local = LocalModels(
        iid,
        registry,
        runtime,  # type: ignore[arg-type]
        runtime_info(4),
        failure_expiry_ms=900_000,
        clock=lambda: NOW,
    )
    local.cluster_view = view
    return local, runtime


async def test_concurrent_loads_of_a_max_one_model_load_one_runtime(registries: tuple[Registry, Registry]) -> None:
    ra, rb = registries
    rec = await register(ra, "m", MAX_ONE)
    await rb.models.wait_for(ra.models.revision)
    a, runtime_a = local_models("a", ra, lambda: cluster("a", "a", "b"))
    b, runtime_b = local_models("b", rb, lambda: cluster("b", "a", "b"))
    try:
        results = await asyncio.gather(a.ensure("m", rec), b.ensure("m", rec), return_exceptions=True)
        refused = [r for r in results if isinstance(r, CopiesFull)]
        assert len(refused) == 1, results
        assert len(runtime_a.loaded) + len(runtime_b.loaded) == 1
        assert ("load", "m") not in (runtime_a.log if refused[0] is results[0] else runtime_b.log)
        assert "m" not in (a.cache if refused[0] is results[0] else b.cache)  # its admission undone
    finally:
        for local in (a, b):
            await local.close(deregister=False)


# ---- the janitor's surplus rule ---------------------------------------------------------
def test_a_leaving_holder_does_not_make_a_copy_surplus() -> None:
    # "me" rejoins (not in live) while "peer", which reloaded the model, drains.
    records = {"m": ModelRecord(type="t", key=MAX_ONE, instance_ids={"me": 1, "peer": 2})}
    entries = [CacheEntry("m", 1, 0, State.LOADED)]
    assert plan_repairs("me", records, entries, live={"peer"}, leaving={"peer"}).surplus == ()
    assert plan_repairs("me", records, entries, live={"peer"}).surplus == ("m",)


async def test_the_janitor_rechecks_surplus_before_shedding(registries: tuple[Registry, Registry]) -> None:
    ra, _ = registries
    rec = await register(ra, "m", MAX_ONE)
    views = [cluster("me", "me", "peer")]

    def view() -> ClusterView:  # the next view each time it is asked, then the last one
        return views.pop(0) if len(views) > 1 else views[0]

    local, runtime = local_models("me", ra, view)
    try:
        await local.ensure("m", rec)
        await ra.remove_copy("m", "me")
        await ra.add_copy("m", "peer", NOW)  # reloaded on "peer" while "me" was away
        # Planned as surplus, but "peer" starts draining before the copy is shed: kept.
        views[:] = [cluster("me", "peer"), cluster("me", "peer", leaving=frozenset({"peer"}))]
        repairs = await local.reconcile(live={"peer"})
        assert repairs.surplus == ("m",)
        entry = local.cache.get("m")
        assert entry is not None and entry.state is State.LOADED and runtime.loaded == {"m"}
        # Still serving at the next round: now it goes.
        views[:] = [cluster("me", "peer")]
        await local.reconcile(live={"peer"})
        assert "m" not in local.cache and "me" not in (await ra.fetch("m")).instance_ids
    finally:
        await local.close(deregister=False)
