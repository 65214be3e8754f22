"""The load queue's rules (issue 24): value order, the wait limit, admission under pressure,
placement by queue length, the refusal's message."""

from __future__ import annotations

import random

import pytest

from meshd.decisions.placement import loading
from meshd.decisions.placement.loading import (
    accepts,
    admission_date,
    colder_than_victims,
    displaced_by,
    exhausted_message,
    least_valuable,
    load_value,
    next_load,
    queue_backlog,
    retry_after_s,
    soonest_start,
    start_wait_ms,
    under_pressure,
    update_mean_load_ms,
)
from meshd.decisions.placement.rank import LoadRequest, choose_load_target
from meshd.decisions.placement.view import ClusterView, InstanceView
from tests.decisions.placement.factories import CAP, full, inst, view


def test_value_grows_with_waiting_requests_and_popularity_and_shrinks_with_size() -> None:
    assert load_value(3, 0.0, 10) > load_value(1, 0.0, 10)
    assert load_value(1, 5.0, 10) > load_value(1, 0.0, 10)
    assert load_value(1, 5.0, 10) > load_value(1, 5.0, 20)
    assert load_value(0, 0.0, 0) == 0.0  # a size of 0 counts as one unit


def test_the_most_valuable_load_starts_next_not_the_first_queued() -> None:
    assert next_load([(1.0, 100, 7), (5.0, 300, 8), (2.0, 200, 9)], 400) == 8
    assert next_load([(2.0, 300, 7), (2.0, 100, 8)], 400) == 8  # equal value: the earlier queued
    assert next_load([], 400) is None


def test_no_load_is_overtaken_for_longer_than_the_limit() -> None:
    waiting = [(1.0, 100, 7), (5.0, 2_000, 8), (1.5, 500, 9)]
    assert next_load(waiting, 2_100, overtake_limit_ms=2_000) == 8  # nobody waited past it yet
    assert next_load(waiting, 2_101, overtake_limit_ms=2_000) == 7  # the cold one's turn
    assert next_load(waiting, 9_000, overtake_limit_ms=2_000) == 7  # the longest waiting first


def test_a_full_queue_gives_up_its_least_valuable_latest_load() -> None:
    assert least_valuable([(1.0, 100, 7), (5.0, 300, 8), (1.0, 200, 9)], 300) == 9
    assert least_valuable([], 300) is None


def test_only_a_load_queued_within_the_displacement_window_gives_way() -> None:
    """One that waited longer keeps its place: refused now, its requests would fail slowly."""
    waiting = [(1.0, 100, 7), (5.0, 300, 8), (3.0, 250, 9)]
    assert least_valuable(waiting, 300, within_ms=100) == 9  # 7 waited 200 ms: it stays
    assert least_valuable(waiting, 400, within_ms=100) == 8  # only 8 is young enough
    assert least_valuable(waiting, 401, within_ms=100) is None  # none: the newcomer is refused
    assert least_valuable(waiting, 350) == 7  # the default window is 250 ms


def test_a_newcomer_displaces_only_a_young_load_worth_less_than_itself() -> None:
    waiting = [(1.0, 100, 7), (5.0, 300, 8)]
    assert displaced_by(2.0, waiting, 300) == 7  # 7 is the least valuable and young enough
    assert displaced_by(1.0, waiting, 300) is None  # worth no more than 7: the newcomer is refused
    assert displaced_by(9.0, waiting, 400) == 8  # 7 waited 300 ms: only 8 may give way
    assert displaced_by(9.0, waiting, 600) is None  # none young enough
    assert displaced_by(9.0, [], 0) is None


def test_start_wait_counts_loads_ahead_over_the_threads() -> None:
    assert start_wait_ms(0, 1, 2, 1000.0) == 0.0  # a thread is free
    assert start_wait_ms(0, 2, 2, 1000.0) == 500.0  # both busy: half a load on average
    assert start_wait_ms(3, 2, 2, 1000.0) == 2000.0
    assert start_wait_ms(0, 1, 0, 1000.0) == 1000.0  # no threads counts as one


def test_a_load_joins_only_if_it_should_start_within_half_the_limit() -> None:
    assert accepts(5_000.0, 10_000)
    assert not accepts(5_001.0, 10_000)


def test_pressure_is_a_queue_the_threads_cannot_clear_within_a_share_of_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The default share (0.25): loads the threads cannot clear within 2.5 s.
    assert not under_pressure(5, 2, 1000.0, 10_000)
    assert under_pressure(6, 2, 1000.0, 10_000)
    assert not under_pressure(0, 2, 1000.0, 10_000)
    monkeypatch.setattr(loading, "PRESSURE_SHARE_OF_LIMIT", 1.0)  # the wording
    assert not under_pressure(20, 2, 1000.0, 10_000)  # 10 s of loads: exactly clearable
    assert under_pressure(21, 2, 1000.0, 10_000)


