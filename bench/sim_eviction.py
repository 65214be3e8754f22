"""One cache: meshd's eviction (LRU, GDSF, LRFU, RATE) beside Belady and libCacheSim's algorithms.

    python bench/sim_eviction.py [--models N] [--requests R] [--alpha A]

Equal model sizes, independent Zipf(alpha) requests, 20 % of them warm the cache; prints a
markdown table of hit ratios at 1, 5 and 20 % capacity. Needs `libcachesim` for its rows.
"""

from __future__ import annotations

import argparse
import random

from sim import workloads as w
from sim.__main__ import compare_single
from sim.args import bounded, int_from, positive_int


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=positive_int, default=10_000)
    p.add_argument("--requests", type=int_from(5), default=300_000)  # a fifth of them warm the cache
    p.add_argument("--alpha", type=bounded(0.0, 10.0, "--alpha"), default=1.0)  # as `python -m sim --alpha`
    args = p.parse_args()
    cat = w.catalogue(args.models, random.Random(1), size_sigma=0.0)
    workload = w.zipf(cat, args.requests, args.alpha, 1000.0, seed=1)
    print(compare_single(workload, [0.01, 0.05, 0.2], args.requests // 5))


if __name__ == "__main__":
    main()
