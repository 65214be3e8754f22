"""Which instances the internal port takes forwarded calls from (`meshd.cluster`)."""

from __future__ import annotations

from meshd.cluster import PEER_GONE_GRACE_MS, accepts_calls_from


def test_a_live_peer_is_accepted() -> None:
    assert accepts_calls_from(True, None, now_ms=1_000)


def test_a_peer_never_seen_is_refused() -> None:
    assert not accepts_calls_from(False, None, now_ms=1_000)


def test_a_peer_whose_record_just_went_is_still_accepted() -> None:
    # Its lease ran out while it was cut off from etcd: it still serves, and forwards to us.
    assert accepts_calls_from(False, gone_since_ms=1_000, now_ms=1_000 + 6_000)


def test_a_peer_gone_longer_than_the_grace_is_refused() -> None:
    assert not accepts_calls_from(False, gone_since_ms=1_000, now_ms=1_000 + PEER_GONE_GRACE_MS)
