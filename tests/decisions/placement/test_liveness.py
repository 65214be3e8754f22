"""Which holders count and serve beyond the instance records: found unreachable by the data
path (and lapsed, by etcd's word on their leases), or departed moments ago (issue 15)."""

from __future__ import annotations

from meshd.decisions.placement.liveness import (
    PEER_GONE_GRACE_MS,
    RENEWAL_SLACK_S,
    Expiring,
    LeaseVerdict,
    counted_for_max_copies,
    departed_for_ms,
    lease_verdict,
    recently_departed,
    trusted_peer,
)
from meshd.decisions.placement.serving import choose_copy
from meshd.decisions.placement.view import ClusterView

from .factories import NOW, inst


def _view(
    *live: str, departed: tuple[str, ...] = (), unreachable: tuple[str, ...] = (), lapsed: tuple[str, ...] = ()
) -> ClusterView:
    return ClusterView(
        self_id="me",
        now_ms=NOW,
        instances={i: inst(i) for i in ("me", *live)},
        departed={i: inst(i) for i in departed},
        unreachable=frozenset(unreachable) | frozenset(lapsed),
        lapsed=frozenset(lapsed),
    )


def test_expiring_forgets_after_its_time() -> None:
    marks = Expiring()
    marks.note("x", NOW, 1000)
    assert marks.current(NOW + 999) == {"x"}
    assert marks.current(NOW + 1000) == frozenset()
    marks.note("x", NOW, 1000)
    marks.forget("x")
    assert marks.current(NOW) == frozenset()


def test_a_holder_found_unreachable_is_not_tried_and_counts_toward_max_copies_until_it_lapses() -> None:
    old = NOW - 60_000
    for v in (_view("x", "y", unreachable=("x",)), _view("x", "y", lapsed=("x",))):
        assert choose_copy(v, {"x": old}, {}, set(), 3000, False, False) is None
        assert choose_copy(v, {"x": old, "y": old}, {}, set(), 3000, False, False) == "y"
    # Cut off from here only (etcd has not said otherwise): a capped model must not load again.
    assert counted_for_max_copies(_view("x", "y", unreachable=("x",))) == {"me", "x", "y"}
    assert counted_for_max_copies(_view("x", "y", lapsed=("x",))) == {"me", "y"}


def test_lease_verdict_tells_gone_from_cut_off_by_when_the_lease_was_last_renewed() -> None:
    every = 2.0  # a live owner renews every 2 s (kv.lease); etcd rounds what is left down
    noticed = NOW - 100
    assert lease_verdict(None, 0, every, noticed, NOW) is LeaseVerdict.LAPSED  # lease or record gone
    assert lease_verdict(0, 20, every, noticed, NOW) is LeaseVerdict.LAPSED  # about to expire
    stale = 20 - int(every + RENEWAL_SLACK_S) - 1
    assert lease_verdict(stale, 20, every, noticed, NOW) is LeaseVerdict.LAPSED  # missed its renewals
    # Renewed 1 s ago at most, but found unreachable only 0.1 s ago: it may have died since.
    assert lease_verdict(19, 20, every, noticed, NOW) is LeaseVerdict.UNKNOWN
    # Renewed after it was found unreachable: alive, cut off from here only.
    assert lease_verdict(19, 20, every, NOW - 1500, NOW) is LeaseVerdict.ALIVE
    assert lease_verdict(20, 20, every, NOW - 1, NOW) is LeaseVerdict.ALIVE
    # Within its renewal period, not yet renewed since: undecided either way.
    assert lease_verdict(17, 20, every, NOW - 2500, NOW) is LeaseVerdict.UNKNOWN


def test_a_departed_holder_counts_and_serves_only_when_no_live_copy_does() -> None:
    v = _view("y", departed=("x",))
    assert counted_for_max_copies(v) == {"me", "y", "x"}
    old = NOW - 60_000
    assert choose_copy(v, {"x": old}, {}, set(), 3000, False, False) == "x"
    assert choose_copy(v, {"x": old, "y": old}, {}, set(), 3000, False, False) == "y"
    assert choose_copy(v, {"x": old}, {}, {"x"}, 3000, False, False) is None
    gone = _view(departed=("x",), lapsed=("x",))
    assert counted_for_max_copies(gone) == {"me"}
    assert choose_copy(gone, {"x": old}, {}, set(), 3000, False, False) is None


def test_recently_departed_skips_the_leaving_the_returned_and_the_long_gone() -> None:
    for_ms = departed_for_ms(2000)
    assert for_ms == 10_000 and departed_for_ms(20_000) == 20_000
    departures = {
        "crashed": (NOW - 1000, inst("crashed")),
        "drained": (NOW - 1000, inst("drained", shutdown=True)),
        "back": (NOW - 1000, inst("back")),
        "long-gone": (NOW - for_ms, inst("long-gone")),
    }
    assert set(recently_departed(departures, {"back": inst("back")}, NOW, for_ms)) == {"crashed"}


def test_a_peer_call_is_trusted_from_live_and_recently_departed_instances() -> None:
    v = _view("y", departed=("x",))
    assert trusted_peer(v, "y") and trusted_peer(v, "x")
    assert not trusted_peer(v, "me") and not trusted_peer(v, "stranger")


def test_a_peer_call_is_trusted_from_an_instance_gone_less_than_the_grace() -> None:
    # Its lease ran out while it was cut off from etcd: it still serves, and forwards here.
    v = _view("y")
    assert trusted_peer(v, "cut-off", gone_since_ms=NOW - 60_000)
    assert not trusted_peer(v, "cut-off", gone_since_ms=NOW - PEER_GONE_GRACE_MS)
    assert not trusted_peer(v, "cut-off", gone_since_ms=None)


def test_a_draining_holder_counts_toward_max_copies_until_it_leaves_the_record() -> None:
    # Its runtime still holds the copy: another load of a capped model would make two.
    v = ClusterView(self_id="me", now_ms=NOW, instances={"me": inst("me"), "x": inst("x", shutdown=True)})
    assert counted_for_max_copies(v) == {"me", "x"}
