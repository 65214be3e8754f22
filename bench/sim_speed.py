"""How fast the simulator runs meshd's decision code.

    python bench/sim_speed.py [--requests N] [--models M] [--instances K] [--policy NAME]
                              [--service both|on|off] [--max-concurrency C]

Defaults: 1,000,000 independent Zipf(1.0) requests at 100 rps over 10,000 models (sizes
log-normal around 64 MiB, mean service times log-normal around 10 ms) on 20 instances
holding 20 % of the catalogue between them, each with 4 loading threads, under meshd's
policy (the daemon's default). Simulates the trace without service time (requests take no
time: no completion events) and with it, and prints the time of each, its CPU time, the
run's figures, how many loads waited for a thread, and the load average (the machine is
shared: the wall time stretches with the load, the CPU time much less). The target
(issue 20) is at most 30 s of CPU with service time, on a fleet that keeps up with its
loads (with 2 loading threads, 100 rps queues most loads: added p99 of seconds, upstream's
rules tens of seconds); nothing is asserted. A yardstick runs before and after: the CPU
time of a fixed pure-Python loop, since this shared machine's speed drifts (the same code took
26.0 s, 32.8 s, 35.9 s and 29.4 s of CPU on one day): read a figure against its yardstick.
"""

from __future__ import annotations

import argparse
import os
import random
import time

from sim.args import bounded, non_negative_int, positive_float, positive_int
from sim.engine import Fleet, simulate
from sim.policies import POLICIES
from sim.workloads import catalogue, zipf

YARDSTICK_STEPS = 10_000_000


def yardstick() -> float:
    """CPU seconds of a fixed pure-Python loop: how fast this machine runs Python right now
    (a shared machine's speed drifts, by up to 1.8x measured here)."""
    cpu = time.process_time()
    total = 0
    for i in range(YARDSTICK_STEPS):
        total += i
    return time.process_time() - cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=positive_int, default=1_000_000)
    p.add_argument("--models", type=positive_int, default=10_000)
    p.add_argument("--instances", type=positive_int, default=20)
    p.add_argument(
        "--capacity",
        type=bounded(0.0, 1.0, "--capacity"),
        default=0.2,
        help="fleet capacity as a share of the catalogue",
    )
    p.add_argument("--rate", type=positive_float, default=100.0, help="requests per second (virtual)")
    p.add_argument("--policy", choices=sorted(POLICIES), default="meshd")
    p.add_argument("--loading-threads", type=positive_int, default=4, help="per instance")
    p.add_argument("--service", choices=["both", "on", "off"], default="both", help="simulate service time")
    p.add_argument("--max-concurrency", type=non_negative_int, default=0, help="per copy (0: unlimited)")
    args = p.parse_args()
    started = time.perf_counter()
    cat = catalogue(args.models, random.Random(1), size_sigma=0.5)
    workload = zipf(cat, args.requests, 1.0, args.rate, seed=2)
    print(f"trace: {args.requests} requests over {args.models} models built in {time.perf_counter() - started:.1f} s")
    print(f"yardstick before: {yardstick():.2f} s of CPU for {YARDSTICK_STEPS:,} Python loop steps")
    modes = {"both": [False, True], "on": [True], "off": [False]}[args.service]
    for service in modes:
        fleet = Fleet(
            args.instances,
            max(1, int(cat.total_units * args.capacity / args.instances)),
            loading_threads=args.loading_threads,
            service_time=service,
            max_concurrency=args.max_concurrency,
        )
        load_before = os.getloadavg()[0]
        began, cpu = time.perf_counter(), time.process_time()
        result = simulate(workload, fleet, POLICIES[args.policy])
        took, cpu = time.perf_counter() - began, time.process_time() - cpu
        print(
            f"service time {'on ' if service else 'off'}: {args.requests} requests, {args.instances} instances, "
            f"policy {args.policy}: {took:.1f} s ({took / args.requests * 1e6:.1f} us per request; "
            f"CPU {cpu:.1f} s; load average {load_before:.1f} -> {os.getloadavg()[0]:.1f})"
        )
        print(
            f"  hit ratio {result.hit_ratio:.3f}, loads {result.loads} ({result.loads_per_min:.0f}/min), "
            f"added p99 {result.added_p99_ms:.0f} ms, total p99 {result.total_p99_ms:.0f} ms, "
            f"queued {result.queued}, failed {result.failed}; loads that waited for a thread "
            f"{result.loads_queued / max(1, result.loads):.1%} (wait p99 {result.load_wait_p99_ms:.0f} ms)"
        )
    print(f"yardstick after: {yardstick():.2f} s of CPU")


if __name__ == "__main__":
    main()
