"""The runtime watch's decision (pure): when a runtime counts as gone, lost copies, back."""

from __future__ import annotations

from meshd.runtime.health import DOWN_AFTER_PROBES, Action, Probe, RuntimeHealth, judge


def test_a_runtime_is_down_only_after_several_missed_probes_in_a_row() -> None:
    health = RuntimeHealth()
    for _ in range(DOWN_AFTER_PROBES - 1):
        health, action = judge(health, Probe.NO_ANSWER)
        assert health.up and action is Action.NONE
    health, action = judge(health, Probe.NO_ANSWER)
    assert not health.up and action is Action.DROP_ALL
    # An answer in between starts the count again.
    health, _ = judge(RuntimeHealth(misses=DOWN_AFTER_PROBES - 1), Probe.ANSWERED)
    assert health == RuntimeHealth()


def test_a_lost_copy_is_checked_and_a_down_runtime_recovers_on_ready() -> None:
    assert judge(RuntimeHealth(), Probe.LOST_COPY) == (RuntimeHealth(), Action.CHECK_COPIES)
    down = RuntimeHealth(up=False, misses=DOWN_AFTER_PROBES)
    assert judge(down, Probe.NO_ANSWER) == (down, Action.NONE)
    assert judge(down, Probe.ANSWERED) == (RuntimeHealth(), Action.RECOVERED)
