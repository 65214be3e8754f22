"""The operator listings' model summaries, decided from records and holders' reports."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, cast

from meshd.api.admin import instance_message
from meshd.core.records import REGISTERED_LU, InstanceRecord, ModelRecord
from meshd.decisions.cache import UNIT_BYTES, State, WeightedLRU
from meshd.decisions.status import ModelStatus
from meshd.loops.inventory import HeldCopy, Inventory, corrupt_summary, held_copies, instance_summaries, model_summary

NOW = 1_000_000_000
EXPIRY = 900_000
MIB = 1 << 20


def loaded(size: int = MIB, used: int = NOW - 10, since: int = NOW - 100) -> HeldCopy:
    return HeldCopy(State.LOADED, size, used, since)


def test_holders_are_believed_about_their_own_copies() -> None:
    record = ModelRecord("demo", "/p", instance_ids={"a": NOW - 500, "b": NOW - 400, "stale": NOW - 300}, last_used=5)
    reports = {
        "a": {"m": loaded()},
        "b": {"m": HeldCopy(State.LOADING, 2 * MIB, NOW - 50, NOW - 60)},
        "stale": {},  # answered without the model: the record entry is stale
        "new": {"m": HeldCopy(State.LOADING, MIB, NOW, NOW - 1)},  # loading before the record names it
    }
    s = model_summary("m", record, reports, {"a", "b", "stale", "new"}, NOW, EXPIRY)
    assert s.status is ModelStatus.LOADED
    assert [(c.instance_id, c.state, c.size_bytes) for c in s.copies] == [
        ("new", ModelStatus.LOADING, None),  # an estimate while loading is not a size
        ("b", ModelStatus.LOADING, None),
        ("a", ModelStatus.LOADED, MIB),
    ]
    assert s.size_bytes == MIB
    assert s.last_used_ms == NOW  # newest of the record's lu and the copies' uses
    assert (s.type, s.path, s.errors) == ("demo", "/p", ())


def test_a_model_not_used_since_its_registration_was_never_used() -> None:
    """Upstream dates a registration 6 h back (1 h with load-now): until a use is newer, the
    listing says 0 (never), not that made-up time (issue 45)."""
    made_up = NOW - 3_600_000
    record = ModelRecord("demo", instance_ids={"a": NOW - 50}, last_used=made_up, extra={REGISTERED_LU: made_up})
    s = model_summary("m", record, {"a": {"m": loaded(used=made_up)}}, {"a"}, NOW, EXPIRY)
    assert s.last_used_ms == 0
    s = model_summary("m", record, {"a": {"m": loaded(used=NOW - 10)}}, {"a"}, NOW, EXPIRY)
    assert s.last_used_ms == NOW - 10  # its copy served a request
    record.last_used = NOW - 5  # a use published to the record
    assert model_summary("m", record, {}, set(), NOW, EXPIRY).last_used_ms == NOW - 5
    given = ModelRecord("demo", last_used=made_up)  # a time of the registrant's own: shown as it is
    assert model_summary("m", given, {}, set(), NOW, EXPIRY).last_used_ms == made_up


def test_an_unreachable_live_holder_is_unknown_and_a_gone_one_is_left_out() -> None:
    record = ModelRecord("demo", instance_ids={"silent": NOW - 5, "gone": NOW - 6}, last_used=NOW - 9)
    s = model_summary("m", record, {"silent": None}, {"silent"}, NOW, EXPIRY)
    assert [(c.instance_id, c.state, c.size_bytes, c.since_ms) for c in s.copies] == [
        ("silent", ModelStatus.UNKNOWN, None, NOW - 5)
    ]
    assert (s.status, s.size_bytes, s.last_used_ms) == (ModelStatus.UNKNOWN, None, NOW - 9)


def test_failures_count_until_they_expire() -> None:
    record = ModelRecord(
        "demo",
        failed_in={"x": NOW - 1_000, "old": NOW - EXPIRY},
        fails={"x": {"msg": "boom"}},
    )
    reports = {"x": {"m": HeldCopy(State.FAILED, UNIT_BYTES, 0, NOW - 1_000)}}
    s = model_summary("m", record, reports, {"x"}, NOW, EXPIRY)
    assert [(c.instance_id, c.state, c.error) for c in s.copies] == [("x", ModelStatus.LOADING_FAILED, "boom")]
    assert (s.status, s.errors) == (ModelStatus.LOADING_FAILED, ("x: boom",))


def test_status_ranks_loaded_over_loading_over_unknown_over_failed() -> None:
    def status(reports: dict[str, dict[str, HeldCopy] | None], failed: bool = False) -> ModelStatus:
        record = ModelRecord("t", instance_ids={"u": 1}, failed_in={"f": NOW} if failed else {})
        return model_summary("m", record, reports, {"u", "f", "l"}, NOW, EXPIRY).status

    loading = HeldCopy(State.LOADING, 1, 0, 0)
    assert status({"u": {}}) is ModelStatus.NOT_LOADED
    assert status({"u": {}}, failed=True) is ModelStatus.LOADING_FAILED
    assert status({"u": None}, failed=True) is ModelStatus.UNKNOWN
    assert status({"u": None, "l": {"m": loading}}, failed=True) is ModelStatus.LOADING
    assert status({"u": None, "l": {"m": loaded()}}, failed=True) is ModelStatus.LOADED


def test_held_copies_reads_the_cache() -> None:
    cache = WeightedLRU(1000)
    cache.admit("a", 128, 7, 8)
    cache.set_state("a", State.LOADED, 9)
    cache.admit("b", 3, 1, 2)
    assert held_copies(cache) == {
        "a": HeldCopy(State.LOADED, MIB, 7, 9),
        "b": HeldCopy(State.LOADING, 3 * UNIT_BYTES, 1, 2),
    }
    assert set(held_copies(cache, ["b", "zz"])) == {"b"}


def test_corrupt_records_are_listed_with_the_reason() -> None:
    s = corrupt_summary("m", "not valid JSON")
    assert (s.status, s.errors, s.copies) == (ModelStatus.UNKNOWN, ("corrupt record: not valid JSON",), ())


def test_instance_summaries_are_sorted_and_mark_the_leader() -> None:
    out = instance_summaries([("b", InstanceRecord(capacity=2, used=1)), ("a", InstanceRecord())], "b")
    assert [(s.instance_id, s.leader) for s in out] == [("a", False), ("b", True)]
    assert (out[1].capacity_bytes, out[1].used_bytes) == (2 * UNIT_BYTES, UNIT_BYTES)


def test_listed_instances_tell_a_dead_runtime_from_a_drain() -> None:
    """`runtimeDown` rides beside upstream's `shutdown` in the record JSON and reaches admin
    listInstances; a plain drain has `shutdown` alone."""
    down = InstanceRecord.decode(b'{"shutdown": true, "runtimeDown": true, "loc": "h:1"}')
    draining = InstanceRecord.decode(b'{"shutdown": true}')
    assert down.runtime_down and not draining.runtime_down
    assert InstanceRecord.decode(down.encode()) == down
    a, b = (instance_message(s) for s in instance_summaries([("a", down), ("b", draining)], None))
    assert (a.shutdown, a.runtimeDown) == (True, True)
    assert (b.shutdown, b.runtimeDown) == (True, False)


async def test_concurrent_listings_share_one_round_of_peer_calls() -> None:
    rounds = 0

    class Counting(Inventory):
        async def _ask_all(
            self, instances: Mapping[str, object], model_ids: list[str]
        ) -> dict[str, dict[str, HeldCopy] | None]:
            nonlocal rounds
            rounds += 1
            await asyncio.sleep(0.05)
            return {"inst-b": None}

    inv = Counting(*(cast(Any, None) for _ in range(4)), failure_expiry_ms=0)
    answers = await asyncio.gather(*(inv._reports({}, []) for _ in range(3)), inv._reports({}, ["m1"]))
    assert rounds == 2  # the three alike shared one round; a different question asked again
    assert all(a == {"inst-b": None} for a in answers)
    await inv._reports({}, [])
    assert rounds == 3  # finished rounds are not reused: a later listing asks afresh