def test_a_model_colder_than_its_victims_together_does_not_evict_them() -> None:
    assert colder_than_victims(2.0, 1, [2.0, 1.0])
    assert not colder_than_victims(3.0, 1, [2.0, 1.0])
    assert not colder_than_victims(0.0, 1, [])  # nothing to evict: nothing to protect


def test_the_mean_load_time_follows_finished_loads() -> None:
    mean = 1000.0
    for _ in range(100):
        mean = update_mean_load_ms(mean, 3000.0)
    assert 2990.0 < mean <= 3000.0


def test_the_assumed_mean_load_time_gives_way_to_the_first_finished_load() -> None:
    """Plain mean of the loads so far (the assumed 1 s counts for nothing), then a moving one."""
    mean = loading.DEFAULT_MEAN_LOAD_MS
    mean = update_mean_load_ms(mean, 120.0, 0)
    assert mean == 120.0
    mean = update_mean_load_ms(mean, 180.0, 1)
    assert mean == pytest.approx(150.0)
    for n in range(2, 10):
        mean = update_mean_load_ms(mean, 150.0, n)
    assert mean == pytest.approx(150.0)
    assert update_mean_load_ms(150.0, 1150.0, 50) == pytest.approx(250.0)  # weight 0.1 from the 10th on


def test_placement_keeps_the_near_best_instances_with_the_shortest_queue() -> None:
    a = inst("a", loading_threads=2, loading_in_progress=5)
    b = inst("b", loading_threads=2, loading_in_progress=1)
    c = inst("c", loading_threads=2, loading_in_progress=0)
    assert [queue_backlog(i) for i in (a, b, c)] == [4, 0, 0]
    assert {i.instance_id for i in soonest_start([a, b, c])} == {"b", "c"}
    req = LoadRequest("m", "", 10, start_soonest=True)
    picks = {choose_load_target(view(a, b, c), req, random.Random(s)) for s in range(40)}
    assert picks == {"b", "c"}
    upstream = LoadRequest("m", "", 10)
    assert "a" in {choose_load_target(view(a, b, c), upstream, random.Random(s)) for s in range(40)}


def _picks(req: LoadRequest, *instances: InstanceView) -> set[str | None]:
    """Every instance the pick lands on over 60 seeds (the caller is "me")."""
    return _picks_in(view(*instances), req)


def _picks_in(v: ClusterView, req: LoadRequest) -> set[str | None]:
    return {choose_load_target(v, req, random.Random(s)) for s in range(60)}


MESHD = LoadRequest("m", "", 10, start_soonest=True)
UPSTREAM = LoadRequest("m", "", 10)


def test_meshd_places_beyond_the_near_best_window_where_a_load_starts_at_once() -> None:
    """Cache ages far apart (GDSF's next victims) no longer narrow the pick to the oldest:
    the oldest is busy loading, so the load goes to one that can start it now."""
    oldest = full("old", lru_age_ms=3_600_000, loading_threads=2, loading_in_progress=3)
    young = [full(f"y{n}", lru_age_ms=60_000, loading_threads=2) for n in range(3)]
    assert _picks(UPSTREAM, oldest, *young) == {"old"}  # upstream: the near-best window
    assert _picks(MESHD, oldest, *young) == {"y0", "y1", "y2"}


def test_meshd_spreads_over_every_instance_not_only_one_a_little_under_full() -> None:
    """Most instances sit just under "full" between evictions; preferring them would pile
    every load on them until their records caught up."""
    nearly = full("nearly", lru_age_ms=60_000, used=CAP - 80)  # under the 50-unit threshold: not full
    others = [full(f"f{n}", lru_age_ms=60_000) for n in range(3)]
    assert _picks(UPSTREAM, nearly, *others) == {"nearly"}
    assert _picks(MESHD, nearly, *others) == {"nearly", "f0", "f1", "f2"}


def test_meshd_sends_loads_to_an_instance_with_plenty_of_room_first() -> None:
    """A new, empty instance takes the loads (they evict nothing there)."""
    fresh = inst("fresh", count=0)
    others = [full(f"f{n}", lru_age_ms=60_000) for n in range(3)]
    assert _picks(MESHD, fresh, *others) == {"fresh"}


