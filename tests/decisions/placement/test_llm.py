"""Which copy of a language model serves a call: where it starts soonest, the prefix's copy
while it is not overloaded (decisions.placement.llm)."""

from __future__ import annotations

from meshd.decisions.placement.llm import (
    AFFINITY_SLACK,
    DEEP_QUEUE,
    FRESH_MS,
    MIN_READINGS,
    PREFIX_CHARS,
    EngineLoad,
    PrefixOwners,
    Reading,
    choose_llm_copy,
    copies_loading,
    format_load,
    fresh,
    load_now,
    parse_load,
    prefix_key,
    queue_stays_deep,
)
from meshd.decisions.placement.view import ClusterView
from tests.decisions.placement.factories import NOW, inst, view

WAIT = 30_000
LOADED = NOW - 60_000
LOADING = NOW - 1_000


def cluster(*ids: str) -> ClusterView:
    return view(*(inst(i, lru_time=NOW) for i in ids), self_id="me")


def pick(
    copies: dict[str, int],
    inflight: dict[str, int] | None = None,
    loads: dict[str, EngineLoad] | None = None,
    owner: str | None = None,
    local_loaded: bool = False,
    exclude: set[str] | None = None,
) -> str | None:
    v = cluster("me", "a", "b", "c")
    return choose_llm_copy(v, copies, inflight or {}, loads or {}, exclude or set(), WAIT, local_loaded, owner)


def test_load_text_round_trips_and_bad_text_is_none() -> None:
    for load in (EngineLoad(3), EngineLoad(3, 1, 2, 0.25), EngineLoad(0, 0, 0, 0.0)):
        assert parse_load(format_load(load)) == load
    assert parse_load(b"inflight=2 other=x") == EngineLoad(2)
    for bad in ("", "waiting=1", "inflight=x", "inflight=-1", "inflight=1 kv=7"):
        assert parse_load(bad) is None, bad


def test_only_fresh_readings_count() -> None:
    readings = {"a": Reading(EngineLoad(1), NOW - FRESH_MS, 0), "b": Reading(EngineLoad(2), NOW - FRESH_MS - 1, 0)}
    assert fresh(readings, NOW, {}) == {"a": EngineLoad(1)}


def test_a_reading_counts_this_instances_calls_as_they_are_now() -> None:
    # Read when this instance had 3 calls at the copy and another instance 2.
    read = Reading(EngineLoad(5), NOW, own=3)
    assert load_now(read, 3) == EngineLoad(5)
    assert load_now(read, 0) == EngineLoad(2), "this instance's calls ended since: the others' remain"
    assert load_now(read, 6) == EngineLoad(8), "calls sent since count once"
    # Never fewer than this instance's own calls (a reading that counted fewer than it had).
    assert load_now(Reading(EngineLoad(1), NOW, own=4), 2) == EngineLoad(2)
    # The engine's counts, read earlier, only split the calls counted: a batch that was full
    # (some waiting) runs as many now, the rest wait; one that was not runs them all.
    assert load_now(Reading(EngineLoad(6, 2, 4, 0.5), NOW, own=6), 3) == EngineLoad(3, 0, 3, 0.5)
    assert load_now(Reading(EngineLoad(6, 2, 4, 0.5), NOW, own=6), 7) == EngineLoad(7, 3, 4, 0.5)
    assert load_now(Reading(EngineLoad(2, 0, 5, 0.5), NOW, own=2), 4) == EngineLoad(4, 0, 4, 0.5)
    assert load_now(Reading(EngineLoad(2), NOW, own=2), 1) == EngineLoad(1)


def test_a_copy_whose_calls_ended_since_its_reading_is_not_held_busy() -> None:
    copies = {"a": LOADED, "b": LOADED, "c": LOADED}
    # Read 100 ms ago: a with this instance's 4 calls running (all ended since), b with its 1
    # (still running), c idle.
    readings = {
        "a": Reading(EngineLoad(4, 0, 4), NOW - 100, own=4),
        "b": Reading(EngineLoad(1, 0, 1), NOW - 100, own=1),
        "c": Reading(EngineLoad(1, 0, 1), NOW - 100, own=0),
    }
    inflight = {"a": 0, "b": 1, "c": 0}
    assert pick(copies, inflight, fresh(readings, NOW, inflight)) == "a"
    # a keeps its prefix with one call now: its queue is not the 4 it was read with.
    inflight = {"a": 1, "b": 1, "c": 0}
    assert pick(copies, inflight, fresh(readings, NOW, inflight), owner="a") == "a"
    # Another instance's calls in a reading still count: c's one, and b's when it has more than
    # AFFINITY_SLACK beyond the least loaded copy's.
    inflight = {"a": 2, "b": 0, "c": 0}
    assert pick(copies, inflight, fresh(readings, NOW, inflight)) == "b"
    readings["b"] = Reading(EngineLoad(AFFINITY_SLACK + 2, 0, AFFINITY_SLACK + 2), NOW - 100, own=0)
    assert pick(copies, inflight, fresh(readings, NOW, inflight), owner="b") == "c"


