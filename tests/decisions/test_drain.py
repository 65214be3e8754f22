"""When a stopping instance's drain grace ends."""

from __future__ import annotations

from meshd.decisions.drain import QUIET_S, grace_over


def test_with_other_instances_the_grace_runs_its_whole_length() -> None:
    assert not grace_over(5.0, 10.0, others=True, quiet_since_s=0.0)  # quiet for 5 s: still open
    assert grace_over(10.0, 10.0, others=True, quiet_since_s=9.9)


def test_a_lone_instance_serves_only_while_requests_keep_arriving() -> None:
    """Nowhere to send its clients: an idle lone instance stops at once, a busy one serves on
    until its requests stop or the grace ends (issue 45: every stop took 10 s)."""
    assert grace_over(QUIET_S, 10.0, others=False, quiet_since_s=0.0)
    assert not grace_over(5.0, 10.0, others=False, quiet_since_s=5.0 - QUIET_S / 2)  # a request just now
    assert grace_over(10.0, 10.0, others=False, quiet_since_s=10.0)
