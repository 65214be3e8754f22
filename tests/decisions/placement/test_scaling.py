"""Copy scaling rules: second copy, load-driven copies, scale-down, min-copies floor."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.decisions.placement.scaling import (
    DEFAULT_POLICY,
    ModelPolicy,
    cache_age_ms,
    cluster_free_ratio,
    cluster_has_room,
    extra_copies_for_load,
    global_lru_ms,
    idle_before_drop_ms,
    missing_copies,
    should_drop_copy,
    want_second_copy,
)
from meshd.decisions.placement.view import ClusterView
from tests.decisions.placement.factories import NOW, UNITS, full, inst, view

MIN = 60_000
HOUR = 3_600_000


# ---- policy -----------------------------------------------------------------------------------
def test_policy_defaults_and_limits() -> None:
    assert DEFAULT_POLICY == ModelPolicy(1, 0, None, None)
    assert DEFAULT_POLICY.copy_limit(5) == 5
    assert ModelPolicy(max_copies=3).copy_limit(5) == 3
    assert ModelPolicy(max_copies=3).copy_limit(2) == 2
    assert ModelPolicy(declared_size_bytes=10, disk_size_bytes=5).size_hint_bytes == 10
    assert ModelPolicy(disk_size_bytes=5).size_hint_bytes == 5
    assert ModelPolicy().size_hint_bytes is None


@pytest.mark.parametrize(
    "kw",
    [
        {"min_copies": -1},
        {"max_copies": -2},
        {"min_copies": 3, "max_copies": 2},
        {"declared_size_bytes": 0},
        {"disk_size_bytes": -5},
    ],
)
def test_policy_rejects_nonsense(kw: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        ModelPolicy(**kw)


def test_min_above_unlimited_max_is_fine() -> None:
    assert ModelPolicy(min_copies=5, max_copies=0).min_copies == 5


# ---- cluster figures ------------------------------------------------------------------------------
def test_free_ratio_counts_serving_instances_only() -> None:
    v = view(inst("a", used=500), inst("b", used=1000), inst("c", used=0, shutdown=True))
    assert cluster_free_ratio(v) == pytest.approx(0.25)
    assert cluster_free_ratio(view()) == 0.0
    assert cluster_free_ratio(view(inst("over", used=1200), inst("b", used=0))) == pytest.approx(0.5)


def test_global_lru_and_cache_age() -> None:
    v = view(inst("a", lru_time=NOW - HOUR), inst("b", lru_time=NOW - MIN), inst("unset", lru_time=0))
    assert global_lru_ms(v) == NOW - HOUR
    assert cache_age_ms(v) == HOUR
    assert global_lru_ms(view()) == NOW
    assert cache_age_ms(view()) == 0


def test_cluster_room() -> None:
    assert cluster_has_room(view(inst("a", used=900)))  # exactly 10 % free
    assert not cluster_has_room(view(full("a", HOUR)))
    assert cluster_has_room(view(full("a", 21 * HOUR)))  # nothing used in 20 h would go


# ---- second copy ----------------------------------------------------------------------------------
def roomy() -> ClusterView:
    return view(inst("me", count=1, used=100), inst("b"), self_id="me")


def second(v: ClusterView, **kw: Any) -> bool:
    args: dict[str, Any] = {
        "copies": 1,
        "last_used_ms": NOW - 1_000,
        "prior_use_ms": NOW - 10 * MIN,
        "candidates": 1,
    }
    args.update(kw)
    return want_second_copy(v, **args)


def test_second_copy_for_regular_use() -> None:
    assert second(roomy())
    assert second(roomy(), prior_use_ms=NOW - 7 * MIN)
    assert second(roomy(), prior_use_ms=NOW - 40 * MIN)


@pytest.mark.parametrize(
    "kw",
    [
        {"prior_use_ms": NOW - 6 * MIN},  # a short burst
        {"prior_use_ms": NOW - 41 * MIN},  # a one-off long ago
        {"prior_use_ms": None},  # first use ever
        {"last_used_ms": NOW - 11_000},  # not used now
        {"copies": 2},  # already has two
        {"copies": 0},
        {"candidates": 0},  # nowhere to put it
        {"policy": ModelPolicy(max_copies=1)},
    ],
)
def test_no_second_copy(kw: dict[str, Any]) -> None:
    assert not second(roomy(), **kw)


def test_no_second_copy_in_a_full_busy_cluster() -> None:
    v = view(full("me", HOUR), full("b", HOUR), self_id="me")
    assert not second(v)
    v = view(full("me", 21 * HOUR), full("b", 22 * HOUR), self_id="me")
    assert second(v)


def test_no_second_copy_on_a_single_instance() -> None:
    assert not second(view(inst("me"), self_id="me"))


# ---- load-driven copies ----------------------------------------------------------------------------
def test_no_extra_copies_below_threshold() -> None:
    assert extra_copies_for_load(1999, 1, 2000, 5, 6) == 0
    assert extra_copies_for_load(5000, 0, 2000, 5, 6) == 0
    assert extra_copies_for_load(5000, 1, 0, 5, 6) == 0


def test_extra_copies_by_rate_candidates_step_and_policy() -> None:
    assert extra_copies_for_load(2000, 1, 2000, 5, 6) == 1
    assert extra_copies_for_load(4500, 1, 2000, 5, 6) == 2
    assert extra_copies_for_load(9000, 1, 2000, 1, 6) == 1  # one candidate
    assert extra_copies_for_load(20000, 1, 2000, 20, 30) == 10  # step max(2, 30/3)
    assert extra_copies_for_load(20000, 1, 2000, 8, 9) == 3  # step 9/3
    assert extra_copies_for_load(20000, 1, 2000, 3, 4) == 2  # step at least 2
    assert extra_copies_for_load(20000, 2, 2000, 8, 9, ModelPolicy(max_copies=3)) == 1
    assert extra_copies_for_load(20000, 3, 2000, 8, 9, ModelPolicy(max_copies=3)) == 0
    assert extra_copies_for_load(20000, 4, 2000, 8, 4) == 0  # one per instance already


@given(
    rpm=st.integers(0, 100_000),
    copies=st.integers(0, 20),
    threshold=st.integers(1, 5000),
    candidates=st.integers(0, 20),
    total=st.integers(0, 40),
    max_copies=st.integers(0, 10),
)
def test_extra_copies_bounds(
    rpm: int, copies: int, threshold: int, candidates: int, total: int, max_copies: int
) -> None:
    policy = ModelPolicy(max_copies=max_copies)
    n = extra_copies_for_load(rpm, copies, threshold, candidates, total, policy)
    assert 0 <= n <= candidates
    assert n <= max(2, total // 3)
    assert copies + n <= max(copies, policy.copy_limit(total))
    if rpm < threshold:
        assert n == 0


# ---- scale-down --------------------------------------------------------------------------------------
def crowded(me_lru_age: int = HOUR, other_lru_age: int = 2 * HOUR, **me: Any) -> ClusterView:
    """Two full instances; by default `me` has the younger LRU, so it is the worse placement."""
    return view(full("me", me_lru_age, **me), full("b", other_lru_age), self_id="me")


def drop(v: ClusterView, **kw: Any) -> bool:
    args: dict[str, Any] = {
        "copies": {"me": NOW - 3 * HOUR, "b": NOW - 3 * HOUR},
        "last_used_ms": NOW - 20 * HOUR,
        "default_model_units": UNITS,
    }
    args.update(kw)
    return should_drop_copy(v, **args)


def test_idle_threshold_is_min_of_ten_hours_and_a_tenth_of_cache_age() -> None:
    assert idle_before_drop_ms(crowded()) == 2 * HOUR // 10
    assert idle_before_drop_ms(crowded(other_lru_age=200 * HOUR)) == 10 * HOUR


def test_worse_placement_drops_an_idle_copy_in_a_full_cluster() -> None:
    assert drop(crowded())


def test_better_placement_keeps_its_copy() -> None:
    v = view(full("me", 2 * HOUR), full("b", HOUR), self_id="me")
    assert not drop(v)


def test_no_drop_while_the_cluster_has_room() -> None:
    v = view(inst("me", used=900, count=20, lru_time=NOW - HOUR), full("b", 2 * HOUR), self_id="me")
    assert cluster_free_ratio(v) > 0.05
    assert not drop(v)


def test_no_drop_of_a_model_in_use() -> None:
    assert not drop(crowded(), last_used_ms=NOW - 5 * MIN)  # idle threshold 12 min here
    assert drop(crowded(), last_used_ms=NOW - 5 * MIN, idle_ms=MIN)


def test_never_below_min_copies_nor_the_last_copy() -> None:
    assert not drop(crowded(), copies={"me": NOW})
    assert not drop(crowded(), policy=ModelPolicy(min_copies=2))
    assert not drop(crowded(), policy=ModelPolicy(min_copies=0), copies={"me": NOW})


def test_only_live_serving_holders_count() -> None:
    # The other holder is gone or leaving: this copy may be the only one soon.
    assert not drop(crowded(), copies={"me": NOW, "gone": NOW})
    v = view(full("me", HOUR), full("b", 2 * HOUR, shutdown=True), self_id="me")
    assert not drop(v)


def test_not_a_holder_or_shutting_down_never_drops() -> None:
    assert not drop(crowded(), copies={"b": NOW, "c": NOW})
    assert not drop(crowded(shutdown=True))
    assert not drop(view(full("b", HOUR), full("c", HOUR), self_id="me"), copies={"me": NOW, "b": NOW, "c": NOW})


def test_exactly_one_holder_is_the_worst() -> None:
    insts = [full("a", 3 * HOUR), full("b", 2 * HOUR), full("c", HOUR)]
    copies = {i.instance_id: NOW for i in insts}
    verdicts = {i.instance_id: drop(view(*insts, self_id=i.instance_id), copies=copies) for i in insts}
    assert verdicts == {"a": False, "b": False, "c": True}


# ---- min copies floor -----------------------------------------------------------------------------
def test_missing_copies() -> None:
    assert missing_copies(0, DEFAULT_POLICY, 5) == 0  # default: load on demand
    assert missing_copies(1, DEFAULT_POLICY, 5) == 0
    assert missing_copies(1, ModelPolicy(min_copies=3), 5) == 2
    assert missing_copies(0, ModelPolicy(min_copies=3), 5) == 3
    assert missing_copies(0, ModelPolicy(min_copies=3), 2) == 2  # one per instance at most
    assert missing_copies(4, ModelPolicy(min_copies=3), 5) == 0
    assert missing_copies(1, ModelPolicy(min_copies=3, max_copies=3), 2) == 1
    assert missing_copies(0, ModelPolicy(min_copies=0), 5) == 0


@given(copies=st.integers(0, 10), min_copies=st.integers(0, 10), live=st.integers(0, 10))
def test_missing_copies_never_exceeds_live_instances(copies: int, min_copies: int, live: int) -> None:
    n = missing_copies(copies, ModelPolicy(min_copies=min_copies), live)
    assert n >= 0
    assert n == 0 or copies + n <= live
    assert n == 0 or copies + n == min(min_copies, live)


def test_worst_holder_is_the_worst_placement() -> None:
    from meshd.decisions.placement.scaling import worst_holder
    from meshd.decisions.placement.view import ClusterView, InstanceView

    roomy = InstanceView("roomy", capacity=1000, used=100)
    cramped = InstanceView("cramped", capacity=1000, used=900, count=9)
    stopping = InstanceView("stopping", capacity=1000, used=0, shutdown=True)
    view = ClusterView("roomy", 0, {i.instance_id: i for i in (roomy, cramped, stopping)})
    assert worst_holder(view, [roomy, cramped], 16) == "cramped"
    assert worst_holder(view, [roomy, cramped, stopping], 16) == "stopping"
    assert worst_holder(view, [], 16) is None


def test_latency_mode_threshold_and_queue_pressure() -> None:
    from meshd.decisions.placement.scaling import QueueSample, latency_threshold_rpm, load_threshold_rpm, saturated

    # 2 at a time, 100 ms each: at most 1200 per minute; copies are added above 90 % of it.
    sample = QueueSample(max_concurrency=2, completed=50, service_ms=5000.0, queued=0, queue_ms=0.0)
    assert latency_threshold_rpm(sample, 90) == 1080
    assert load_threshold_rpm(2000, sample, 90) == 1080
    assert load_threshold_rpm(2000, None, 90) == 2000  # no limit: the configured threshold
    idle = QueueSample(2, 0, 0.0, 0, 0.0)
    assert latency_threshold_rpm(idle, 90) is None and load_threshold_rpm(2000, idle, 90) == 2000
    assert not saturated(sample)
    # Requests waited as long as they ran (100 ms on average): saturated.
    assert saturated(QueueSample(2, 50, 5000.0, 50, 5000.0))
    assert not saturated(QueueSample(2, 50, 5000.0, 5, 100.0))  # a few short waits


def test_queue_pressure_adds_a_copy_through_the_load_rule() -> None:
    from meshd.decisions.placement.scaling import QueueSample, extra_copies_for_load, load_threshold_rpm, saturated

    sample = QueueSample(1, 10, 10_000.0, 10, 20_000.0)  # 1 s each, 2 s waits
    threshold = load_threshold_rpm(2000, sample, 90)
    rpm = 30  # well under the configured 2000 rpm
    assert saturated(sample)
    assert extra_copies_for_load(max(rpm, threshold), 1, threshold, candidates=2, instances_total=3) == 1


def test_gated_rate_is_the_scalers_rate_and_threshold() -> None:
    from meshd.decisions.placement.scaling import QueueSample, gated_rate

    assert gated_rate(500, 2000, None, 90) == (500, 2000)  # no gate: as configured
    calm = QueueSample(2, 50, 5000.0, 0, 0.0)
    assert gated_rate(500, 2000, calm, 90) == (500, 1080)  # latency mode: 90 % of 1200 rpm
    queueing = QueueSample(1, 10, 10_000.0, 10, 20_000.0)  # waits twice as long as it runs
    assert gated_rate(30, 2000, queueing, 90) == (54, 54)  # at capacity whatever the rate


def test_queue_samples_subtract_and_survive_a_reload() -> None:
    from meshd.decisions.placement.scaling import QueueSample

    before = QueueSample(2, 10, 1000.0, 4, 400.0)
    now = QueueSample(2, 15, 1600.0, 5, 450.0)
    assert now.since(before) == QueueSample(2, 5, 600.0, 1, 50.0)
    assert now.since(None) is now
    reloaded = QueueSample(2, 3, 300.0, 0, 0.0)  # a new gate: its sums started again
    assert reloaded.since(before) is reloaded


def test_decide_copies_follows_the_rules_in_order() -> None:
    from meshd.decisions.placement.scaling import ModelPolicy, decide_copies

    def decide(holders: dict[str, int], policy: ModelPolicy, rpm: int) -> tuple[int, bool]:
        v = view(inst("me"), inst("b"), inst("c"))
        d = decide_copies(
            v,
            holders=holders,
            policy=policy,
            rpm=rpm,
            threshold_rpm=2000,
            last_used_ms=NOW,
            prior_use_ms=None,
            default_model_units=UNITS,
            recent_load_ms=0,
        )
        return d.add, d.drop

    assert decide({"me": NOW}, ModelPolicy(), 4000) == (2, False)  # busy: copies for load
    assert decide({"me": NOW}, ModelPolicy(min_copies=2), 0) == (1, False)  # below the floor
    assert decide({"me": NOW}, ModelPolicy(), 0) == (0, False)  # idle single copy: kept
    # Above max copies the worst holder drops: equal instances, so the greatest id ("me").
    assert decide({"me": NOW, "b": NOW}, ModelPolicy(max_copies=1), 0) == (0, True)


# ---- the recent-load hold (upstream ModelMesh.rateTrackingTask: loadedSince) ------------------
def test_the_recent_load_window_is_two_checks_and_twice_the_assumed_load_time() -> None:
    from meshd.decisions.placement.scaling import recent_load_window_ms

    # upstream: time since the last check (here the interval) + the interval + 2 x assume-loaded
    assert recent_load_window_ms(10_000, 3_000) == 26_000
    assert recent_load_window_ms(10_000, 40_000) == 100_000
    assert recent_load_window_ms(5_000, 0) == 10_000


def test_a_load_that_began_inside_the_window_is_recent_and_one_on_its_edge_is_not() -> None:
    from meshd.decisions.placement.scaling import loaded_recently

    window = 26_000
    assert loaded_recently({"me": NOW - HOUR, "b": NOW - window + 1}, "me", NOW, window)
    assert not loaded_recently({"me": NOW - HOUR, "b": NOW - window}, "me", NOW, window)  # upstream: start > cutoff
    assert loaded_recently({"me": NOW - HOUR, "b": NOW - HOUR, "c": NOW}, "me", NOW, window)  # any holder
    # This instance's own load does not count (its rate was measured on it), however recent.
    assert not loaded_recently({"me": NOW}, "me", NOW, window)
    assert not loaded_recently({"me": NOW - 1, "b": NOW - HOUR}, "me", NOW, window)
    assert not loaded_recently({}, "me", NOW, window)


def test_no_copies_for_load_while_another_copy_loaded_recently() -> None:
    from meshd.decisions.placement.scaling import decide_copies, recent_load_window_ms

    window = recent_load_window_ms(10_000, 3_000)

    def decide(holders: dict[str, int], policy: ModelPolicy = DEFAULT_POLICY, rpm: int = 6000) -> tuple[int, str]:
        v = view(inst("me"), inst("b"), inst("c"), inst("d"), inst("e"), inst("f"))
        d = decide_copies(
            v,
            holders=holders,
            policy=policy,
            rpm=rpm,
            threshold_rpm=2000,
            last_used_ms=NOW,
            prior_use_ms=None,
            default_model_units=UNITS,
            recent_load_ms=window,
        )
        return d.add, d.reason

    assert decide({"me": NOW - HOUR, "b": NOW - window}) == (2, "load")  # on the edge: no longer recent
    assert decide({"me": NOW - HOUR, "b": NOW - window + 1}) == (0, "")  # held
    assert decide({"me": NOW - 1, "b": NOW - HOUR}) == (2, "load")  # this instance's own recent load
    # The hold is on copies for load only: a policy's floor is still topped up.
    assert decide({"me": NOW - HOUR, "b": NOW - 1}, ModelPolicy(min_copies=4)) == (2, "min copies")


def test_copy_rpm_is_the_last_intervals_requests_per_minute() -> None:
    from meshd.decisions.placement.scaling import copy_rpm

    assert copy_rpm(150, 50, 10_000) == 600  # 100 requests in 10 s
    assert copy_rpm(50, 50, 10_000) == 0
    assert copy_rpm(7, 0, 60_000) == 7


@settings(max_examples=1000, deadline=None)
@given(
    n_instances=st.integers(0, 6),
    holder=st.sampled_from(["me", "i1", "gone"]),
    self_shutdown=st.booleans(),
    used=st.integers(0, 1000),
    lru_age=st.integers(0, 10**9),
    rpm=st.integers(0, 5000),
    threshold=st.integers(-10, 5000),
    idle_ms=st.integers(0, 10**8),
    prior_ago=st.one_of(st.none(), st.integers(0, 10**8)),
    min_copies=st.integers(0, 3),
    max_copies=st.integers(0, 3),
    recent_ms=st.integers(0, 10**6),
)
def test_the_shortcut_for_an_idle_single_copy_agrees_with_every_rule(
    n_instances: int,
    holder: str,
    self_shutdown: bool,
    used: int,
    lru_age: int,
    rpm: int,
    threshold: int,
    idle_ms: int,
    prior_ago: int | None,
    min_copies: int,
    max_copies: int,
    recent_ms: int,
) -> None:
    from meshd.decisions.placement import scaling

    if max_copies and min_copies > max_copies:
        min_copies = max_copies  # a policy refuses that combination
    me = inst("me", used=used, lru_time=NOW - lru_age, shutdown=self_shutdown)
    others = [inst(f"i{k}", used=used, lru_time=NOW - lru_age) for k in range(1, n_instances)]
    v = view(me, *others)
    args: dict[str, Any] = {
        "holders": {holder: NOW - 1},
        "policy": ModelPolicy(min_copies=min_copies, max_copies=max_copies),
        "rpm": rpm,
        "threshold_rpm": threshold,
        "last_used_ms": NOW - idle_ms,
        "prior_use_ms": None if prior_ago is None else NOW - prior_ago,
        "default_model_units": UNITS,
        "recent_load_ms": recent_ms,
    }
    with_shortcut = scaling.decide_copies(v, **args)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scaling, "idle_single_copy", lambda *_: False)  # every rule, one by one
        assert with_shortcut == scaling.decide_copies(v, **args)
