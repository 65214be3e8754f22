"""The disk tier in placement (issue 42): the record's filter of the models on an instance's disk,
and a load placed where it is ready soonest, its pull skipped where the files already are."""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.core.records import DISK_TIER, InstanceRecord
from meshd.decisions.cache import WeightedLRU
from meshd.decisions.placement.disk import BITS_PER_MODEL, GIB, DiskSet, disk_reading, disk_value, pull_estimate_ms
from meshd.decisions.placement.loading import ready_soonest, soonest_start
from meshd.decisions.placement.rank import LoadRequest, choose_load_target
from meshd.decisions.placement.view import InstanceView
from meshd.decisions.publishing import Identity, instance_record
from tests.decisions.placement.factories import CAP, UNITS, inst, view


def on_disk(*model_ids: str, rate: float = 4096.0) -> DiskSet:
    got = disk_reading({DISK_TIER: disk_value((m, GIB, int(rate)) for m in model_ids)})
    assert got is not None
    return got


def soonest(**kw: Any) -> LoadRequest:
    base: dict[str, Any] = {"model_id": "m", "model_type": "t", "size_units": UNITS, "start_soonest": True}
    base.update(kw)
    return LoadRequest(**base)


def picks(v: Any, r: LoadRequest, n: int = 300) -> Counter[str | None]:
    rng = random.Random(7)
    return Counter(choose_load_target(v, r, rng) for _ in range(n))


# ---- the record's filter -------------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(st.sets(st.text(min_size=1, max_size=40), max_size=300))
def test_every_model_on_disk_reads_as_there_after_a_round_trip_through_the_record(ids: set[str]) -> None:
    record = InstanceRecord(capacity=10, extra={DISK_TIER: disk_value((m, 1 << 20, 100) for m in ids)})
    got = disk_reading(InstanceRecord.decode(record.encode()).extra)
    assert got is not None and got.count == len(ids)
    assert all(m in got for m in ids)


def test_models_not_on_disk_read_as_there_about_one_time_in_a_hundred() -> None:
    held = on_disk(*(f"model-{i}" for i in range(2000)))
    false = sum(f"other-{i}" in held for i in range(20_000))
    assert 0 < false < 20_000 * 0.015  # 10 bits and 7 hashes a model: 0.8 % expected


def test_an_empty_tier_holds_nothing_and_no_tier_reads_as_none() -> None:
    empty = on_disk()
    assert empty.count == 0 and "m" not in empty
    assert disk_reading({}) is None


def test_the_record_key_stays_small_with_thousands_of_models() -> None:
    ids = [f"predictor-{i:05d}__isvc-{i * 7919:010x}" for i in range(5000)]
    encoded = json.dumps(disk_value((m, 1 << 28, 900) for m in ids), separators=(",", ":"))
    # 10 bits a model, in base64: about 1.7 bytes each, where the ids alone are 32 bytes each.
    assert len(encoded) < 5000 * BITS_PER_MODEL / 8 * 4 / 3 + 100
    assert len(encoded) < sum(len(m) for m in ids) / 15


def test_a_malformed_value_reads_as_no_tier_and_other_keys_survive() -> None:
    for bad in (
        "x",
        {"models": 1, "hashes": 7, "bloom": "not base64!", "pullMsPerGiB": 1},
        {"models": -1, "hashes": 7, "bloom": "", "pullMsPerGiB": 1},
        {"models": 1, "hashes": 0, "bloom": "AAAA", "pullMsPerGiB": 1},
        {"models": 1, "hashes": 7, "bloom": "AAAA", "pullMsPerGiB": "fast"},
        {"models": True, "hashes": 7, "bloom": "AAAA", "pullMsPerGiB": 1},
    ):
        record = InstanceRecord.decode(json.dumps({"cap": 5, DISK_TIER: bad, "other": 1}).encode())
        assert disk_reading(record.extra) is None
        assert InstanceView.from_record("a", record).disk is None
        assert json.loads(record.encode())[DISK_TIER] == bad  # kept as it was, like any key meshd does not own


def test_the_pull_rate_counts_only_pulls_that_took_time() -> None:
    # A PVC model is a link: no pull. It must not make pulls look free.
    got = disk_reading({DISK_TIER: disk_value([("s3", GIB, 2000), ("pvc", 4 * GIB, 0)])})
    assert got is not None and got.pull_ms_per_gib == 2000
    assert disk_reading({DISK_TIER: disk_value([("pvc", GIB, 0)])}).pull_ms_per_gib == 0  # type: ignore[union-attr]


