"""Which copy serves: local first, then the least busy probably-loaded copy, else the oldest load."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.decisions.placement.serving import AssumeLoaded, LoadTimes, assume_loaded_ms, choose_copy
from meshd.decisions.placement.view import ClusterView
from tests.decisions.placement.factories import NOW, inst, view

WAIT = 30_000  # assume loaded after 30 s
LOADED = NOW - 60_000  # load started a minute ago: probably loaded
LOADING = NOW - 1_000  # started a second ago: probably still loading


def cluster(*ids: str, **lru: int) -> ClusterView:
    return view(*(inst(i, lru_time=lru.get(i, NOW)) for i in ids), self_id="me")


def pick(
    v: ClusterView,
    copies: dict[str, int],
    inflight: dict[str, int] | None = None,
    exclude: set[str] | None = None,
    local_loaded: bool = False,
    balanced: bool = False,
) -> str | None:
    return choose_copy(v, copies, inflight or {}, exclude or set(), WAIT, local_loaded, balanced)


def test_assume_loaded_is_max_of_three_seconds_and_a_third_of_the_timeout() -> None:
    assert assume_loaded_ms(1_000) == 3_000
    assert assume_loaded_ms(9_000) == 3_000
    assert assume_loaded_ms(90_000) == 30_000


def recorded(times: LoadTimes, *loads_ms: float) -> LoadTimes:
    for ms in loads_ms:
        times = times.recorded(ms)
    return times


def test_assume_loaded_is_learnt_from_load_times_as_upstream_does() -> None:
    # The llm-runtime's 120 s timeout: 40 s by default; loads of about a second bring it down.
    start = LoadTimes(assume_loaded_ms(120_000))
    assert start.assume_ms == 40_000
    # Loads 1-3 each pull the horizon a third of the way to the mean so far.
    assert recorded(start, 1_000).assume_ms == 27_000
    assert recorded(start, 1_000, 1_000).assume_ms == 18_333
    assert recorded(start, 1_000, 1_000, 1_000).assume_ms == 12_555
    # The 4th sets it from the statistics: mean + 5 sigma (population), here 1000 + 5 * 70.7.
    four = recorded(start, 900, 1_100, 1_000, 1_000)
    assert four.assume_ms == 1_353
    assert recorded(four, 5_000).assume_ms == 1_353, "set again only at every 4th load"
    # 8 loads: 900/1100 alternating, sigma 100 -> 1000 + 5 * 100.
    assert recorded(start, *[900, 1_100] * 4).assume_ms == 1_500
    assert recorded(start, *[900, 1_100] * 10).assume_ms == 1_500  # 20 loads: still 5 sigma
    assert recorded(start, *[900, 1_100] * 12).assume_ms == 1_300  # beyond 20: 3 sigma


def test_assume_loaded_has_no_floor_or_cap() -> None:
    assert recorded(LoadTimes(3_000), 10, 10, 10, 10).assume_ms == 10  # no 3 s floor once learnt
    assert recorded(LoadTimes(3_000), *[50_000] * 4).assume_ms == 50_000  # nor the default as a cap


def test_assume_loaded_is_learnt_per_model_type() -> None:
    horizon = AssumeLoaded(40_000)
    for _ in range(4):
        horizon.record("llm", 1_000)
    assert horizon.ms("llm") == 1_000
    assert horizon.ms("sklearn") == 40_000, "a type with no load here keeps the default"


def test_a_copy_is_routed_to_once_past_the_learnt_horizon() -> None:
    # b's copy started 5 s ago, a's a minute ago with requests in flight. By default (40 s)
    # b is still loading and a serves; once loads are seen to take about a second, b is
    # probably loaded and, less busy, serves.
    v = cluster("me", "a", "b")
    copies = {"a": NOW - 60_000, "b": NOW - 5_000}
    horizon = AssumeLoaded(assume_loaded_ms(120_000))
    assert choose_copy(v, copies, {"a": 3}, set(), horizon.ms("llm"), False, False) == "a"
    for ms in (900, 1_100, 1_000, 1_000):
        horizon.record("llm", ms)
    assert choose_copy(v, copies, {"a": 3}, set(), horizon.ms("llm"), False, False) == "b"


def test_no_copies_no_choice() -> None:
    v = cluster("me", "a")
    assert pick(v, {}) is None
    assert pick(v, {"a": LOADED}, exclude={"a"}) is None
    assert pick(v, {"gone": LOADED}) is None  # not live


def test_loaded_local_copy_serves_even_when_peers_are_idle() -> None:
    v = cluster("me", "a")
    assert pick(v, {"me": LOADED, "a": LOADED}, inflight={"me": 50}, local_loaded=True) == "me"
    # Loaded locally but the record has not caught up yet.
    assert pick(v, {"a": LOADED}, local_loaded=True) == "me"


def test_excluded_local_copy_is_skipped() -> None:
    v = cluster("me", "a")
    assert pick(v, {"me": LOADED, "a": LOADED}, exclude={"me"}, local_loaded=True) == "a"


def test_fewest_inflight_among_probably_loaded() -> None:
    v = cluster("me", "a", "b", "c")
    copies = {"a": LOADED, "b": LOADED, "c": LOADED}
    assert pick(v, copies, inflight={"a": 3, "b": 1, "c": 2}) == "b"


def test_tie_goes_to_least_recently_used_instance_then_id() -> None:
    v = cluster("me", "a", "b", "c", a=NOW - 10, b=NOW - 5_000, c=NOW - 5_000)
    copies = {"a": LOADED, "b": LOADED, "c": LOADED}
    assert pick(v, copies, inflight={"a": 1, "b": 1, "c": 1}) == "b"
    assert pick(v, copies, inflight={"a": 0, "b": 1, "c": 1}) == "a"


def test_loading_copy_loses_to_a_busy_loaded_one() -> None:
    v = cluster("me", "a", "b")
    assert pick(v, {"a": LOADED, "b": LOADING}, inflight={"a": 9}) == "a"


def test_all_loading_chooses_the_oldest_load() -> None:
    v = cluster("me", "a", "b")
    assert pick(v, {"a": NOW - 2_000, "b": NOW - 5_000}, inflight={"b": 7}) == "b"


def test_load_started_exactly_at_the_horizon_counts_as_loading() -> None:
    v = cluster("me", "a", "b")
    copies = {"a": NOW - WAIT, "b": NOW - WAIT - 1}
    assert pick(v, copies, inflight={"b": 5}) == "b"


def test_balanced_waits_for_its_own_loading_copy_when_none_is_further_along() -> None:
    v = cluster("me", "a")
    assert pick(v, {"me": NOW - 2_000, "a": NOW - 1_000}, balanced=True) == "me"
    # A copy elsewhere that started earlier (probably loaded) wins.
    assert pick(v, {"me": NOW - 2_000, "a": LOADED}, balanced=True) == "a"


def test_unbalanced_prefers_a_loaded_peer_over_its_own_loading_copy() -> None:
    v = cluster("me", "a")
    assert pick(v, {"me": LOADED, "a": LOADED}) == "a"  # me is loading whatever the timestamp says
    # Everything loading: the oldest, and a tie prefers this instance.
    assert pick(v, {"me": NOW - 2_000, "a": NOW - 2_000}) == "me"
    assert pick(v, {"me": NOW - 1_000, "a": NOW - 2_000}) == "a"


def test_self_copy_does_not_need_to_be_in_the_view() -> None:
    v = view(inst("a"), self_id="me")  # own record not published yet
    assert pick(v, {"me": NOW - 2_000, "a": NOW - 1_000}, balanced=True) == "me"


IDS = ["me", "a", "b", "c", "d"]


@settings(max_examples=300, deadline=None)
@given(
    live=st.frozensets(st.sampled_from(IDS)),
    copies=st.dictionaries(st.sampled_from([*IDS, "gone"]), st.integers(NOW - 120_000, NOW)),
    inflight=st.dictionaries(st.sampled_from(IDS), st.integers(0, 20)),
    exclude=st.frozensets(st.sampled_from(IDS)),
    local_loaded=st.booleans(),
    balanced=st.booleans(),
)
def test_choice_is_a_usable_copy(
    live: frozenset[str],
    copies: dict[str, int],
    inflight: dict[str, int],
    exclude: frozenset[str],
    local_loaded: bool,
    balanced: bool,
) -> None:
    v = view(*(inst(i) for i in live), self_id="me")
    chosen = choose_copy(v, copies, inflight, exclude, WAIT, local_loaded, balanced)
    usable = {i for i in copies if i not in exclude and (i == "me" or i in live)}
    if local_loaded and "me" not in exclude:
        assert chosen == "me"
    elif usable:
        assert chosen in usable
    else:
        assert chosen is None
