"""The peers bench's traces replayed without processes (issue 36): what each eviction order
loads on the very request order `bench/peers.py` sends, so a system's loads there can be read
against its policy rather than its machinery.

    python bench/peers_replay.py [--rate 50] [--seeds 3]
                                 [--models N] [--cache-models K] [--requests R] [--warmup W] [--zipf S] [--seed X]

The workload flags are bench/peers.py's, with its defaults: the same models and traces.
Two kinds of replay, each over the warm-up, then the zipf trace, then the shift trace (as
peers.py sends them to one running system); loads of the warm-up are not counted:
- the simulator (sim.engine: meshd's own placement, load queue and cache code) at `--rate`
  requests per second, open loop (peers.py keeps 16 in flight; both systems ran it at
  50-85 req/s), 3 instances of K models, one loading thread each, the models' own load and
  service times: `meshd` (rate-capped, the default), `meshd rate` (MESHD_EVICTION=rate), `meshd
  lru` (MESHD_EVICTION=lru), `meshd adaptive` (MESHD_EVICTION=adaptive), `upstream`;
- order only, no time: an LRU of K models per serving process, each miss on a random one
  (Ray Serve's multiplexing: `max_num_models_per_replica` per replica, least recently used
  out first), and one LRU of 3K models (the whole capacity as one cache).
Prints one markdown table: loads per trace, the mean and range over `--seeds`.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import tempfile
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import peers  # bench/ is on sys.path when run as a script

from meshd.decisions.cache import Eviction, to_units
from meshd.runtimes.models import DemoModel
from sim.args import non_negative_float, positive_float, positive_int
from sim.engine import Fleet, simulate
from sim.policies import MESHD, UPSTREAM, as_configured
from sim.workloads import Catalogue, Workload

PROCESSES = peers.PROCESSES
TRACES = ("zipf", "shift")
Replay = Callable[[list[list[str]], dict[str, DemoModel], int, int], list[int]]


def sim_replay(policy_name: str, rate_rps: float) -> Replay:
    policy = {
        "meshd": MESHD,
        "meshd lru": as_configured(Eviction.LRU),
        "meshd adaptive": as_configured(Eviction.ADAPTIVE),
        "meshd rate": as_configured(Eviction.RATE),
        "upstream": UPSTREAM,
    }[policy_name]

    def replay(phases: list[list[str]], models: dict[str, DemoModel], per_process: int, seed: int) -> list[int]:
        ids = list(models)
        index = {m: i for i, m in enumerate(ids)}
        units = [to_units(models[m].size_bytes or 0) for m in ids]
        catalogue = Catalogue(
            tuple(ids), tuple(units), tuple(models[m].load_ms for m in ids), tuple(models[m].service_ms for m in ids)
        )
        fleet = Fleet(
            PROCESSES,
            per_process * round(statistics.fmean(units)),
            loading_threads=1,
            default_model_units=round(statistics.fmean(units)),
            seed=seed,
        )
        # Loads after each phase: one replay per prefix (a replay cannot pause), differences.
        totals, sent = [], []
        for phase in phases:
            sent += phase
            times = array("q", (int(i * 1000 / rate_rps) for i in range(len(sent))))
            workload = Workload("peers", catalogue, times, array("q", (index[m] for m in sent)))
            ingress = [i % PROCESSES for i in range(len(sent))]  # peers.py: round-robin over instances
            totals.append(simulate(workload, fleet, policy, ingress=ingress).loads)
        return [b - a for a, b in itertools.pairwise(totals)]

    return replay


def lru_replay(caches: int) -> Replay:
    def replay(phases: list[list[str]], models: dict[str, DemoModel], per_process: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        held: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(caches)]
        capacity = per_process * PROCESSES // caches
        out = []
        for phase in phases:
            loads = 0
            for m in phase:
                holder = next((c for c in held if m in c), None)
                if holder is not None:
                    holder.move_to_end(m)
                    continue
                loads += 1
                cache = rng.choice(held)
                cache[m] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
            out.append(loads)
        return out[1:]

    return replay


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=positive_float, default=50.0, help="requests per second in the simulator (50)")
    p.add_argument("--seeds", type=positive_int, default=3, help="replays of each kind (3)")
    p.add_argument("--models", type=positive_int, default=300)
    p.add_argument("--cache-models", type=positive_int, default=16)
    p.add_argument("--requests", type=positive_int, default=2000)
    p.add_argument("--warmup", type=positive_int, default=500)
    p.add_argument("--zipf", type=non_negative_float, default=1.0)
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workload_args = peers.parse_args(
        [
            *("--models", str(args.models), "--cache-models", str(args.cache_models)),
            *("--requests", str(args.requests), "--warmup", str(args.warmup), "--kill-requests", "0"),
            *("--zipf", str(args.zipf), "--seed", str(args.seed)),
        ]
    )
    with tempfile.TemporaryDirectory(prefix="peers-replay-") as tmp:
        workload = peers.build_workload(Path(tmp), workload_args)
    phases = [[p.model_id for p in workload.warmup], *([p.model_id for p in workload.traces[t]] for t in TRACES)]
    replays: dict[str, Replay] = {
        "simulator: meshd (rate-capped)": sim_replay("meshd", args.rate),
        "simulator: meshd rate": sim_replay("meshd rate", args.rate),
        "simulator: meshd lru": sim_replay("meshd lru", args.rate),
        "simulator: meshd adaptive": sim_replay("meshd adaptive", args.rate),
        "simulator: upstream": sim_replay("upstream", args.rate),
        f"order only: LRU of {args.cache_models} per process, misses anywhere (Ray's multiplexing)": lru_replay(
            PROCESSES
        ),
        f"order only: one LRU of {PROCESSES * args.cache_models}": lru_replay(1),
    }
    print(
        f"{args.models} models, {PROCESSES} serving processes x {args.cache_models}, warm-up {args.warmup}, "
        f"{args.requests} per trace, zipf {args.zipf:g}, seed {args.seed}; simulator at {args.rate:g} req/s, "
        f"one loading thread per process; {args.seeds} replays each (mean, min-max)\n"
    )
    print("| replay | " + " | ".join(f"{t} loads" for t in TRACES) + " |")
    print("|---|" + "---|" * len(TRACES))
    for name, replay in replays.items():
        runs = [replay(phases, workload.models, args.cache_models, seed) for seed in range(1, args.seeds + 1)]
        cells = []
        for i in range(len(TRACES)):
            values = [r[i] for r in runs]
            cells.append(f"{statistics.fmean(values):.0f} ({min(values)}-{max(values)})")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
