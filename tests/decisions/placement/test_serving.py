"""Which copy serves: local first, then the least busy probably-loaded copy, else the oldest load."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.decisions.placement.serving import assume_loaded_ms, choose_copy
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