def test_meshd_packs_a_big_model_where_it_leaves_the_least_room_unused() -> None:
    """Issue 33: a model of a third of an instance goes where it fits with the least room
    left over (the bigger hole stays whole for the next big model); where it fits nowhere,
    where the least must be evicted. A small model still goes to any roomy instance."""
    big = LoadRequest("m", "", 330, start_soonest=True)
    snug = inst("snug", used=CAP - 350)  # leaves 20
    roomy = inst("roomy", used=CAP - 700)  # leaves 370: room for another big model
    tight = inst("tight", used=CAP - 100)  # it does not fit
    assert _picks(big, snug, roomy, tight) == {"snug"}
    # It fits nowhere: the most free room (the least to evict), within a quarter of its size.
    assert _picks(big, inst("a", used=CAP - 200), inst("b", used=CAP - 250), tight) == {"a", "b"}
    assert _picks(big, tight, inst("fuller", used=CAP - 10)) == {"tight"}
    small = LoadRequest("m", "", 10, start_soonest=True)
    assert _picks(small, snug, roomy, tight) == {"snug", "roomy"}  # a quarter free or more
    # mm-balanced (prefer itself): the client spread its requests; it loads where it asked.
    balanced = LoadRequest("m", "", 330, start_soonest=True, prefer_self=True)
    assert _picks(balanced, inst("me"), snug) == {"me"}


def test_meshd_prefers_itself_only_among_the_soonest_to_start() -> None:
    me_busy = full("me", lru_age_ms=60_000, loading_threads=1, loading_in_progress=2)
    other = full("b", lru_age_ms=60_000, loading_threads=1)
    balanced = LoadRequest("m", "", 10, start_soonest=True, prefer_self=True)
    assert _picks(balanced, me_busy, other) == {"b"}
    me_free = full("me", lru_age_ms=60_000, loading_threads=1)
    assert _picks(balanced, me_free, other) == {"me"}


def test_meshd_loads_onto_an_idle_thread_even_on_the_instance_serving_the_most() -> None:
    """The queue comes before the hot filter (issue 36): the busiest server with an idle
    loading thread takes the load rather than another whose one thread has a queue; with
    equal queues the hot one is still avoided."""
    hot = full("hot", lru_age_ms=60_000, loading_threads=1, rpm=3_000)
    queued = full("q", lru_age_ms=60_000, loading_threads=1, loading_in_progress=3, rpm=400)
    assert _picks(MESHD, hot, queued) == {"hot"}
    cool = full("cool", lru_age_ms=60_000, loading_threads=1, rpm=400)
    assert _picks(MESHD, hot, cool) == {"cool"}
    assert _picks(UPSTREAM, hot, cool) == {"cool"}


def test_placement_reads_queues_as_they_are_now_not_as_recorded() -> None:
    """A record may say an idle thread 2 s after loads queued there (or the reverse): the
    deciding instance knows its own queue, and peers' answers carry theirs (`meshd-loads`)."""
    me = full("me", lru_age_ms=60_000, loading_threads=1)
    other = full("b", lru_age_ms=60_000, loading_threads=1, loading_in_progress=1)
    balanced = LoadRequest("m", "", 10, start_soonest=True, prefer_self=True)
    as_recorded = view(me, other)
    assert choose_load_target(as_recorded, balanced, random.Random(0)) == "me"
    live = as_recorded.with_loads({"me": 3})
    assert live.instances["me"].loading_in_progress == 3 and live.instances["b"] is other
    assert _picks_in(live, balanced) == {"b"}
    assert as_recorded.with_loads({"me": 0, "b": 1}) is as_recorded  # nothing to change: the same view
    assert view(other).with_loads({"me": 3}).instances == view(other).instances  # "me" has no record yet
    # A peer's answer said its queue emptied since its record: it is where a load starts now.
    answered = as_recorded.with_loads({"me": 2, "b": 0})
    assert _picks_in(answered, balanced) == {"b"}


def test_meshd_loads_onto_the_newest_version_during_a_rolling_update() -> None:
    """Upstream's PLACEMENT_ORDER prefers the newer version unless it is saturated; meshd's
    placement (every candidate, the shortest queue) keeps that rule."""
    old = [full(f"old{n}", lru_age_ms=3_600_000, version=1) for n in range(3)]
    new = full("new", lru_age_ms=3_600_000, version=2, loading_threads=2, loading_in_progress=1)
    assert _picks(MESHD, *old, new) == {"new"}  # even with a load under way there
    saturated = full("new", lru_age_ms=1_000, version=2)  # full, its next victim used a second ago
    assert _picks(MESHD, *old, saturated) == {"old0", "old1", "old2", "new"}


def test_meshd_keeps_to_instances_with_a_preferred_label() -> None:
    labelled = full("gpu", lru_age_ms=60_000, labels={"gpu"})
    plain = [full(f"p{n}", lru_age_ms=3_600_000) for n in range(3)]
    req = LoadRequest("m", "", 10, start_soonest=True, preferred_labels=frozenset({"gpu"}))
    assert _picks(req, labelled, *plain) == {"gpu"}


def test_the_refusal_says_why_and_when_to_retry() -> None:
    msg = exhausted_message("m1", "12 loads are waiting", 4_200.0)
    assert "'m1'" in msg and "12 loads are waiting" in msg and "retry after 5 s" in msg
    assert retry_after_s(0.0) == 1


