"""Copy scaling's check (meshd.loops.scaler) around its pure rules: a language model's queue
that stays deep asks for one copy, and asks again only once the copies of that model still
loading are taken as loaded; a busy copy asks for copies for load unless another copy's load
began within two checks and twice the model type's assume-loaded time (upstream's hold). The
model's record, the cluster and the router are stand-ins (the check only reads them and asks
`place`); a real daemon adding a copy for a deep queue is tests/integration/test_openai_direct.py,
copies for load tests/integration/test_mesh.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

from meshd.core.records import ModelRecord
from meshd.decisions.cache import CacheEntry, State
from meshd.decisions.placement.llm import DEEP_QUEUE, MIN_READINGS
from meshd.loops.scaler import Scaler, ScalerConfig
from tests.decisions.placement.factories import NOW, inst, view

MODEL = "chat"
ASSUME_LOADED_MS = 40_000
# ScalerConfig's interval (10 s) twice and the assume-loaded time twice (upstream's window)
RECENT_MS = 2 * 10_000 + 2 * ASSUME_LOADED_MS


def check(holders: dict[str, int]) -> list[str]:
    """One check by `me`, holding a loaded copy whose engine queue stayed deep since the last;
    the models `place` was asked for."""
    asked: list[str] = []

    async def place(model_id: str, exclude: frozenset[str] = frozenset(), last_used_ms: int | None = None) -> str:
        asked.append(model_id)
        return f"new-{len(asked)}"

    entry = CacheEntry(MODEL, units=10, last_used_ms=NOW, state=State.LOADED)
    cluster = SimpleNamespace(
        view=lambda: view(*(inst(i) for i in ("me", "a", "b", "c", "d"))),
        assume_loaded_ms=lambda model_type: ASSUME_LOADED_MS,
        default_units=10,
    )
    local = SimpleNamespace(cache=SimpleNamespace(entries=lambda: [entry]), shed=lambda model_id: True)
    registry = SimpleNamespace(get=lambda model_id: ModelRecord(type="llm", instance_ids=dict(holders)))
    router = SimpleNamespace(forwarder=SimpleNamespace(queue_depths={MODEL: (MIN_READINGS, DEEP_QUEUE)}), place=place)
    scaler = Scaler(ScalerConfig(), cast(Any, local), cast(Any, registry), cast(Any, cluster), cast(Any, router))
    asyncio.run(scaler.check())
    return asked


def test_a_deep_queue_asks_for_a_copy() -> None:
    assert check({"me": NOW - 600_000}) == [MODEL]
    assert check({"me": NOW - 600_000, "a": NOW - RECENT_MS}) == [MODEL], "a's copy serves by now"


def test_a_deep_queue_asks_for_no_copy_just_after_another_loaded() -> None:
    # a's copy is taken as loaded (calls go there), but it served for part of the last
    # interval at most: the queue here does not yet show what it takes off (upstream's hold).
    assert check({"me": NOW - 600_000, "a": NOW - ASSUME_LOADED_MS - 1}) == []
    assert check({"me": NOW - 600_000, "a": NOW - RECENT_MS + 1}) == []
    assert check({"me": NOW - 1, "a": NOW - 600_000}) == [MODEL], "this instance's own load does not hold it"


def busy_check(holders: dict[str, int], model_type: str) -> list[str]:
    """Two checks by `me`, holding a loaded copy of a model (no engine queue) that served
    1,000 requests between them (6,000 a minute, three times the threshold, with four
    instances free to take copies); the instances `place` chose for the second check."""
    placed: list[str] = []

    async def place(model_id: str, exclude: frozenset[str] = frozenset(), last_used_ms: int | None = None) -> str:
        placed.append(f"new-{len(placed)}")
        return placed[-1]

    entry = CacheEntry(MODEL, units=10, last_used_ms=NOW, state=State.LOADED)
    cluster = SimpleNamespace(
        view=lambda: view(*(inst(i) for i in ("me", "a", "b", "c", "d", "e"))),
        assume_loaded_ms=lambda t: {"slow": ASSUME_LOADED_MS}.get(t, 3_000),  # learnt per type
        default_units=10,
    )
    local = SimpleNamespace(cache=SimpleNamespace(entries=lambda: [entry]), shed=lambda model_id: True)
    registry = SimpleNamespace(get=lambda model_id: ModelRecord(type=model_type, instance_ids=dict(holders)))
    router = SimpleNamespace(forwarder=SimpleNamespace(queue_depths={}), place=place)
    scaler = Scaler(ScalerConfig(), cast(Any, local), cast(Any, registry), cast(Any, cluster), cast(Any, router))
    asyncio.run(scaler.check())
    assert placed == [], "no rate yet at the first check"
    entry.served += 1000
    asyncio.run(scaler.check())
    return placed


def test_a_busy_copy_asks_for_copies_unless_another_loaded_recently() -> None:
    two = ["new-0", "new-1"]  # min(6000 / 2000, 5 free) = 3, at most max(2, 6 / 3) = 2 at once
    assert busy_check({"me": NOW - 600_000}, "slow") == two
    assert busy_check({"me": NOW - 600_000, "a": NOW - RECENT_MS}, "slow") == two
    assert busy_check({"me": NOW - 600_000, "a": NOW - RECENT_MS + 1}, "slow") == []
    assert busy_check({"me": NOW - 1, "a": NOW - 600_000}, "slow") == two  # its own load: not held
    # The window follows the model type's learnt load time: 2 x 10 s + 2 x 3 s for "fast".
    assert busy_check({"me": NOW - 600_000, "a": NOW - 26_000}, "fast") == two
    assert busy_check({"me": NOW - 600_000, "a": NOW - 26_000 + 1}, "fast") == []


def test_no_more_copies_for_the_queue_while_one_still_loads() -> None:
    # a's copy began loading 10 s ago (the last check added it): calls do not go there yet, so
    # the queue here stays deep; asking again each check would add a copy every 10 s.
    assert check({"me": NOW - 600_000, "a": NOW - 10_000}) == []
    assert check({"me": NOW - 600_000, "a": NOW - 600_000, "b": NOW - ASSUME_LOADED_MS}) == []
