"""Which holders count and serve beyond the instance records: found unreachable by the data
path, or departed moments ago (issue 15)."""

from __future__ import annotations

from meshd.decisions.placement.liveness import (
    PEER_GONE_GRACE_MS,
    Expiring,
    counted_for_max_copies,
    departed_for_ms,
    recently_departed,
    trusted_peer,
)
from meshd.decisions.placement.serving import choose_copy
from meshd.decisions.placement.view import ClusterView

from .factories import NOW, inst


def _view(*live: str, departed: tuple[str, ...] = (), unreachable: tuple[str, ...] = ()) -> ClusterView:
    return ClusterView(
        self_id="me",
        now_ms=NOW,
        instances={i: inst(i) for i in ("me", *live)},
        departed={i: inst(i) for i in departed},
        unreachable=frozenset(unreachable),
    )


def test_expiring_forgets_after_its_time() -> None:
    marks = Expiring()
    marks.note("x", NOW, 1000)
    assert marks.current(NOW + 999) == {"x"}
    assert marks.current(NOW + 1000) == frozenset()
    marks.note("x", NOW, 1000)
    marks.forget("x")
    assert marks.current(NOW) == frozenset()


def test_a_holder_found_unreachable_does_not_count_toward_max_copies_nor_serve() -> None:
    v = _view("x", "y", unreachable=("x",))
    assert counted_for_max_copies(v) == {"me", "y"}
    old = NOW - 60_000
    assert choose_copy(v, {"x": old}, {}, set(), 3000, False, False) is None
    assert choose_copy(v, {"x": old, "y": old}, {}, set(), 3000, False, False) == "y"


def test_a_departed_holder_counts_and_serves_only_when_no_live_copy_does() -> None:
    v = _view("y", departed=("x",))
    assert counted_for_max_copies(v) == {"me", "y", "x"}
    old = NOW - 60_000
    assert choose_copy(v, {"x": old}, {}, set(), 3000, False, False) == "x"
    assert choose_copy(v, {"x": old, "y": old}, {}, set(), 3000, False, False) == "y"
    assert choose_copy(v, {"x": old}, {}, {"x"}, 3000, False, False) is None
    gone = _view(departed=("x",), unreachable=("x",))
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
