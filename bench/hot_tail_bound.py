"""What issue 24's "hottest 10 % of models under 1 s at p99" asks of the cache, on the sweep's
own catalogue and trace, with a clairvoyant static allocation and every load starting at once.

    python bench/hot_tail_bound.py [--requests N] [--capacities 0.05,0.1] [--alpha 0.9]

Per capacity, two allocations of the whole fleet's memory, both knowing every model's request
count in advance, both leaving no room for the loads of anything else (so both flatter any
real cache):
- *popular first*: models by requests per unit of memory (the best static hit ratio);
- *slow loads first*: first every hot model whose load alone takes over 1 s, then as above.
For each it prints the request hit ratio and the share of the hot models' requests that must
load for over 1 s. A hot p99 under 1 s needs that share under 1 %, before any wait for a
loading thread.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterable, Sequence

from sim import workloads as w
from sim.args import bounded, int_from, positive_int
from sim.args import shares as shares_of_catalogue

SLOW_LOAD_MS = 1_000.0  # the issue's bar for the hot models' added p99
HOT_SHARE = 0.1  # the hottest tenth of the models, by requests in the trace


def fill(order: Iterable[int], units: Sequence[int], capacity: int) -> set[int]:
    """Models taken in `order` while they fit in `capacity` units (smaller ones further down
    still go in when a big one does not fit)."""
    held: set[int] = set()
    used = 0
    for m in order:
        if used + units[m] <= capacity:
            held.add(m)
            used += units[m]
    return held


def measure(held: set[int], counts: Sequence[int], hot: set[int], load_ms: Sequence[float]) -> tuple[float, float]:
    """(request hit ratio, share of hot requests that must load for over SLOW_LOAD_MS)."""
    total = sum(counts)
    hot_total = sum(counts[m] for m in hot)
    hits = sum(counts[m] for m in held)
    slow = sum(counts[m] for m in hot if m not in held and load_ms[m] > SLOW_LOAD_MS)
    return hits / total, slow / hot_total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=positive_int, default=100_000)
    p.add_argument("--capacities", type=shares_of_catalogue, default=[0.05, 0.1])
    p.add_argument("--alpha", type=bounded(0.0, 10.0, "--alpha"), default=0.9)  # as `python -m sim --alpha`
    p.add_argument("--models", type=int_from(10), default=2000)
    args = p.parse_args()
    cat = w.catalogue(args.models, random.Random(1), size_sigma=0.5)
    wl = w.zipf(cat, args.requests, args.alpha, 10.0, seed=1)
    counts = [0] * len(cat.ids)
    for m in wl.models:
        counts[m] += 1
    by_count = sorted(range(len(counts)), key=lambda m: -counts[m])
    hot = set(by_count[: max(1, len(counts) // int(1 / HOT_SHARE))])
    hot_units = sum(cat.units[m] for m in hot)
    slow_hot = [m for m in hot if cat.load_ms[m] > SLOW_LOAD_MS]
    slow_share = sum(counts[m] for m in slow_hot) / sum(counts[m] for m in hot)
    print(
        f"Zipf({args.alpha:g}), {args.requests} requests over {len(cat)} models (the sweep's catalogue): the hottest "
        f"{len(hot)} models take {len(slow_hot)} loads over 1 s ({slow_share:.1%} of their requests)\n"
    )
    print("| capacity | hot set / fleet memory | allocation | hit ratio | hot requests loading > 1 s |")
    print("| ---: | ---: | --- | ---: | ---: |")
    density = sorted(range(len(counts)), key=lambda m: -counts[m] / cat.units[m])
    for share in args.capacities:
        capacity = int(cat.total_units * share)
        allocations = {
            "popular first": fill(density, cat.units, capacity),
            "slow loads first": fill([*sorted(slow_hot, key=lambda m: -counts[m]), *density], cat.units, capacity),
        }
        for name, held in allocations.items():
            ratio, slow = measure(held, counts, hot, cat.load_ms)
            print(f"| {share:.0%} | {hot_units / capacity:.2f} | {name} | {ratio:.3f} | {slow:.2%} |")


if __name__ == "__main__":
    main()