def test_a_load_requests_asked_for_is_admitted_as_used_when_it_starts() -> None:
    assert admission_date(9_995, 10_000, 12_000) == 12_000  # a request's clock, read just before
    assert admission_date(9_000, 10_000, 12_000) == 12_000  # a peer's, a hop earlier
    assert admission_date(5_000, 10_000, 12_000) == 5_000  # a background load keeps its date


def test_a_load_must_end_within_its_requests_deadline_only_when_it_would_wait() -> None:
    assert loading.within_deadline(0.0, 5_000, 100)  # starts at once: always (the copy serves the next)
    assert loading.within_deadline(1_000, 1_000, None)  # no deadline
    # One 10 s load under way (counted as just started: a 10 s wait); it may be nearly done,
    # so a request with 15 s left may queue, one with 9 s may not.
    assert loading.within_deadline(10_000, 10_000, 15_000)
    assert not loading.within_deadline(10_000, 10_000, 9_000)
    # Three rounds of loads ahead: 30 s at the soonest less one load, past a 15 s deadline.
    assert loading.soonest_end_ms(30_000, 10_000) == 30_000
    assert not loading.within_deadline(30_000, 10_000, 15_000)
    # A fraction of a round ahead (more threads than loads), then the load itself.
    assert loading.soonest_end_ms(500, 2_000) == 2_000
    assert not loading.within_deadline(1, 0, 0)  # a deadline already passed


def test_the_wait_limit_stretches_to_a_few_slow_loads() -> None:
    assert loading.wait_limit(10_000, 117.0) == 10_000  # fast loads: the limit as configured
    assert loading.wait_limit(10_000, 25_000.0) == loading.LIMIT_IN_LOADS * 25_000.0
    # Behind one 25 s load (a 25 s wait), a 10 s limit would refuse every miss; stretched, it queues.
    assert not loading.accepts(25_000, 10_000)
    assert loading.may_queue(25_000, 25_000.0, 10_000, None)
    assert not loading.may_queue(50_000, 25_000.0, 10_000, None)  # two loads ahead: past half of 75 s


def test_a_request_that_will_wait_longer_than_the_limit_may_queue_while_its_load_can_end_in_time() -> None:
    # A 20 s wait, 1 s loads: past half the 10 s limit, so refused without a deadline ...
    assert not loading.may_queue(20_000, 1_000.0, 10_000, None)
    assert not loading.may_queue(20_000, 1_000.0, 10_000, 8_000)  # ... or with a shorter one
    # ... but a client that allows a minute waits, and one that allows 15 s cannot be served.
    assert loading.may_queue(20_000, 1_000.0, 10_000, 60_000)
    assert not loading.may_queue(20_000, 1_000.0, 10_000, 15_000)
    assert loading.patience_ms(10_000, 1_000.0, None) == 10_000
    assert loading.patience_ms(10_000, 1_000.0, 5_000) == 10_000  # a short deadline does not shorten it
    assert loading.patience_ms(10_000, 1_000.0, 60_000) == 60_000
    assert loading.patience_ms(10_000, 30_000.0, 60_000) == 90_000  # slow loads: the stretched limit


def test_a_miss_meets_its_deadline_first_then_the_limit_and_pressure_is_judged_by_its_patience() -> None:
    late, full, join = loading.Verdict.LATE, loading.Verdict.FULL, loading.Verdict.JOIN
    # A 20 s wait behind 1 s loads, a 10 s limit:
    assert loading.queue_verdict(20_000, 1_000.0, 10_000, None) is full  # no deadline: the limit
    assert loading.queue_verdict(20_000, 1_000.0, 10_000, 15_000) is late  # cannot end in time
    assert loading.queue_verdict(20_000, 1_000.0, 10_000, 60_000) is join  # a minute: it waits
    assert loading.queue_verdict(0.0, 1_000.0, 10_000, 1) is join  # starts at once: never late
    # Eight 1 s loads waiting on one thread: pressure for a hurried miss, not for a patient one.
    assert loading.pressed(8, 1, 1_000.0, 10_000, None)
    assert not loading.pressed(8, 1, 1_000.0, 10_000, 60_000)


def test_peers_reported_loads_count_only_while_fresh() -> None:
    reported = {"b": (3, 9_000), "c": (0, 9_900), "d": (5, 10_000)}
    assert loading.fresh_loads(reported, 10_000) == {"b": 3, "c": 0, "d": 5}  # 1 s: all three
    assert loading.fresh_loads(reported, 10_001) == {"c": 0, "d": 5}  # b's is older than 1 s
    assert loading.fresh_loads(reported, 10_500, within_ms=100) == {}