def test_prefix_key_is_the_first_chars_of_the_conversation() -> None:
    system = "s" * PREFIX_CHARS
    a = prefix_key({"messages": [{"role": "system", "content": system}, {"role": "user", "content": "one"}]})
    b = prefix_key({"messages": [{"role": "system", "content": system}, {"role": "user", "content": "two"}]})
    assert a is not None and a == b, "calls sharing a long system prompt share a key"
    other = prefix_key({"messages": [{"role": "system", "content": "t" * PREFIX_CHARS}]})
    assert other != a
    parts = [{"type": "text", "text": system}]
    assert prefix_key({"messages": [{"role": "system", "content": parts}, {"role": "user", "content": "x"}]}) == a
    assert prefix_key({"prompt": "p" * PREFIX_CHARS + "tail"}) == prefix_key({"prompt": "p" * PREFIX_CHARS})
    assert prefix_key({"prompt": ["p" * PREFIX_CHARS]}) == prefix_key({"prompt": "p" * PREFIX_CHARS})
    # Short conversations have no prefix worth following; odd bodies none either.
    for body in ({"prompt": "short"}, {"messages": [{"role": "user", "content": "hi"}]}, {"prompt": 3}, {}):
        assert prefix_key(body) is None


def test_prefix_owners_are_bounded_least_recently_used_forgotten() -> None:
    owners = PrefixOwners(capacity=2)
    owners.served("m", "p1", "a")
    owners.served("m", "p2", "b")
    owners.served("m", "p1", "c")  # p1 used again: p2 is the oldest
    owners.served("m", "p3", "a")
    assert (owners.get("m", "p1"), owners.get("m", "p2"), owners.get("m", "p3")) == ("c", None, "a")
    assert owners.get("other", "p1") is None


def test_without_readings_the_fewest_in_flight_serves_this_instance_first_on_ties() -> None:
    copies = {"me": LOADED, "a": LOADED, "b": LOADED}
    assert pick(copies, {"me": 2, "a": 1, "b": 3}, local_loaded=True) == "a"
    assert pick(copies, {"me": 1, "a": 1, "b": 1}, local_loaded=True) == "me", "no hop when it is a tie"
    # Unlike other inference, a busy local copy does not keep the call.
    assert pick(copies, {"me": 5}, local_loaded=True) == "a"


def test_the_engines_queue_decides_where_it_is_known() -> None:
    copies = {"a": LOADED, "b": LOADED}
    # This instance sent nothing to either; the engines say a has requests waiting.
    loads = {"a": EngineLoad(4, 2, 2, 0.3), "b": EngineLoad(3, 0, 3, 0.3)}
    assert pick(copies, loads=loads) == "b"
    # Nothing waiting anywhere: the shorter queue, then the emptier KV cache.
    assert pick(copies, loads={"a": EngineLoad(1, 0, 1, 0.1), "b": EngineLoad(2, 0, 2, 0.1)}) == "a"
    assert pick(copies, loads={"a": EngineLoad(1, 0, 1, 0.8), "b": EngineLoad(1, 0, 1, 0.2)}) == "b"
    # An engine's reading may be older than this instance's own calls to it.
    assert pick(copies, {"a": 6}, {"a": EngineLoad(1, 0, 1), "b": EngineLoad(2, 0, 2)}) == "b"


def test_the_prefix_stays_on_its_copy_until_that_copy_is_overloaded() -> None:
    copies = {"a": LOADED, "b": LOADED, "c": LOADED}
    assert pick(copies, {"a": 1, "b": 0, "c": 0}, owner="a") == "a"
    assert pick(copies, {"a": AFFINITY_SLACK, "b": 0}, owner="a") == "a"
    assert pick(copies, {"a": AFFINITY_SLACK + 1, "b": 0, "c": 1}, owner="a") == "b", "too far behind the others"
    assert pick(copies, loads={"a": EngineLoad(1, 0, 1, 0.95)}, owner="a") == "b", "its KV cache is full"
    # An owner that is excluded, gone or not a copy: the soonest start.
    assert pick(copies, {"b": 1}, owner="a", exclude={"a"}) == "c"
    assert pick(copies, {"b": 1}, owner="zzz") == "a"


def test_copies_still_loading_follow_the_usual_rule() -> None:
    # None probably loaded: the first to start loading (choose_copy's rule 4).
    assert pick({"a": LOADING, "b": LOADING - 10}) == "b"
    # One loaded, one loading: the loaded one, even with more in flight.
    assert pick({"a": LOADED, "b": LOADING}, {"a": 5}) == "a"
    assert pick({}) is None
    assert pick({"a": LOADED}, exclude={"a"}) is None


def test_a_queue_that_stays_deep_asks_for_copies_unless_one_is_loading() -> None:
    assert queue_stays_deep(MIN_READINGS, DEEP_QUEUE, 0)
    assert not queue_stays_deep(MIN_READINGS, DEEP_QUEUE - 1, 0), "one reading with a short queue: it drained"
    assert not queue_stays_deep(MIN_READINGS - 1, DEEP_QUEUE + 5, 0), "too few readings to say it stayed"
    assert not queue_stays_deep(MIN_READINGS, DEEP_QUEUE + 5, 1), "a copy on its way: the queue waits for it"


def test_copies_loading_are_those_calls_do_not_go_to_yet() -> None:
    holders = {"me": NOW - 1_000, "a": LOADED, "b": NOW - WAIT, "c": NOW - WAIT - 1}
    # b began exactly WAIT ago: not yet taken as loaded (choose_llm_copy's cutoff); this
    # instance's own copy is loaded (the scaler only checks loaded ones).
    assert copies_loading(holders, "me", NOW, WAIT) == 1
    assert pick({"b": NOW - WAIT, "c": NOW - WAIT - 1}) == "c"
    assert copies_loading({"me": LOADED, "a": LOADING, "b": LOADING}, "me", NOW, WAIT) == 2
    assert copies_loading({"me": LOADED}, "me", NOW, WAIT) == 0
