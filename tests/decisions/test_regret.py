"""The adaptive order's choice from the fleet's regret (issue 44), pure: which order the fleet's
tallies say to follow, how the tallies forget, and the records that carry them."""

from __future__ import annotations

import pytest

from meshd.core.records import EVICTED_BY, REGRET, InstanceRecord, eviction_note, regret_reading
from meshd.decisions.regret import (
    MIN_EVICTIONS,
    RATE,
    RECENCY,
    REGRET_MEMORY_EVICTIONS,
    Z_TO_RECENCY,
    Regret,
    Tally,
    fleet_order,
    fleet_tally,
    follow,
    peer_tallies,
)


def tally(rate: tuple[float, float], recency: tuple[float, float]) -> Tally:
    """(evictions, charges) of each order."""
    return Tally((rate[0], recency[0]), (rate[1], recency[1]))


def test_recency_is_followed_only_once_its_regret_per_eviction_is_low_enough_beyond_chance() -> None:
    assert follow(Tally()) == RATE  # nothing known: RATE
    assert follow(tally((100, 50), (10, 1))) == RECENCY  # (1 + 1) / 10 per eviction against 0.5
    # 0.4 per eviction against RATE's 0.5 (at the margin), 100 charges: one standard error is 10
    assert follow(tally((100, 50), (1000, 400 - Z_TO_RECENCY * 20))) == RECENCY
    assert follow(tally((100, 50), (1000, 400 - Z_TO_RECENCY * 20 + 1))) == RATE  # a little less sure
    # The same rates on a tenth of the evictions: chance could make them, RATE stays
    assert follow(tally((100, 50), (100, 40 - Z_TO_RECENCY * 2))) == RATE
    assert follow(tally((100, 50), (MIN_EVICTIONS - 1, 0))) == RATE  # too few of recency's evictions
    assert follow(tally((MIN_EVICTIONS - 1, 3), (100, 0))) == RATE  # ... or of RATE's
    assert follow(tally((100, 0), (10, 0))) == RATE  # neither regretted: RATE


def test_the_fleet_sums_every_instances_tally() -> None:
    """One instance alone would follow recency; the fleet's sums say RATE."""
    mine = tally((10, 5), (5, 0))
    peers = [tally((200, 10), (5, 4)), tally((190, 10), (4, 4))]
    assert follow(mine) == RECENCY
    assert fleet_tally([mine, *peers]) == tally((400, 25), (14, 8))
    own = Regret()
    own.evicted(RATE, 3)
    assert fleet_order(own, peers) == RATE


def test_charges_fall_with_the_age_of_the_eviction_and_stop_after_a_turnover() -> None:
    regret = Regret()
    assert regret.reloaded(RATE, 0.0) == 1.0
    assert regret.reloaded(RATE, -0.5) == 1.0  # a peer's clock a little ahead: as if at once
    assert regret.reloaded(RECENCY, 0.5) == pytest.approx(0.005**0.5)
    assert regret.reloaded(RECENCY, 1.0) == 0.0
    assert regret.tally().charges == (2.0, pytest.approx(0.005**0.5))


def test_the_tallies_forget_over_the_fleets_recent_evictions() -> None:
    """Each own eviction keeps 1 - fleet_size / REGRET_MEMORY_EVICTIONS of what was there: a
    10-instance fleet's instance forgets ten times as fast as one alone."""
    regret = Regret()
    regret.reloaded(RATE, 0.0)
    for _ in range(100):
        regret.evicted(RECENCY, 10)
    keep = 1 - 10 / REGRET_MEMORY_EVICTIONS
    assert regret.tally().charges[RATE] == pytest.approx(keep**100)
    assert regret.tally().evictions[RECENCY] == pytest.approx(sum(keep**k for k in range(100)))


def test_one_admission_in_every_explore_every_explores() -> None:
    regret = Regret(explore_every=3)
    seen = []
    for _ in range(9):
        nxt = regret.explores_next()
        seen.append(regret.explore())
        assert seen[-1] == nxt
    assert seen == [False, False, True] * 3


def test_records_carry_the_note_and_the_tally_and_bad_values_read_as_absent() -> None:
    assert eviction_note({EVICTED_BY: ["rate", 12.5]}) == (RATE, 12.5)
    assert eviction_note({EVICTED_BY: ["recency", 3]}) == (RECENCY, 3.0)
    for bad in (None, [], ["lru", 1.0], ["rate"], ["rate", "x"], ["rate", True], "rate", ["rate", 1, 2]):
        assert eviction_note({EVICTED_BY: bad}) is None, bad
    assert regret_reading({REGRET: [1, 0.5, 2, 0]}) == (1.0, 0.5, 2.0, 0.0)
    for bad in (None, [1, 2, 3], [1, 2, 3, -1], [1, 2, 3, "4"], [1, 2, 3, float("nan")], {"a": 1}):
        assert regret_reading({REGRET: bad}) is None, bad
    assert Tally.from_list(tally((3, 1), (2, 0.5)).as_list()) == tally((3, 1), (2, 0.5))
    records = [
        ("me", InstanceRecord(extra={REGRET: [9, 9, 9, 9]})),  # its own is not a peer's
        ("b", InstanceRecord(extra={REGRET: [1, 0.5, 2, 0]})),
        ("c", InstanceRecord(extra={REGRET: "corrupt"})),  # one bad record adds nothing
        ("d", InstanceRecord()),  # another order, or upstream: no tally
    ]
    assert peer_tallies(records, "me") == [tally((1, 0.5), (2, 0))]