def test_a_pull_is_estimated_at_the_median_of_the_rates_the_fleet_measured() -> None:
    disks = [on_disk("a", rate=1000), on_disk("b", rate=3000), on_disk("c", rate=2000), None, on_disk(rate=0)]
    assert pull_estimate_ms(disks, GIB // 8192) == 2000
    assert pull_estimate_ms([None, on_disk(rate=0)], 100) is None


def test_the_instance_record_carries_the_disk_and_a_change_of_it_is_published() -> None:
    from meshd.decisions.publishing import publish_due

    me = Identity("a", "a:1", "", (), 1)
    cache = WeightedLRU(100)
    plain = instance_record(me, cache, 1, 0, 0, False, 10)
    assert DISK_TIER not in plain.extra
    value = disk_value([("m", 1, 1)])
    with_disk = instance_record(me, cache, 1, 0, 0, False, 10, disk=value)
    assert with_disk.extra[DISK_TIER] == value
    assert publish_due(plain, with_disk, 0, 5_000, forced=False)  # material: peers must see it


# ---- where a load is ready soonest ----------------------------------------------------------
def test_with_equal_queues_the_load_goes_where_its_files_are() -> None:
    cands = [inst("a"), inst("b", disk=on_disk("m")), inst("c")]
    assert [c.instance_id for c in ready_soonest(cands, "m", 500.0, 1000.0)] == ["b"]


def test_the_holder_wins_while_its_queue_costs_less_than_the_pull() -> None:
    # b queues one load beyond its thread: about 1 s at 1 s a load. A 1.5 s pull is worth the wait.
    b = inst("b", disk=on_disk("m"), loading_threads=1, loading_in_progress=1)
    cands = [inst("a", loading_threads=1), b]
    assert [c.instance_id for c in ready_soonest(cands, "m", 1500.0, 1000.0)] == ["b"]
    # A 0.5 s pull is not: the load goes where it starts at once and pulls.
    assert [c.instance_id for c in ready_soonest(cands, "m", 500.0, 1000.0)] == ["a"]
    # Two threads halve the wait.
    b2 = inst("b", disk=on_disk("m"), loading_threads=2, loading_in_progress=2)
    assert [c.instance_id for c in ready_soonest([inst("a", loading_threads=2), b2], "m", 500.0, 1000.0)] == ["b"]


def test_among_the_holders_the_soonest_to_start_and_among_the_others_too() -> None:
    cands = [
        inst("h1", disk=on_disk("m"), loading_threads=1, loading_in_progress=2),
        inst("h2", disk=on_disk("m"), loading_threads=1, loading_in_progress=1),
        inst("o1", loading_threads=1, loading_in_progress=1),
        inst("o2", loading_threads=1),
    ]
    assert [c.instance_id for c in ready_soonest(cands, "m", 5000.0, 1000.0)] == ["h2"]
    assert [c.instance_id for c in ready_soonest(cands, "m", 100.0, 1000.0)] == ["o2"]


def test_without_a_pull_estimate_or_holders_it_is_the_shortest_queue_as_before() -> None:
    cands = [inst("a", loading_in_progress=3), inst("b", disk=on_disk("m")), inst("c")]
    for pull in (None, 0.0):
        assert ready_soonest(cands, "m", pull, 1000.0) == soonest_start(cands)
    assert ready_soonest(cands, "other", 9000.0, 1000.0) == soonest_start(cands)
    every = [inst("a", disk=on_disk("m")), inst("b", disk=on_disk("m"), loading_in_progress=4)]
    assert ready_soonest(every, "m", 9000.0, 1000.0) == soonest_start(every)


def test_placement_sends_a_miss_to_the_instance_holding_its_files_and_ignores_them_unasked() -> None:
    v = view(*(inst(f"i{n}", disk=on_disk("m") if n == 3 else on_disk("x")) for n in range(6)))
    assert picks(v, soonest(pull_ms=800.0)) == Counter({"i3": 300})
    assert len(picks(v, soonest())) == 6  # no pull estimate: every instance, as before
    assert picks(v, soonest(pull_ms=800.0, model_id="y")).keys() <= {f"i{n}" for n in range(6)}


def test_an_excluded_or_shutting_down_holder_is_not_chosen() -> None:
    v = view(inst("a", disk=on_disk("m"), shutdown=True), inst("b", disk=on_disk("m")), inst("c"))
    assert picks(v, soonest(pull_ms=800.0, exclude=frozenset({"b"}))) == Counter({"c": 300})


def test_price_and_packing_act_among_the_holders() -> None:
    # Seven full instances, four of them holding the files: prices choose among those four.
    full = {"used": CAP - 1}
    holders = [inst(f"h{n}", disk=on_disk("m"), victim_value=float(n), **full) for n in range(4)]
    others = [inst(f"o{n}", victim_value=-5.0, **full) for n in range(3)]
    got = picks(view(*holders, *others), soonest(pull_ms=800.0))
    assert set(got) == {"h0", "h1", "h2"}  # the three cheapest holders; never the cheaper non-holders
    # A big model (a quarter of an instance or more) packs among the holders.
    big = CAP // 2
    tight = inst("tight", disk=on_disk("m"), used=CAP - big - 5)
    roomy = inst("roomy", disk=on_disk("m"))
    assert picks(view(tight, roomy, inst("o")), soonest(pull_ms=800.0, size_units=big)) == Counter({"tight": 300})


def test_mm_balanced_prefers_itself_only_where_the_load_is_ready_soonest() -> None:
    me_holds = view(inst("me", disk=on_disk("m")), inst("b"), self_id="me")
    assert picks(me_holds, soonest(pull_ms=800.0, prefer_self=True)) == Counter({"me": 300})
    other_holds = view(inst("me"), inst("b", disk=on_disk("m")), self_id="me")
    assert picks(other_holds, soonest(pull_ms=800.0, prefer_self=True)) == Counter({"b": 300})
