"""The adaptive eviction order's choice (issue 44), pure: which of two orders, RATE's or
recency's, the fleet's caches follow, learnt from what the fleet does after real evictions.

Each eviction notes which order chose its victim and the fleet clock then (the model's record
carries the note, `meshdEvictedBy`). When any instance loads that model again within one
turnover of its cache, the order that evicted it is charged `REGRET_FLOOR ** age` (age in
turnovers: 1 when it comes straight back, 0.005 a turnover later; LeCaR's discount). Each
instance keeps its own evictions and charges per order, decayed, and publishes them
(`meshdRegret`); every instance sums the fleet's and follows the order whose regret per
eviction is lower: recency only once its rate, plus one standard error of its charges, is
`TO_RECENCY` of RATE's or less (RATE needs more than chance: it is the better order on most
workloads measured, docs/policies.md). To keep learning about the order it does not follow,
one admission in `EXPLORE_EVERY` evicts by it.

Why the fleet's and not each instance's: every signal measured on one instance's view (shadow
caches of its capacity, fed what it serves or what reaches it) misjudged the fleet; a model
evicted here and loaded there is the fleet's miss, and only records see it (docs/policies.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from meshd.core.records import EVICTION_ORDERS, InstanceRecord, regret_reading

RATE, RECENCY = 0, 1
ORDERS = EVICTION_ORDERS  # as the record's note names them, in this order
REGRET_FLOOR = 0.005  # a reload one turnover after the eviction charges this (LeCaR's discount)
# The tallies forget over about this many of the fleet's evictions (each instance's decay per
# own eviction is fleet_size / this): enough evictions that the few exploring ones (1 in
# EXPLORE_EVERY: 25 here) tell something, recent enough to follow a workload that changes.
REGRET_MEMORY_EVICTIONS = 5000.0
# Measured (simulator, seed 1, docs/policies.md): exploring 1 in 50 admissions cost 0.007 of hit
# ratio on new-models at 5 %, 1 in 200 cost 0.002; 1 in 200 still found recency on `switching`.
EXPLORE_EVERY = 200
# Follow recency once its regret per eviction is at most TO_RECENCY of RATE's, counting
# Z_TO_RECENCY standard errors of its charges against it (a count's, sqrt: at least 1). Without
# them one cache of `new-models` at 10 % (simulator, seed 1) followed recency on the noise of
# about 20 exploring evictions, and stayed: while it follows recency the clock runs faster
# (more evictions), so its own reloads look older and cheaper. Hit ratio 0.652 against RATE's
# 0.707; with one standard error 0.707 (docs/policies.md).
Z_TO_RECENCY = 1.0
TO_RECENCY = 0.8
MIN_EVICTIONS = 4.0  # an order's rate counts once the fleet's tallies hold this many of its evictions


@dataclass(frozen=True, slots=True)
class Tally:
    """Decayed evictions and charges per order (RATE's, recency's), as a record carries them."""

    evictions: tuple[float, float] = (0.0, 0.0)
    charges: tuple[float, float] = (0.0, 0.0)

    def as_list(self) -> list[float]:
        ev, ch = self.evictions, self.charges
        return [round(v, 4) for v in (ev[RATE], ch[RATE], ev[RECENCY], ch[RECENCY])]

    @classmethod
    def from_list(cls, raw: Sequence[float]) -> Tally:
        return cls((raw[0], raw[2]), (raw[1], raw[3]))


class Regret:
    """One instance's part: its evictions by order, the charges for reloads it made, and which
    of its admissions explore."""

    def __init__(self, explore_every: int = EXPLORE_EVERY) -> None:
        self.explore_every = explore_every
        self._evictions = [0.0, 0.0]
        self._charges = [0.0, 0.0]
        self._admissions = 0

    def explore(self) -> bool:
        """Whether this admission (one that evicts) evicts by the order not followed."""
        self._admissions += 1
        return self._admissions % self.explore_every == 0

    def explores_next(self) -> bool:
        """What `explore` will say next, changing nothing."""
        return (self._admissions + 1) % self.explore_every == 0

    def evicted(self, order: int, fleet_size: int) -> None:
        keep = max(0.0, 1.0 - max(1, fleet_size) / REGRET_MEMORY_EVICTIONS)
        for tallies in (self._evictions, self._charges):
            tallies[0] *= keep
            tallies[1] *= keep
        self._evictions[order] += 1.0

    def reloaded(self, order: int, age_turnovers: float) -> float:
        """A model evicted by `order` `age_turnovers` ago is loaded here: the charge (0 when it
        was evicted more than a turnover ago, or "after" now: a peer's clock a little ahead)."""
        age = max(0.0, age_turnovers)
        if age >= 1.0:
            return 0.0
        charge: float = REGRET_FLOOR**age
        self._charges[order] += charge
        return charge

    def tally(self) -> Tally:
        return Tally((self._evictions[0], self._evictions[1]), (self._charges[0], self._charges[1]))


def peer_tallies(records: Iterable[tuple[str, InstanceRecord]], self_id: str) -> list[Tally]:
    """Each other instance's published tally (those without one, or with a malformed one, add
    nothing: upstream instances, other orders)."""
    out = []
    for iid, rec in records:
        reading = regret_reading(rec.extra) if iid != self_id else None
        if reading is not None:
            out.append(Tally.from_list(reading))
    return out


def fleet_order(own: Regret, peers: Iterable[Tally]) -> int:
    """The order this instance follows: the fleet's, from its own tally and its peers'."""
    return follow(fleet_tally([own.tally(), *peers]))


def fleet_tally(tallies: Iterable[Tally]) -> Tally:
    ev = [0.0, 0.0]
    ch = [0.0, 0.0]
    for t in tallies:
        for i in (RATE, RECENCY):
            ev[i] += t.evictions[i]
            ch[i] += t.charges[i]
    return Tally((ev[0], ev[1]), (ch[0], ch[1]))


def follow(fleet: Tally) -> int:
    """The order the fleet's tallies say to follow: recency only when it has evicted enough to
    judge and its regret per eviction, one standard error of its charges above, is at most
    `TO_RECENCY` of RATE's."""
    ev, ch = fleet.evictions, fleet.charges
    if ev[RECENCY] < MIN_EVICTIONS or ev[RATE] < MIN_EVICTIONS:
        return RATE
    rate_regret = ch[RATE] / ev[RATE]
    recency_regret = (ch[RECENCY] + Z_TO_RECENCY * math.sqrt(max(ch[RECENCY], 1.0))) / ev[RECENCY]
    return RECENCY if recency_regret <= TO_RECENCY * rate_regret and rate_regret > 0.0 else RATE
