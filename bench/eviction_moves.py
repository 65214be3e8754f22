"""How fast the default eviction order moves when the workload changes (issue 44).

    python bench/eviction_moves.py [--seeds 1,2,3] [--capacities 0.1,0.2,0.3] [--requests N]

Runs the simulator's `switching` preset (Zipf for the first half of the requests, then the whole
ranking re-dealt every minute; 2,000 models, 10 rps, 10 instances, 2 loading threads, the first
20 % not counted, as `python -m sim --preset switching`) under `meshd` (rate-capped eviction)
and reads what the daemon's `meshd_eviction_odds_overruled` gauge reads: each cache's share of
recent evictions whose victim RATE's order would have kept (`WeightedLRU.overruled`), at every
admission, averaged over the fleet by minute. Prints one markdown table, a row per capacity and
a cell per seed: the gauge's level over the 10 minutes before the switch -> over the last part
of the run (from 13 minutes after the switch), the minutes after the switch until it has made
half and 90 % of that move, and the fleet's loads in the 10 minutes after the switch against
the same run under RATE (`meshd-rate`).
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections import defaultdict

from meshd.decisions.cache import WeightedLRU
from sim import workloads as w
from sim.args import int_from
from sim.engine import Fleet, simulate
from sim.policies import MESHD, MESHD_RATE

INSTANCES = 10
SETTLED_AFTER_MIN = 13  # the "after" level: from this many minutes past the switch
BEFORE_MIN = 10  # the "before" level: over this many minutes before it


def _gauge_by_minute(workload: w.Workload, capacity: int, seed: int) -> tuple[dict[int, float], list[int]]:
    """The fleet's mean `overruled` by minute of the trace, and loads per counted minute."""
    seen: dict[int, dict[int, float]] = defaultdict(dict)
    admit = WeightedLRU.admit
    start: dict[str, int] = {}

    def watched(self: WeightedLRU, model_id: str, units: int, last_used_ms: int, now_ms: int, *a, **k):  # type: ignore[no-untyped-def]
        out = admit(self, model_id, units, last_used_ms, now_ms, *a, **k)
        if self.overruled is not None:
            origin = start.setdefault("ms", now_ms)
            seen[int((now_ms - origin) // 60_000)][id(self)] = self.overruled
        return out

    WeightedLRU.admit = watched  # type: ignore[method-assign]
    try:
        result = simulate(workload, Fleet(INSTANCES, capacity, loading_threads=2, seed=seed), MESHD, len(workload) // 5)
    finally:
        WeightedLRU.admit = admit  # type: ignore[method-assign]
    return {m: statistics.fmean(v.values()) for m, v in seen.items()}, result.loads_per_minute


def cell(seed: int, share: float, requests: int) -> str:
    cat = w.with_load_speed(w.catalogue(2000, random.Random(seed), size_sigma=0.5), 1000.0 / w.LOAD_MS_PER_MIB)
    workload = w.switching(cat, requests, 1.0, 10.0, seed)
    capacity = max(1, int(cat.total_units * share / INSTANCES))
    times = workload.times_ms
    switch_min = (times[requests // 2] - times[0]) / 60_000
    gauge, loads = _gauge_by_minute(workload, capacity, seed)
    rate_loads = simulate(
        workload, Fleet(INSTANCES, capacity, loading_threads=2, seed=seed), MESHD_RATE, len(workload) // 5
    ).loads_per_minute
    first = int(switch_min)
    before = statistics.fmean(gauge.get(m, 0.0) for m in range(max(0, first - BEFORE_MIN), first))
    after_minutes = [v for m, v in gauge.items() if m >= first + SETTLED_AFTER_MIN]
    if not after_minutes:
        return "too short"
    after = statistics.fmean(after_minutes)

    def reached(part: float) -> str:
        goal = before + part * (after - before)
        up = after >= before
        for m in range(first, max(gauge) + 1):
            if m in gauge and (gauge[m] >= goal if up else gauge[m] <= goal):
                return f"{max(0.0, m - switch_min):.0f}"
        return "-"

    # loads_per_minute starts at the first counted minute (the warm-up's end, a fifth in)
    counted_from = int((times[len(workload) // 5] - times[0]) / 60_000)
    k = first - counted_from
    mine, rate = sum(loads[k : k + 10]), sum(rate_loads[k : k + 10])
    change = f"{100 * (mine - rate) / rate:+.1f} %" if rate else "-"
    return f"{before:.2f} -> {after:.2f}; {reached(0.5)} / {reached(0.9)} min; {change}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1,2,3", help="comma-separated")
    p.add_argument("--capacities", default="0.1,0.2,0.3", help="fleet capacity, share of the catalogue")
    p.add_argument("--requests", type=int_from(1000), default=50_000)
    args = p.parse_args()
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
        shares = [float(x) for x in args.capacities.split(",") if x.strip()]
    except ValueError as e:
        p.error(f"--seeds and --capacities take comma-separated numbers: {e}")
    if not seeds or not shares or not all(0 < s <= 1 for s in shares):
        p.error("--seeds needs one seed at least, --capacities shares in (0, 1]")
    print("| capacity | " + " | ".join(f"seed {s}" for s in seeds) + " |")
    print("| ---: | " + " | ".join("---" for _ in seeds) + " |")
    for share in shares:
        print(f"| {share:.0%} | " + " | ".join(cell(s, share, args.requests) for s in seeds) + " |", flush=True)


if __name__ == "__main__":
    main()
