"""Copy scaling's check (meshd.loops.scaler) around its pure rules: a language model's queue
that stays deep asks for one copy, and asks again only once the copies of that model still
loading are taken as loaded. The model's record, the cluster and the router are stand-ins (the
check only reads them and asks `place`); a real daemon adding a copy for a deep queue is
tests/integration/test_openai_direct.py."""

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
    assert check({"me": NOW - 600_000, "a": NOW - ASSUME_LOADED_MS - 1}) == [MODEL], "a's copy serves by now"


def test_no_more_copies_for_the_queue_while_one_still_loads() -> None:
    # a's copy began loading 10 s ago (the last check added it): calls do not go there yet, so
    # the queue here stays deep; asking again each check would add a copy every 10 s.
    assert check({"me": NOW - 600_000, "a": NOW - 10_000}) == []
    assert check({"me": NOW - 600_000, "a": NOW - 600_000, "b": NOW - ASSUME_LOADED_MS}) == []
