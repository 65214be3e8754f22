"""The fleet's shared cache clock (issue 33), pure.

RATE values a copy by its uses per turnover of the cache and forgets it over turnovers. With
each instance's own turnover as the clock, an instance that evicts much runs fast, and two
instances' values (or one's use history read by another) are not on one scale. The fleet
clock counts every instance's evictions, in units per instance: each instance advances its
clock by its own evictions at once and by its peers' as their records report their
cumulative count (`meshdEvicted`), so every clock moves with the same events, a couple of
seconds apart. An instance that joins a running fleet starts from its peers' clock
(`meshdClock`, their median). A model's recent uses travel in its record on this clock (`meshdUses`).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from meshd.core.records import InstanceRecord, fleet_reading


@dataclass(frozen=True, slots=True)
class Step:
    fleet_size: int  # instances sharing the clock, this one included
    advance: float  # peers' evictions since the last step, in units per instance
    floor: float = 0.0  # the clock is at least this (joining a running fleet)


class FleetClock:
    """What one instance has seen of its peers' eviction counts, step by step."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}
        self._joined = False

    def step(self, peers: Mapping[str, tuple[int, float]]) -> Step:
        """`peers`: each other live instance's (units evicted, clock) as its record says. A peer
        seen for the first time adds nothing (its past evictions predate this instance's view,
        or are in the clock it reports); a count that went down is a restart (all of it is new)."""
        size = len(peers) + 1
        fresh = 0
        for iid, (evicted, _) in peers.items():
            before = self._seen.get(iid)
            if before is not None:
                fresh += evicted - before if evicted >= before else evicted
        floor = 0.0
        if not self._joined and peers:
            # The peers' median, not their largest: one record with a wild clock (another
            # tool's write) must not throw a joining instance's clock far ahead of the fleet.
            floor = statistics.median_high(clock for _, clock in peers.values())
            self._joined = True
        self._seen = {iid: evicted for iid, (evicted, _) in peers.items()}
        return Step(size, fresh / size, floor)


def peer_readings(records: Iterable[tuple[str, InstanceRecord]], self_id: str) -> dict[str, tuple[int, float]]:
    """Each other meshd instance's (units evicted, clock) from the instances' records. Upstream
    instances keep no such clock: they are not counted in the fleet that shares it."""
    return {iid: fleet_reading(rec.extra) for iid, rec in records if iid != self_id and not rec.upstream}
