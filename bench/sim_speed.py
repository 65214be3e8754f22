"""How fast the simulator runs meshd's decision code.

    python bench/sim_speed.py [--requests N] [--models M] [--instances K] [--policy NAME]

Defaults: 1,000,000 independent Zipf(1.0) requests at 100 rps over 10,000 models (sizes
log-normal around 64 MiB) on 20 instances holding 20 % of the catalogue between them.
Prints the time to build the trace, the time to simulate it and the run's figures. The
target here (issue "Simulator") is at most 60 s for the simulation; nothing is asserted.
"""

from __future__ import annotations

import argparse
import random
import time

from sim.engine import Fleet, simulate
from sim.policies import POLICIES
from sim.workloads import catalogue, zipf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1_000_000)
    p.add_argument("--models", type=int, default=10_000)
    p.add_argument("--instances", type=int, default=20)
    p.add_argument("--capacity", type=float, default=0.2, help="fleet capacity as a share of the catalogue")
    p.add_argument("--rate", type=float, default=100.0, help="requests per second (virtual)")
    p.add_argument("--policy", choices=sorted(POLICIES), default="upstream")
    args = p.parse_args()
    started = time.perf_counter()
    cat = catalogue(args.models, random.Random(1), size_sigma=0.5)
    workload = zipf(cat, args.requests, 1.0, args.rate, seed=2)
    built = time.perf_counter()
    fleet = Fleet(args.instances, max(1, int(cat.total_units * args.capacity / args.instances)), loading_threads=2)
    result = simulate(workload, fleet, POLICIES[args.policy])
    done = time.perf_counter()
    print(f"trace: {args.requests} requests over {args.models} models built in {built - started:.1f} s")
    print(
        f"simulated {args.requests} requests, {args.instances} instances, policy {args.policy}: "
        f"{done - built:.1f} s ({(done - built) / args.requests * 1e6:.1f} us per request)"
    )
    print(
        f"hit ratio {result.hit_ratio:.3f}, loads {result.loads} ({result.loads_per_min:.0f}/min), "
        f"added latency p99 {result.added_p99_ms:.0f} ms, failed {result.failed}"
    )


if __name__ == "__main__":
    main()
