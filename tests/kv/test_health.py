"""kv.health: when the store counts as unresponsive, and caller-facing registry writes that
answer UNAVAILABLE at once then instead of waiting out the store's deadline (issue 15,
item 5: registerModel against a frozen etcd)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from meshd.core.errors import Unavailable
from meshd.core.records import ModelRecord, VModelRecord
from meshd.decisions.ids import ModelInfo
from meshd.kv.health import STALL_S, Responsiveness, for_client
from meshd.kv.memory import MemoryStore
from meshd.kv.store import Compare, KeyValue, Op, StoreUnavailable, TxnResult
from meshd.kv.table import Table
from meshd.registry.models import Registry

GUARD_S = 30.0  # only so that a regression fails instead of hanging; never a timing check


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_call_waiting_past_the_stall_with_no_answer_since_makes_the_store_unresponsive() -> None:
    clock = Clock()
    health = Responsiveness(clock)
    assert health.responsive()
    slow = health.sent()
    clock.now += STALL_S / 2
    assert health.responsive()  # not long enough yet
    clock.now += STALL_S
    assert not health.responsive()
    other = health.sent()
    health.answered(other)  # etcd answered something sent after it: slow, not frozen
    assert health.responsive()
    health.answered(slow)
    assert health.responsive()


def test_a_watch_response_counts_as_an_answer() -> None:
    clock = Clock()
    health = Responsiveness(clock)
    health.sent()
    clock.now += 2 * STALL_S
    assert not health.responsive()
    health.answered()
    assert health.responsive()


def test_an_unanswered_call_holds_the_verdict_until_the_next_answer() -> None:
    clock = Clock()
    health = Responsiveness(clock)
    health.unanswered(health.sent())
    assert not health.responsive()
    clock.now += 60
    assert not health.responsive()
    health.answered(health.sent())
    assert health.responsive()


def test_a_cancelled_call_says_nothing_unless_it_had_already_stalled() -> None:
    clock = Clock()
    health = Responsiveness(clock)
    health.dropped(health.sent())
    assert health.responsive()
    stalled = health.sent()
    clock.now += 2 * STALL_S
    health.dropped(stalled)
    assert not health.responsive()


class Flag:
    def __init__(self, responsive: bool) -> None:
        self.value = responsive

    def responsive(self) -> bool:
        return self.value


async def test_for_client_gives_up_on_an_unresponsive_store() -> None:
    never = asyncio.get_running_loop().create_future()
    async with asyncio.timeout(GUARD_S):
        with pytest.raises(StoreUnavailable, match="not answering"):
            await for_client(Flag(False), never, give_up_s=0.0)
    await asyncio.sleep(0)
    assert never.cancelled()


async def test_for_client_waits_for_a_responsive_store() -> None:
    async def slow() -> str:
        await asyncio.sleep(0.25)  # a few polls
        return "done"

    assert await for_client(Flag(True), slow(), give_up_s=0.0) == "done"


class FrozenStore(MemoryStore):
    """A store whose reads and writes never answer (etcd stopped with SIGSTOP), and whose
    own calls have seen it so (`responsive` False), as EtcdStore's would."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = False

    def responsive(self) -> bool:
        return not self.frozen

    async def get(self, key: str) -> KeyValue | None:
        if self.frozen:
            await asyncio.Event().wait()
        return await super().get(key)

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Op]) -> TxnResult:
        if self.frozen:
            await asyncio.Event().wait()
        return await super().txn(compares, ops)


@pytest.fixture
async def frozen() -> AsyncIterator[tuple[FrozenStore, Registry]]:
    store = FrozenStore()
    models = Table(store, "/t/registry/", ModelRecord.decode, ModelRecord.encode)
    vmodels = Table(store, "/t/vmodels/", VModelRecord.decode, VModelRecord.encode)
    await models.start()
    await vmodels.start()
    try:
        yield store, Registry(models, vmodels)
    finally:
        await models.stop()
        await vmodels.stop()
        await store.close()


async def test_register_model_against_a_frozen_store_answers_unavailable(
    frozen: tuple[FrozenStore, Registry],
) -> None:
    store, registry = frozen
    await registry.register("m0", ModelInfo("demo", "/m0", ""), 1)
    store.frozen = True
    async with asyncio.timeout(GUARD_S):
        with pytest.raises(Unavailable, match="model registry unavailable"):
            await registry.register("m1", ModelInfo("demo", "/m1", ""), 1)  # not in the mirror: a read
        with pytest.raises(Unavailable, match="model registry unavailable"):
            await registry.unregister("m0")  # in the mirror: straight to the write
    store.frozen = False
    assert (await registry.register("m1", ModelInfo("demo", "/m1", ""), 1)).path == "/m1"
