"""Which admission rule under load pressure (issue 24): the simulator on Zipf(0.9) traffic,
meshd's value-ordered load queue with and without the pressure admission test, under GDSF
(FaasCache's Greedy-Dual keep-alive is GDSF with the cold-start cost) and LRU eviction,
beside the first-come queue (meshd before issue 24 and upstream's rules), and meshd's default
(RATE eviction) with both.

    python bench/sim_admission.py [--requests N] [--rates 10,80] [--capacities 0.05,0.1]

Prints one markdown table: hit ratio, added p99 of the hottest 10 % of models, added p99,
failures (and how many came after waiting more than 1 s) per rule, capacity and rate.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import replace

from meshd.decisions.cache import Eviction
from sim import workloads as w
from sim.args import int_from, positive_floats, shares
from sim.engine import Fleet, simulate
from sim.policies import MESHD, MESHD_FIFO, UPSTREAM, Policy

RULES: list[tuple[str, Policy]] = [
    ("upstream (LRU, first-come queue)", UPSTREAM),
    ("meshd-fifo (GDSF, first-come queue)", replace(MESHD_FIFO, eviction=Eviction.GDSF)),
    ("value queue + wait limit, LRU", replace(MESHD, eviction=Eviction.LRU, pressure_admission=False)),
    ("value queue + wait limit + pressure admission, LRU", replace(MESHD, eviction=Eviction.LRU)),
    ("value queue + wait limit, GDSF", replace(MESHD, eviction=Eviction.GDSF, pressure_admission=False)),
    ("value queue + wait limit + pressure admission, GDSF", replace(MESHD, eviction=Eviction.GDSF)),
    ("value queue + wait limit + pressure admission, RATE (meshd)", MESHD),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int_from(5), default=20_000)  # a fifth of them warm the caches
    p.add_argument("--rates", type=positive_floats, default=[10.0, 80.0])
    p.add_argument("--capacities", type=shares, default=[0.05, 0.1])
    args = p.parse_args()
    cat = w.catalogue(2000, random.Random(1), size_sigma=0.5)
    print("| rule | capacity | rate | hit ratio | hot p99 ms | added p99 ms | failed (after waiting) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for share in args.capacities:
        fleet = Fleet(10, max(1, int(cat.total_units * share / 10)), loading_threads=2, seed=1)
        for rate in args.rates:
            wl = w.zipf(cat, args.requests, 0.9, rate, seed=1)
            for name, policy in RULES:
                r = simulate(wl, fleet, policy, args.requests // 5)
                print(
                    f"| {name} | {share:.0%} | {rate:g} | {r.hit_ratio:.3f} | {r.hot_added_p99_ms:.0f} "
                    f"| {r.added_p99_ms:.0f} | {r.failed} ({r.failed_slow}) |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
