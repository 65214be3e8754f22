"""The per-copy gate's rules (pure): how many may wait, and what an arrival does."""

from __future__ import annotations

from meshd.decisions.gate import Arrival, on_arrival, queue_bound


def test_queue_bound_follows_upstream_auto_rule() -> None:
    assert queue_bound(1, 0) == 16
    assert queue_bound(4, 0) == 32
    assert queue_bound(4, 3) == 3
    assert queue_bound(4, -1) is None


def test_arrival_rule_runs_queues_behind_waiters_and_refuses_a_full_line() -> None:
    assert on_arrival(running=1, waiting=0, limit=2, max_queue=1) is Arrival.RUN
    assert on_arrival(running=1, waiting=1, limit=2, max_queue=2) is Arrival.QUEUE  # never jumps the line
    assert on_arrival(running=2, waiting=0, limit=2, max_queue=1) is Arrival.QUEUE
    assert on_arrival(running=2, waiting=1, limit=2, max_queue=1) is Arrival.REFUSE
    assert on_arrival(running=2, waiting=10_000, limit=2, max_queue=None) is Arrival.QUEUE
