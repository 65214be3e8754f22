"""getModelStatus decisions (pure)."""

from __future__ import annotations

from meshd.core.records import ModelRecord
from meshd.decisions.cache import CacheEntry, State
from meshd.decisions.status import ModelStatus, model_status

EXPIRY = 900_000


def test_not_found_and_not_loaded() -> None:
    assert model_status(None, None, "me", 0, EXPIRY).status is ModelStatus.NOT_FOUND
    assert model_status(ModelRecord(type="t"), None, "me", 0, EXPIRY).status is ModelStatus.NOT_LOADED


def test_local_state_is_exact_and_copies_are_newest_first() -> None:
    rec = ModelRecord(type="t", instance_ids={"me": 100, "peer": 200})
    loading = CacheEntry("m", 1, 0, State.LOADING, 100)
    view = model_status(rec, loading, "me", 300, EXPIRY)
    assert view.status is ModelStatus.LOADED  # the peer's copy
    assert [(c.location, c.status) for c in view.copies] == [("peer", ModelStatus.LOADED), ("me", ModelStatus.LOADING)]
    # A record naming us for a copy we do not hold is stale and not reported.
    view = model_status(ModelRecord(type="t", instance_ids={"me": 1}), None, "me", 300, EXPIRY)
    assert view.status is ModelStatus.NOT_LOADED and view.copies == ()


def test_failures_count_until_they_expire() -> None:
    rec = ModelRecord(type="t", failed_in={"me": 1000}, fails={"me": {"msg": "boom"}})
    view = model_status(rec, None, "me", 2000, EXPIRY)
    assert view.status is ModelStatus.LOADING_FAILED and view.errors == ("me: boom",)
    assert model_status(rec, None, "me", 1000 + EXPIRY, EXPIRY).status is ModelStatus.NOT_LOADED


def test_recent_failures_are_those_within_the_expiry() -> None:
    from meshd.decisions.status import recent_failures

    assert recent_failures({"a": 1000, "b": 500, "c": 900}, now_ms=1500, expiry_ms=600) == ["a"]  # c: exactly expired
    assert recent_failures({}, 1500, 600) == []


def test_a_peer_copy_still_loading_reports_loading() -> None:
    from meshd.decisions.status import CopyState

    rec = ModelRecord(type="t", instance_ids={"peer": 200})
    assert model_status(rec, None, "me", 300, EXPIRY).status is ModelStatus.LOADED  # not asked: as before
    view = model_status(rec, None, "me", 300, EXPIRY, peers={"peer": CopyState.LOADING})
    assert view.status is ModelStatus.LOADING and view.copies[0].status is ModelStatus.LOADING
    assert model_status(rec, None, "me", 300, EXPIRY, peers={"peer": CopyState.LOADED}).status is ModelStatus.LOADED
    # A peer that no longer holds it (the record is behind) has no copy to report.
    gone = model_status(rec, None, "me", 300, EXPIRY, peers={"peer": CopyState.GONE})
    assert gone.status is ModelStatus.NOT_LOADED and gone.copies == ()


def test_no_home_is_loading_failed_with_upstreams_message_only_without_copies() -> None:
    message = "There are no running instances that meet the label requirements of type mt:x: [mt:x]"
    rec = ModelRecord(type="mt:x")
    view = model_status(rec, None, "me", 300, EXPIRY, no_home=message)
    assert view.status is ModelStatus.LOADING_FAILED and view.errors == (message,)
    held = ModelRecord(type="mt:x", instance_ids={"peer": 200})
    assert model_status(held, None, "me", 300, EXPIRY, no_home=message).status is ModelStatus.LOADED
    failed = ModelRecord(type="mt:x", failed_in={"me": 100}, fails={"me": {"msg": "boom"}})
    assert model_status(failed, None, "me", 300, EXPIRY, no_home=message).errors == ("me: boom",)


def test_a_request_turned_away_only_by_load_failures_is_a_load_failure() -> None:
    from meshd.decisions.status import failed_everywhere

    rec = ModelRecord(
        type="t", failed_in={"a": 100, "b": 200}, fails={"a": {"msg": "bad weights"}, "b": {"msg": "oom"}}
    )
    # By the record: the newest failure's message first, then every instance's.
    message = failed_everywhere("m", {"a", "b"}, rec, ["a", "b"], {})
    assert message == "oom (model 'm' failed to load on 2 instances recently: a: bad weights; b: oom)"
    # The same message everywhere is said once, with where.
    same = ModelRecord(type="t", failed_in={"a": 1, "b": 2}, fails={"a": {"msg": "no file"}, "b": {"msg": "no file"}})
    assert failed_everywhere("m", {"a", "b"}, same, ["a", "b"], {}) == (
        "no file (model 'm' failed to load on 2 instances recently: a, b)"
    )
    one = ModelRecord(type="t", failed_in={"a": 1}, fails={"a": {"msg": "no file"}})
    assert (
        failed_everywhere("m", {"a"}, one, ["a"], {}) == "no file (model 'm' failed to load on 1 instance recently: a)"
    )
    # One instance turned it away for another reason (unreachable, say): churn, not a load failure.
    assert failed_everywhere("m", {"a", "b", "c"}, rec, ["a", "b"], {}) is None
    # ... unless that peer said its load failed before its record write reached this mirror.
    told = failed_everywhere("m", {"a", "b", "c"}, rec, ["a", "b"], {"c": "no such file"})
    assert told == "no such file (model 'm' failed to load on 3 instances: a: bad weights; b: oom; c: no such file)"
    # Nothing tried, or nothing failed: not this rule's answer.
    assert failed_everywhere("m", set(), rec, ["a", "b"], {"c": "x"}) is None
    assert failed_everywhere("m", {"a"}, ModelRecord(type="t"), [], {}) is None
