"""Where a cache miss loads: ordering, fullness, near-best shortlist, labels, hot pods, spreading."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.decisions.placement.rank import (
    DEFAULT_MIN_CHURN_AGE_MS,
    LoadRequest,
    choose_load_target,
    drop_hot,
    full_threshold_units,
    hot_factor,
    is_full,
    min_churn_age_ms,
    placement_key,
    rank,
    shortlist,
)
from meshd.decisions.placement.view import ClusterView, InstanceView
from tests.decisions.placement.factories import CAP, NOW, UNITS, full, inst, view


def order(*instances: InstanceView) -> list[str]:
    return [i.instance_id for i in rank(instances, NOW, default_model_units=UNITS)]


def req(**kw: Any) -> LoadRequest:
    base: dict[str, Any] = {"model_id": "m", "model_type": "t", "size_units": UNITS}
    base.update(kw)
    return LoadRequest(**base)


def picks(v: ClusterView, r: LoadRequest, n: int = 200, seed: int = 1) -> Counter[str | None]:
    rng = random.Random(seed)
    return Counter(choose_load_target(v, r, rng) for _ in range(n))


# ---- fullness --------------------------------------------------------------------------------
def test_full_threshold_follows_upstream_formula() -> None:
    one_thread = inst("a", loading_threads=1)
    assert full_threshold_units(one_thread, UNITS) == 10  # max(10, min(10, 50))
    four = inst("a", loading_threads=4)
    assert full_threshold_units(four, UNITS) == 40  # max(10, min(40, 50))
    eight = inst("a", loading_threads=8)
    assert full_threshold_units(eight, UNITS) == 50  # capped at cap/20
    small = inst("a", capacity=100, loading_threads=8)
    assert full_threshold_units(small, UNITS) == 10  # never below one default model
    # Without explicit unloads and with several threads, upstream keeps two defaults free.
    two = inst("a", capacity=100, loading_threads=2)
    assert full_threshold_units(two, UNITS, explicit_unload=False) == 20
    assert full_threshold_units(two, UNITS, explicit_unload=True) == 10


def test_is_full_compares_free_with_threshold() -> None:
    assert not is_full(inst("a", used=CAP - 10), UNITS)
    assert is_full(inst("a", used=CAP - 9), UNITS)
    assert is_full(inst("a", used=CAP + 5), UNITS)  # over-committed


def test_min_churn_age_is_ten_assume_loaded_times() -> None:
    assert min_churn_age_ms(6_000) == 30_000  # max(3 s, 2 s) x 10
    assert min_churn_age_ms(180_000) == 600_000  # upstream's "10 mins default"
    assert DEFAULT_MIN_CHURN_AGE_MS == 300_000


# ---- ordering --------------------------------------------------------------------------------
def test_shutting_down_goes_last() -> None:
    assert order(inst("a", shutdown=True), full("b", 0)) == ["b", "a"]


def test_newer_version_first() -> None:
    old = inst("old", version=1)
    new = inst("new", version=2, count=5, used=500)
    assert order(old, new) == ["new", "old"]


def test_newer_version_full_with_old_lru_still_first() -> None:
    new = full("new", lru_age_ms=10 * DEFAULT_MIN_CHURN_AGE_MS, version=2)
    old = inst("old", version=1)
    assert order(old, new) == ["new", "old"]


def test_saturated_newer_version_loses_its_preference() -> None:
    new = full("new", lru_age_ms=1_000, version=2)  # full and churning
    old = inst("old", version=1)
    assert order(old, new) == ["old", "new"]
    # Two saturated instances compare by LRU, not version.
    new2 = full("new2", lru_age_ms=1_000, version=2)
    old2 = full("old2", lru_age_ms=5_000, version=1)
    assert order(new2, old2) == ["old2", "new2"]


def test_versions_further_behind_rank_lower() -> None:
    assert order(inst("v1", version=1), inst("v3", version=3), inst("v2", version=2)) == ["v3", "v2", "v1"]


def test_not_full_before_full() -> None:
    assert order(full("f", 10**9, count=0), inst("n", count=50, used=900)) == ["n", "f"]


def test_both_full_older_lru_first_before_count() -> None:
    young = full("young", 60_000, count=1)
    old = full("old", 3_600_000, count=40)
    assert order(young, old) == ["old", "young"]


def test_fewer_models_then_more_free() -> None:
    assert order(inst("many", count=3), inst("few", count=1, used=500)) == ["few", "many"]
    assert order(inst("less", count=2, used=600), inst("more", count=2, used=100)) == ["more", "less"]


def test_non_full_older_lru_breaks_ties_after_free() -> None:
    a = inst("a", count=2, used=100, lru_time=NOW - 10)
    b = inst("b", count=2, used=100, lru_time=NOW - 5000)
    assert order(a, b) == ["b", "a"]


def test_remaining_tie_breakers() -> None:
    idle = inst("idle", loading_threads=2, loading_in_progress=0)
    busy = inst("busy", loading_threads=2, loading_in_progress=1)
    assert order(busy, idle) == ["idle", "busy"]
    # Same idle threads: fewer loads in progress.
    a = inst("a", loading_threads=3, loading_in_progress=1)
    b = inst("b", loading_threads=2, loading_in_progress=0)
    assert order(a, b) == ["b", "a"]
    # Bigger capacity (same free), then lower rpm, then id.
    big = inst("big", capacity=2000, used=1000)
    small = inst("small", capacity=1000, used=0)
    assert order(small, big) == ["big", "small"]
    assert order(inst("hot", rpm=500), inst("cool", rpm=10)) == ["cool", "hot"]
    assert order(inst("z"), inst("a")) == ["a", "z"]


def test_placement_key_is_a_total_order_over_distinct_ids() -> None:
    a, b = inst("a"), inst("b")
    ka = placement_key(a, NOW, 0, default_model_units=UNITS)
    kb = placement_key(b, NOW, 0, default_model_units=UNITS)
    assert ka != kb and ka < kb


# ---- filters -----------------------------------------------------------------------------------
def test_no_instances_or_all_filtered_gives_none() -> None:
    rng = random.Random(0)
    assert choose_load_target(view(), req(), rng) is None
    v = view(
        inst("gone", shutdown=True),
        inst("tried"),
        inst("small", capacity=5),
        inst("unlabelled", labels={"x"}),
    )
    r = req(exclude=frozenset({"tried"}), required_labels=frozenset({"gpu"}))
    assert choose_load_target(v, r, rng) is None


def test_filters_leave_only_the_qualified_instance() -> None:
    v = view(
        inst("gone", shutdown=True, labels={"gpu"}),
        inst("tried", labels={"gpu"}),
        inst("small", capacity=5, labels={"gpu"}),
        inst("cpu", labels={"cpu"}),
        inst("ok", labels={"gpu", "big"}, count=30, used=900),
    )
    r = req(exclude=frozenset({"tried"}), required_labels=frozenset({"gpu"}))
    assert picks(v, r) == Counter({"ok": 200})


def test_capacity_must_fit_the_model_not_the_free_space() -> None:
    # A full instance can evict to make room; one smaller than the model never can.
    v = view(full("fullbig", 3_600_000, capacity=1000), inst("tiny", capacity=50))
    assert picks(v, req(size_units=100)) == Counter({"fullbig": 200})


# ---- near-best ---------------------------------------------------------------------------------
def test_clear_best_wins_every_time() -> None:
    v = view(inst("empty"), full("f1", 3_600_000), full("f2", 7_200_000))
    assert picks(v, req()) == Counter({"empty": 200})


def test_near_best_by_free_space_when_not_full() -> None:
    best = inst("best", count=1, used=200)  # free 800
    near = inst("near", count=2, used=700)  # free 300 >= 800/4
    far = inst("far", count=2, used=850)  # free 150 < 200
    names = [i.instance_id for i in shortlist(view(best, near, far), req())]
    assert names == ["best", "near"]


def test_near_best_count_rule() -> None:
    best = inst("best", count=12, used=100)
    ok = inst("ok", count=15, used=100)  # 15 <= 12 + 3
    crowded = inst("crowded", count=16, used=100)  # 16 > 15 and >= 10
    names = {i.instance_id for i in shortlist(view(best, ok, crowded), req())}
    assert names == {"best", "ok"}
    # Below 10 models, the count never disqualifies (upstream).
    names = {i.instance_id for i in shortlist(view(inst("e", count=0), inst("n", count=9), inst("x", count=10)), req())}
    assert names == {"e", "n"}


def test_full_instances_are_not_near_a_non_full_best() -> None:
    names = [i.instance_id for i in shortlist(view(inst("open"), full("f", 10**8)), req())]
    assert names == ["open"]


def test_near_best_by_lru_when_all_full() -> None:
    hour = 3_600_000
    best = full("best", hour)  # cache age 1 h: window max(45 s, 6 min)
    near = full("near", hour - 5 * 60_000)  # 5 min younger: within 10 % of the age
    far = full("far", hour - 7 * 60_000)  # 7 min younger: out
    names = [i.instance_id for i in shortlist(view(best, near, far), req())]
    assert names == ["best", "near"]
    # A young cache: the 45 s absolute window applies.
    best = full("best", 100_000)
    near = full("near", 60_000)  # 40 s younger
    far = full("far", 50_000)  # 50 s younger, > 10 s (10 % of age)
    names = [i.instance_id for i in shortlist(view(best, near, far), req())]
    assert names == ["best", "near"]


# ---- preferred labels ----------------------------------------------------------------------------
def test_best_preferred_makes_preference_required() -> None:
    v = view(inst("p1", labels={"fast"}), inst("p2", labels={"fast", "x"}), inst("n"))
    got = picks(v, req(preferred_labels=frozenset({"fast"})))
    assert set(got) == {"p1", "p2"}


def test_non_full_best_yields_to_best_open_preferred() -> None:
    best = inst("best")  # empty, unpreferred
    pref = inst("pref", labels={"fast"}, count=5, used=600)
    v = view(best, pref, inst("other", count=1))
    assert picks(v, req(preferred_labels=frozenset({"fast"}))) == Counter({"pref": 200})


def test_preference_ignored_when_no_preferred_instance_has_room() -> None:
    v = view(inst("best"), full("pref", 10**8, labels={"fast"}))
    assert picks(v, req(preferred_labels=frozenset({"fast"}))) == Counter({"best": 200})


def test_full_best_yields_to_preferred_within_window() -> None:
    hour = 3_600_000
    best = full("best", hour)
    pref = full("pref", hour - 10 * 60_000, labels={"fast"})  # within 25 % of 1 h
    v = view(best, pref)
    assert picks(v, req(preferred_labels=frozenset({"fast"}))) == Counter({"pref": 200})
    too_young = full("pref", 60_000, labels={"fast"})
    assert picks(view(best, too_young), req(preferred_labels=frozenset({"fast"}))) == Counter({"best": 200})


def test_no_preferred_instance_means_no_preference() -> None:
    v = view(inst("a"), inst("b"))
    assert set(picks(v, req(preferred_labels=frozenset({"fast"})))) == {"a", "b"}


# ---- prefer self ------------------------------------------------------------------------------------
def test_prefer_self_when_near_best() -> None:
    v = view(inst("me", count=1), inst("a"), inst("b"), self_id="me")
    assert picks(v, req(prefer_self=True)) == Counter({"me": 200})
    assert len(picks(v, req(prefer_self=False))) == 3


def test_prefer_self_ignored_when_not_near_best() -> None:
    v = view(full("me", 10**6), inst("a"), self_id="me")
    assert picks(v, req(prefer_self=True)) == Counter({"a": 200})


def test_prefer_self_ignored_when_excluded() -> None:
    v = view(inst("me"), inst("a"), self_id="me")
    assert picks(v, req(prefer_self=True, exclude=frozenset({"me"}))) == Counter({"a": 200})


# ---- hot instances -----------------------------------------------------------------------------------
def test_hot_factor_ladder() -> None:
    assert hot_factor(0, scale_up=True) == 1.1
    assert hot_factor(-20_000, scale_up=False) == 1.5
    assert hot_factor(4_999, scale_up=False) == 1.5
    assert hot_factor(5_000, scale_up=False) == 3.0
    assert hot_factor(12 * 60_000, scale_up=False) == 4.0
    assert hot_factor(24 * 3_600_000, scale_up=False) is None


def test_drop_hot_relative_to_least_loaded() -> None:
    cands = [inst("a", rpm=1000), inst("b", rpm=1400), inst("c", rpm=1600), inst("d", rpm=99)]
    # baseline max(100, 99) = 100; 1.5x -> anything >= 100 rpm and > 150 is hot
    assert [i.instance_id for i in drop_hot(cands, 1.5)] == ["d"]
    cands = [inst("a", rpm=1000), inst("b", rpm=1400), inst("c", rpm=1600)]
    assert [i.instance_id for i in drop_hot(cands, 1.5)] == ["a", "b"]
    assert [i.instance_id for i in drop_hot(cands, None)] == ["a", "b", "c"]


def test_quiet_instances_are_never_hot() -> None:
    cands = [inst("a", rpm=0), inst("b", rpm=99)]
    assert len(drop_hot(cands, 1.1)) == 2


def test_hot_instance_avoided_for_a_model_in_use() -> None:
    v = view(inst("calm", rpm=200), inst("hot", rpm=2000))
    assert picks(v, req()) == Counter({"calm": 200})  # used now: 1.5x
    # A model nobody has used for days may land anywhere near-best.
    old = req(last_used_ms=NOW - 3 * 24 * 3_600_000)
    assert set(picks(v, old)) == {"calm", "hot"}


def test_scale_up_avoids_even_mildly_busier_instances() -> None:
    v = view(inst("a", rpm=1000), inst("b", rpm=1200))
    assert set(picks(v, req(last_used_ms=NOW - 60_000))) == {"a", "b"}  # 3x
    assert picks(v, req(scale_up=True)) == Counter({"a": 200})  # 1.1x


# ---- randomness ------------------------------------------------------------------------------------
def test_thirty_cold_loads_spread_over_three_equal_instances() -> None:
    v = view(inst("a"), inst("b"), inst("c"), self_id="a")
    for seed in range(5):
        rng = random.Random(seed)
        counts = Counter(choose_load_target(v, req(model_id=f"m{n}"), rng) for n in range(30))
        assert set(counts) == {"a", "b", "c"}
        assert max(counts.values()) <= 15, (seed, counts)


def test_pick_is_uniform_over_the_shortlist() -> None:
    v = view(inst("a"), inst("b"), inst("c"))
    counts = picks(v, req(), n=3000, seed=7)
    assert all(900 <= c <= 1100 for c in counts.values()), counts


def test_same_seed_same_choices() -> None:
    v = view(inst("a"), inst("b"), inst("c"), inst("d"))
    first = [choose_load_target(v, req(), r) for r in [random.Random(42)] for _ in range(20)]
    again = [choose_load_target(v, req(), r) for r in [random.Random(42)] for _ in range(20)]
    assert first == again


def test_instance_order_in_the_view_does_not_matter() -> None:
    a, b, c = inst("a", count=1), inst("b"), inst("c", count=2)
    one = [choose_load_target(view(a, b, c), req(), random.Random(3)) for _ in range(5)]
    two = [choose_load_target(view(c, b, a), req(), random.Random(3)) for _ in range(5)]
    assert one == two


# ---- properties --------------------------------------------------------------------------------------
LABELS = st.frozensets(st.sampled_from(["gpu", "cpu", "fast", "big"]), max_size=3)
IDS = [f"i{n}" for n in range(6)]


@st.composite
def instances(draw: st.DrawFn, iid: str) -> InstanceView:
    capacity = draw(st.integers(0, 2000))
    return InstanceView(
        instance_id=iid,
        capacity=capacity,
        used=draw(st.integers(0, capacity + 50)),
        count=draw(st.integers(0, 40)),
        lru_time=draw(st.integers(NOW - 10 * 24 * 3_600_000, NOW)),
        loading_threads=draw(st.integers(1, 8)),
        loading_in_progress=draw(st.integers(0, 8)),
        rpm=draw(st.integers(0, 5000)),
        shutdown=draw(st.booleans()),
        version=draw(st.integers(0, 3)),
        labels=draw(LABELS),
    )


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[ClusterView, LoadRequest, int]:
    ids = draw(st.lists(st.sampled_from(IDS), unique=True, max_size=6))
    insts = [draw(instances(i)) for i in ids]
    r = LoadRequest(
        model_id="m",
        model_type="t",
        size_units=draw(st.integers(1, 1500)),
        exclude=draw(st.frozensets(st.sampled_from(IDS), max_size=4)),
        required_labels=draw(st.frozensets(st.sampled_from(["gpu", "cpu"]), max_size=1)),
        preferred_labels=draw(LABELS),
        prefer_self=draw(st.booleans()),
        default_model_units=draw(st.one_of(st.none(), st.integers(1, 100))),
        last_used_ms=draw(st.one_of(st.none(), st.integers(NOW - 10 * 24 * 3_600_000, NOW + 30_000))),
        scale_up=draw(st.booleans()),
    )
    self_id = draw(st.sampled_from(IDS))
    return view(*insts, self_id=self_id), r, draw(st.integers(0, 2**32))


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_never_chooses_an_unqualified_instance(s: tuple[ClusterView, LoadRequest, int]) -> None:
    v, r, seed = s
    chosen = choose_load_target(v, r, random.Random(seed))
    qualified = {
        i.instance_id
        for i in v.instances.values()
        if not i.shutdown
        and i.instance_id not in r.exclude
        and r.required_labels <= i.labels
        and i.capacity >= r.size_units
    }
    if chosen is None:
        assert not qualified
    else:
        assert chosen in qualified


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_choice_is_always_in_the_shortlist(s: tuple[ClusterView, LoadRequest, int]) -> None:
    v, r, seed = s
    near = {i.instance_id for i in shortlist(v, r)}
    chosen = choose_load_target(v, r, random.Random(seed))
    assert (chosen is None) == (not near)
    assert chosen is None or chosen in near


@pytest.mark.parametrize("size", [1, UNITS, CAP])
def test_default_units_fall_back_to_model_size(size: int) -> None:
    # With no default size given, "full" is judged against the model being placed.
    v = view(inst("a", used=CAP - size + 1), inst("b", used=0, count=3))
    r = req(size_units=size)
    near = [i.instance_id for i in shortlist(v, r)]
    assert near[0] == "b"


def test_runtime_default_size_sets_fullness() -> None:
    # 30 units free: roomy for a 10-unit model, full when the runtime's default model is 40 units.
    tight = inst("tight", used=CAP - 30)
    roomy = inst("roomy", used=CAP - 300, count=3)
    assert shortlist(view(tight, roomy), req())[0].instance_id == "tight"
    assert [i.instance_id for i in shortlist(view(tight, roomy), req(default_model_units=40))] == ["roomy"]


def test_recent_placements_spread_a_burst_from_several_deciders() -> None:
    """Three instances each place 10 cold loads from one stale picture: none gets > half."""
    from meshd.decisions.placement.view import ClusterView, InstanceView

    views = {i: InstanceView(i, f"h:{n}", capacity=4000, loading_threads=2) for n, i in enumerate("abc")}
    for seed in range(200):
        rng = random.Random(seed)
        totals = dict.fromkeys(views, 0)
        for decider in views:
            mine: dict[str, int] = {}
            for n in range(10):
                view = ClusterView(decider, 1_000, views)
                req = LoadRequest(model_id=f"m{n}", model_type="t", size_units=128, recent_placements=mine)
                target = choose_load_target(view, req, rng)
                assert target is not None
                mine[target] = mine.get(target, 0) + 1
                totals[target] += 1
        assert max(totals.values()) <= 15, (seed, totals)


def test_recent_placements_prefer_the_least_used_candidate() -> None:
    from meshd.decisions.placement.view import ClusterView, InstanceView

    views = {i: InstanceView(i, capacity=4000) for i in "abc"}
    req = LoadRequest(model_id="m", model_type="t", size_units=128, recent_placements={"a": 2, "b": 1})
    picks = {choose_load_target(ClusterView("a", 0, views), req, random.Random(s)) for s in range(50)}
    assert picks == {"c"}


def test_last_resort_load_needs_the_labels_and_no_shutdown() -> None:
    from meshd.decisions.placement.rank import may_load_as_last_resort
    from meshd.decisions.placement.view import ClusterView, InstanceView

    special = frozenset({"mt:special"})
    labelled = ClusterView("me", 0, {"me": InstanceView("me", labels=special)})
    assert may_load_as_last_resort(labelled, frozenset(), special)
    assert may_load_as_last_resort(labelled, frozenset(), frozenset())
    plain = ClusterView("me", 0, {"me": InstanceView("me")})
    assert not may_load_as_last_resort(plain, special, special)  # the published record wins
    stopping = ClusterView("me", 0, {"me": InstanceView("me", labels=special, shutdown=True)})
    assert not may_load_as_last_resort(stopping, special, frozenset())
    unpublished = ClusterView("me", 0, {})
    assert may_load_as_last_resort(unpublished, special, special)
    assert not may_load_as_last_resort(unpublished, frozenset(), special)


def test_loading_here_as_last_resort_is_once_per_request() -> None:
    from meshd.decisions.placement.rank import load_here_as_last_resort

    me = ClusterView("me", 0, {"me": InstanceView("me")})
    assert load_here_as_last_resort(me, set(), frozenset(), frozenset())
    assert not load_here_as_last_resort(me, {"me"}, frozenset(), frozenset())  # already tried here
    assert load_here_as_last_resort(me, {"other"}, frozenset(), frozenset())


@pytest.mark.parametrize(
    ("requested", "record", "now", "expected"),
    [
        (500, 400, 1000, 500),
        (None, 400, 1000, 400),
        (None, 0, 1000, 1000),
        (2000, 400, 1000, 1000),
        (0, 700, 1000, 700),
    ],
)
def test_a_background_load_is_dated_at_the_models_last_use(
    requested: int | None, record: int, now: int, expected: int
) -> None:
    from meshd.decisions.placement.rank import background_load_used_ms

    assert background_load_used_ms(requested, record, now) == expected


def test_an_adapter_loads_only_beside_a_usable_copy_of_its_base() -> None:
    from meshd.decisions.placement.rank import adapter_exclusions

    everyone = frozenset({"a", "b", "c"})
    assert adapter_exclusions(everyone, frozenset({"b"}), frozenset()) == {"a", "c"}
    # A holder excluded for this request (its load failed) is no holder: anywhere else, base first.
    assert adapter_exclusions(everyone, frozenset({"b"}), frozenset({"b"})) == {"b"}
    # No copy of the base yet, or only on instances gone: wherever placement says.
    assert adapter_exclusions(everyone, frozenset(), frozenset({"a"})) == {"a"}
    assert adapter_exclusions(everyone, frozenset({"z"}), frozenset()) == frozenset()
