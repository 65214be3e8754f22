"""The policies the simulator compares: which of meshd's decisions each one switches on.

- `upstream`: ModelMesh's defaults: weighted LRU eviction, PLACEMENT_ORDER ranking with the
  near-best random pick (CacheMissForwardingLB), upstream's copy scaling.
- `meshd`: meshd's own choices: rate-capped eviction (each copy's recent request rate per unit
  and second of reload, weighed by the odds that a silent model's rate still holds,
  `meshd.decisions.cache`; RATE alone until 2026-11-30),
  and the placement spread of recent loads (`RecentPlacements`) on top of upstream's ranking.
  And the load queue of `meshd.decisions.placement.loading` (issue 24): room taken when a load
  starts, the most valuable load first, misses beyond load capacity refused at once. And the
  fleet clock (`meshd.decisions.fleet_clock`, issue 33): every cache's clock counts the fleet's
  evictions, and a model's recent uses travel in its record to the next instance that loads it.
  And placement by price (`meshd.decisions.placement.rank.cheapest`, issue 33): a load goes to
  one of the three instances, where it starts soonest, whose next victim is worth least, and
  stays there only if that is still so when it arrives.
- `meshd-unpriced`: `meshd` without placement by price (meshd before it, until 2026-11-27; RATE
  eviction, as then).
- `meshd-own-clock`: `meshd` before issue 33 (RATE eviction): each cache's clock runs with its own evictions,
  and a model's use history stays with the instance that evicted it.
- `meshd-adaptive`: `meshd` with ADAPTIVE eviction (RATE's order or recency's, whichever the
  fleet regrets less: evicted models that any instance reloads within a turnover, each charged
  to the order that evicted it, through the records; issue 44).
- `meshd-rate`: `meshd` with RATE eviction (`MESHD_EVICTION=rate`: the rate without the odds;
  meshd's default from 2026-11-26 until 2026-11-30).
- `meshd-gdsf`: `meshd` with GDSF eviction (meshd's default before LRFU: counts that never decay).
- `meshd-lrfu`: `meshd` with LRFU eviction (recent uses, halved every two turnovers: meshd's
  default from 2026-11-26 until RATE, the same day).
- `meshd-fifo`: meshd before issue 24: GDSF eviction and upstream's first-come load queue.
- `random`: a load goes to a uniformly random instance that could hold it (LRU eviction):
  the floor any placement policy should beat.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshd.decisions.cache import Eviction


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    eviction: Eviction = Eviction.LRU
    random_placement: bool = False
    spread_recent_loads: bool = False  # LoadRequest.recent_placements
    copy_scaling: bool = True
    load_queue: bool = False  # meshd.decisions.placement.loading: value-ordered queue, room at start, fast refusal
    pressure_admission: bool = True  # with load_queue: under pressure, a colder miss evicts nothing (refused)
    fleet_clock: bool = False  # meshd.decisions.fleet_clock: one cache clock for the fleet, use histories in records
    by_price: bool = True  # with load_queue: placement by price (placement.rank.cheapest, stays)
    latency_target_ms: float = 0.0  # MESHD_LATENCY_TARGET_MS (0: none)


UPSTREAM = Policy("upstream")
MESHD = Policy("meshd", eviction=Eviction.CAPPED, spread_recent_loads=True, load_queue=True, fleet_clock=True)
# meshd before placement by price (issue 33): the fleet clock, loads placed without prices.
MESHD_UNPRICED = Policy(
    "meshd-unpriced",
    eviction=Eviction.RATE,
    spread_recent_loads=True,
    load_queue=True,
    fleet_clock=True,
    by_price=False,
)
# meshd before issue 33: each instance's clock runs with its own evictions; no use histories;
# no placement by price.
MESHD_OWN_CLOCK = Policy(
    "meshd-own-clock", eviction=Eviction.RATE, spread_recent_loads=True, load_queue=True, by_price=False
)
MESHD_GDSF = Policy("meshd-gdsf", eviction=Eviction.GDSF, spread_recent_loads=True, load_queue=True)
MESHD_LRFU = Policy("meshd-lrfu", eviction=Eviction.LRFU, spread_recent_loads=True, load_queue=True)
MESHD_ADAPTIVE = Policy(
    "meshd-adaptive", eviction=Eviction.ADAPTIVE, spread_recent_loads=True, load_queue=True, fleet_clock=True
)
MESHD_RATE = Policy("meshd-rate", eviction=Eviction.RATE, spread_recent_loads=True, load_queue=True, fleet_clock=True)
MESHD_FIFO = Policy("meshd-fifo", eviction=Eviction.GDSF, spread_recent_loads=True)  # meshd before issue 24
RANDOM = Policy("random", random_placement=True)

_ALL = (
    UPSTREAM,
    MESHD,
    MESHD_ADAPTIVE,
    MESHD_RATE,
    MESHD_UNPRICED,
    MESHD_OWN_CLOCK,
    MESHD_LRFU,
    MESHD_GDSF,
    MESHD_FIFO,
    RANDOM,
)
POLICIES = {p.name: p for p in _ALL}


def as_configured(eviction: Eviction, load_queue: bool = True) -> Policy:
    """What `meshd serve` runs with `MESHD_EVICTION=<eviction>` (and `MESHD_LOAD_QUEUE=value`,
    the default, or `fifo`): the router always spreads recent loads."""
    name = f"meshd serve ({eviction.value}{'' if load_queue else ', fifo'})"
    return Policy(name, eviction=eviction, spread_recent_loads=True, load_queue=load_queue, fleet_clock=True)


def parse_policies(text: str) -> list[Policy]:
    """`upstream,meshd` -> the policies; ValueError naming the unknown one."""
    out: list[Policy] = []
    for name in (x.strip() for x in text.split(",")):
        if not name:
            continue
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
        out.append(POLICIES[name])
    if not out:
        raise ValueError("no policy given")
    return out
