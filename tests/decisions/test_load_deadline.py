"""When a load is cut: its timeout, not counting its pull (`meshd.decisions.load_deadline`)."""

from __future__ import annotations

from meshd.decisions.load_deadline import PullSeen, load_cut_at_ms, pull_seen

T, LONGEST, POLL = 90_000, 7_200_000, 2_000


def test_no_pull_seen_is_the_plain_timeout() -> None:
    assert load_cut_at_ms(T, LONGEST, PullSeen(), 0, POLL) == T
    assert load_cut_at_ms(T, LONGEST, PullSeen(), 89_000, POLL) == T


def test_a_running_pull_is_never_cut_before_the_next_look() -> None:
    # 300 s into a load whose pull has run 295 s: allowed 90 + 295 s.
    assert load_cut_at_ms(T, LONGEST, PullSeen(295_000, True), 300_000, POLL) == 385_000
    # Whatever the arithmetic says, a pull running now is looked at again before a cut.
    assert load_cut_at_ms(1_000, LONGEST, PullSeen(0, True), 5_000, POLL) == 7_000


def test_a_finished_pull_gives_the_runtime_the_whole_timeout_after_it() -> None:
    assert load_cut_at_ms(T, LONGEST, PullSeen(600_000, False), 601_000, POLL) == 690_000


def test_the_longest_bounds_a_load_however_its_pull_goes() -> None:
    assert load_cut_at_ms(T, 3_600_000, PullSeen(3_599_000, True), 3_600_000, POLL) == 3_600_000
    assert load_cut_at_ms(T, 0, PullSeen(50_000, True), 10_000, POLL) == T  # 0: never past the timeout


def test_what_one_look_at_the_disk_tier_says() -> None:
    start = PullSeen()
    running = pull_seen(start, running_ms=12_000, finished_ms=None)
    assert running == PullSeen(12_000, True)
    assert pull_seen(running, running_ms=None, finished_ms=14_500) == PullSeen(14_500, False)  # its own length
    assert pull_seen(running, running_ms=None, finished_ms=None) == PullSeen(12_000, False)  # failed or evicted
    # A model already on disk when this load began was pulled by another: not this load's time.
    assert pull_seen(start, running_ms=None, finished_ms=500_000) == start
    # A look that saw less (a restarted pull) does not shorten what was seen.
    assert pull_seen(running, running_ms=3_000, finished_ms=None) == PullSeen(12_000, True)
