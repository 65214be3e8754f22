"""The latency target's trade-off (issue 33, MESHD_LATENCY_TARGET_MS): the simulator's zipf
preset (Zipf(1.0) over 2,000 models, log-normal sizes, loads 0.5 s + size at 200 MiB/s, 10
instances, 2 loading threads), meshd with each target against upstream: loads, added p99,
added p99 of the hottest 10 % of models, mean added latency.

    python bench/sim_latency_target.py [--targets 0,2000,1500,1200,1000,800] [--capacities 0.1,0.2,0.3]

Prints one markdown table (target 0: none, meshd's default).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import replace

from sim import workloads as w
from sim.args import int_from, shares
from sim.engine import Fleet, simulate
from sim.policies import MESHD, UPSTREAM


def targets(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"targets are whole milliseconds, comma-separated (got {text!r})") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"targets are 0 (none) or more milliseconds (got {text!r})")
    return values


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", type=targets, default=[0, 2000, 1500, 1200, 1000, 800])
    p.add_argument("--capacities", type=shares, default=[0.1, 0.2, 0.3])
    p.add_argument("--requests", type=int_from(5), default=50_000)  # a fifth of them warm the caches
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    cat = w.with_load_speed(w.catalogue(2000, random.Random(args.seed), size_sigma=0.5), 200.0)
    wl = w.zipf(cat, args.requests, 1.0, 10.0, seed=args.seed)
    print("| capacity | policy | target ms | loads | against upstream | added p99 ms | hot p99 ms | mean ms |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for share in args.capacities:
        fleet = Fleet(10, max(1, int(cat.total_units * share / 10)), loading_threads=2, seed=args.seed)
        base = simulate(wl, fleet, UPSTREAM, args.requests // 5)
        runs = [("upstream", 0, base)]
        for t in args.targets:
            runs.append(("meshd", t, simulate(wl, fleet, replace(MESHD, latency_target_ms=t), args.requests // 5)))
        for name, target, r in runs:
            print(
                f"| {share:.0%} | {name} | {target or '-'} | {r.loads} | {100 * (r.loads / base.loads - 1):+.1f} % "
                f"| {r.added_p99_ms:.0f} | {r.hot_added_p99_ms:.0f} | {r.added_mean_ms:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
