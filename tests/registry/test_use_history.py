"""A model's use history in its record (issue 33), on the in-process store: the eviction that
removes a copy writes it, the next instance to load the model starts from it, and an older
history never replaces a newer one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from meshd.core.records import USE_HISTORY, ModelRecord, use_history
from meshd.decisions.cache import Eviction
from meshd.decisions.ids import ModelInfo
from meshd.kv.memory import MemoryStore
from meshd.registry.models import Registry
from meshd.serving.local import LocalModels
from meshd.testing.fake_runtime import FakeRuntime, runtime_info
from meshd.testing.procs import wait_until_async
from tests.registry.rig import new_registry


def local(instance_id: str, registry: Registry, now: list[int], eviction: Eviction = Eviction.RATE) -> LocalModels:
    return LocalModels(
        instance_id,
        registry,
        FakeRuntime(),  # type: ignore[arg-type]
        runtime_info(1),  # room for one model
        failure_expiry_ms=900_000,
        clock=lambda: now[0],
        eviction=eviction,
    )


@contextlib.asynccontextmanager
async def pair(eviction: Eviction) -> AsyncIterator[tuple[LocalModels, LocalModels, Registry, Registry]]:
    """Two instances, a and b, on one store, each with room for one model."""
    store = MemoryStore()
    ra, rb = await new_registry(store), await new_registry(store)
    now = [10_000_000]
    a, b = local("a", ra, now, eviction), local("b", rb, now, eviction)
    try:
        yield a, b, ra, rb
    finally:
        for lm, r in ((a, ra), (b, rb)):
            await lm.close(deregister=False)
            await r.models.stop()
            await r.vmodels.stop()
        await store.close()


@pytest.fixture
async def two() -> AsyncIterator[tuple[LocalModels, LocalModels, Registry]]:
    async with pair(Eviction.RATE) as (a, b, ra, _):
        yield a, b, ra


async def test_the_history_outlives_the_last_copy_and_the_next_instance_starts_from_it(
    two: tuple[LocalModels, LocalModels, Registry],
) -> None:
    a, b, registry = two
    for m in ("m", "x"):
        await registry.register(m, ModelInfo("demo", f"/{m}"), 1)
    await a.ensure("m", registry.get("m"))  # type: ignore[arg-type]
    for _ in range(4):
        a.cache.touch("m", a.clock())  # four more uses: five with its load's
    await a.ensure("x", registry.get("x"))  # type: ignore[arg-type]  # evicts m, m's last copy
    assert "x" in a.cache and "m" not in a.cache

    def history_written() -> bool:
        rec = registry.get("m")
        return rec is not None and not rec.instance_ids and len(use_history(rec.extra)) == 5

    await wait_until_async(history_written, 5, "m's history in its record, its copy gone")
    history = use_history(registry.get("m").extra)  # type: ignore[union-attr]
    await asyncio.wait_for(b.registry.models.catch_up(), 5)
    entry = await b.ensure("m", b.registry.get("m"))  # type: ignore[arg-type]
    assert entry.uses_at[:5] == history and len(entry.uses_at) == 6


async def test_an_older_history_does_not_replace_a_newer_one(two: tuple[LocalModels, LocalModels, Registry]) -> None:
    _a, _b, registry = two
    await registry.register("m", ModelInfo("demo", "/m"), 1)
    await registry.add_copy("m", "a", 1)
    await registry.add_copy("m", "b", 1)

    def with_history(rec: ModelRecord | None) -> ModelRecord | None:
        assert rec is not None
        rec.extra[USE_HISTORY] = [5.0, 9.0]
        return rec

    await registry.models.update("m", with_history)
    await registry.remove_copy("m", "a", (1.0, 2.0))  # older than the record's: kept as it was

    def only_b_left() -> bool:
        r = registry.get("m")
        return r is not None and list(r.instance_ids) == ["b"]

    await wait_until_async(only_b_left, 5, "a's copy removed")
    assert use_history(registry.get("m").extra) == (5.0, 9.0)  # type: ignore[union-attr]
    await registry.remove_copy("m", "b", (3.0, 12.0))  # newer: replaces it

    def newer() -> bool:
        r = registry.get("m")
        return r is not None and not r.instance_ids and use_history(r.extra) == (3.0, 12.0)

    await wait_until_async(newer, 5, "the newer history")


async def test_an_adaptive_eviction_notes_its_order_and_the_next_load_is_charged_and_clears_it() -> None:
    """Issue 44: the evicting instance writes which order chose the victim and the clock
    then; the instance that loads the model next charges that order, and its copy's write
    clears the note (one eviction, one charge)."""
    from meshd.core.records import EVICTED_BY, eviction_note
    from meshd.decisions.regret import RATE

    async with pair(Eviction.ADAPTIVE) as (a, b, ra, rb):
        for m in ("m", "x"):
            await ra.register(m, ModelInfo("demo", f"/{m}"), 1)
        await a.ensure("m", ra.get("m"))  # type: ignore[arg-type]
        await a.ensure("x", ra.get("x"))  # type: ignore[arg-type]  # evicts m, by RATE's order

        def noted() -> bool:
            rec = ra.get("m")
            return rec is not None and not rec.instance_ids and eviction_note(rec.extra) is not None

        await wait_until_async(noted, 5, "m's eviction note in its record")
        assert eviction_note(ra.get("m").extra) == (RATE, a.cache.clock)  # type: ignore[union-attr]
        assert a.cache.regret is not None and a.cache.regret.tally().evictions == (1.0, 0.0)
        await asyncio.wait_for(rb.models.catch_up(), 5)
        await b.ensure("m", rb.get("m"))  # type: ignore[arg-type]
        assert b.cache.regret is not None and b.cache.regret.tally().charges[RATE] > 0.0

        def cleared() -> bool:
            rec = rb.get("m")
            return rec is not None and "b" in rec.instance_ids and EVICTED_BY not in rec.extra

        await wait_until_async(cleared, 5, "the note cleared by b's copy")


@pytest.mark.parametrize("eviction", [Eviction.RATE, Eviction.ADAPTIVE])
async def test_a_load_on_a_record_its_mirror_read_before_the_eviction_starts_from_the_stored_past(
    eviction: Eviction,
) -> None:
    """The past is read in the compare-and-set that adds the copy, not from the mirror: a load
    that starts on the record as it was before another instance evicted the model's last copy
    (b's watch not caught up: a load can arrive in that window) still starts from the uses that
    eviction wrote and charges the order its note names. Before, it started from nothing and
    its add cleared the note it had not read (the charge lost)."""
    from meshd.core.records import EVICTED_BY, eviction_note
    from meshd.decisions.regret import RATE

    async with pair(eviction) as (a, b, ra, rb):
        for m in ("m", "x"):
            await ra.register(m, ModelInfo("demo", f"/{m}"), 1)
        await a.ensure("m", ra.get("m"))  # type: ignore[arg-type]
        for _ in range(4):
            a.cache.touch("m", a.clock())
        await asyncio.wait_for(rb.models.catch_up(), 5)
        stale = rb.get("m")  # m held by a, no history yet: what b's mirror shows before the eviction
        assert stale is not None and "a" in stale.instance_ids and not use_history(stale.extra)
        await a.ensure("x", ra.get("x"))  # type: ignore[arg-type]  # evicts m, m's last copy

        def written() -> bool:
            rec = ra.get("m")
            return rec is not None and not rec.instance_ids and len(use_history(rec.extra)) == 5

        await wait_until_async(written, 5, "m's history in its record, its copy gone")
        stored = ra.get("m")
        assert stored is not None
        history, note = use_history(stored.extra), eviction_note(stored.extra)
        entry = await b.ensure("m", stale)
        assert entry.uses_at[:5] == history and len(entry.uses_at) == 6
        if eviction is Eviction.ADAPTIVE:
            assert note is not None and note[0] == RATE
            assert b.cache.regret is not None and b.cache.regret.tally().charges[RATE] > 0.0

            def cleared() -> bool:
                rec = rb.get("m")
                return rec is not None and "b" in rec.instance_ids and EVICTED_BY not in rec.extra

            await wait_until_async(cleared, 5, "the note cleared by b's copy")
