"""`python -m sim`: compare placement policies on a preset workload or a CSV trace.

    python -m sim                                  # every preset, every policy, three capacities
    python -m sim --preset zipf --policies upstream,meshd --capacities 0.05,0.1,0.2
    python -m sim --trace requests.csv --instances 3  # replay (format: sim/workloads.py)
    python -m sim --azure ../shared/traces/azure-functions-2019 --azure-windows all,1,2,3,4  # sim/azure.py
    python -m sim --preset zipf --compare-libcachesim  # one cache: meshd vs libCacheSim's algorithms
    python -m sim --preset bursts --max-concurrency 4  # copies serve 4 at a time, the rest queue
    python -m sim --preset zipf --alpha 0.9 --rates 10,20,40,80  # the knee: hit ratio, hot p99, failures by rate
    python -m sim --preset large-models --client-timeout-s 600  # big models on 3 instances, clients that wait
    python -m sim --preset zipf --pull-mib-per-s 500 --disk-tier 0,4  # loads pull first; a disk tier 4x the cache
    python -m sim llm                              # copies of one LLM routed by load and prefix (sim/llm.py)

Prints markdown tables and writes them, with PNG plots (when matplotlib is installed), to
--out (default results/). Bad arguments end with a one-line error and exit status 2.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from meshd.decisions.cache import Eviction
from sim import azure, llm, report, single
from sim import workloads as w
from sim.args import (
    bounded,
    non_negative_float,
    non_negative_floats,
    non_negative_int,
    positive_float,
    positive_floats,
    positive_int,
    shares,
    whole,
)
from sim.engine import Fleet, Result, simulate
from sim.policies import POLICIES, Policy, parse_policies

PRESETS: dict[str, Callable[[w.Catalogue, int, float, float, int], w.Workload]] = {
    "zipf": lambda c, n, a, r, s: w.zipf(c, n, a, r, seed=s),
    "shifting": lambda c, n, a, r, s: w.shifting(c, n, a, r, seed=s),
    "bursts": lambda c, n, a, r, s: w.bursts(c, n, a, r, seed=s),
    "daily": lambda c, n, a, r, s: w.daily(c, n, a, r, seed=s),
    "new-models": lambda c, n, a, r, s: w.new_models(c, n, a, r, seed=s),
    "switching": lambda c, n, a, r, s: w.switching(c, n, a, r, seed=s),
    # Its own catalogue and arrival rate (sim.workloads.large_models): --models, --rate and the
    # size and load-speed options do not apply.
    "large-models": lambda c, n, a, r, s: w.large_models(n, a, seed=s),
}
# A preset's fleet where the command line names none: large-models is issue 33's held-back
# trace in shape, which was measured on 3 instances.
PRESET_INSTANCES = {"large-models": 3}
DEFAULT_INSTANCES = 10


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sim", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "--preset",
        type=presets,
        default=list(PRESETS),
        help=f"synthetic workloads, comma-separated, or 'all' (default): {', '.join(PRESETS)}",
    )
    p.add_argument("--trace", type=Path, help="replay a CSV trace instead of a preset")
    p.add_argument(
        "--azure", type=Path, metavar="DIR", help="replay the Azure Functions 2019 trace in DIR (sim/azure.py)"
    )
    p.add_argument(
        "--azure-windows",
        type=windows,
        default=[0],
        help="with --azure: comma-separated windows, 'all' (the whole trace) or N (its N-th 3-hour window)",
    )
    p.add_argument(
        "--policies",
        default="upstream,meshd,random",
        help=f"comma-separated: {', '.join(POLICIES)}",
    )
    p.add_argument("--capacities", type=shares, default=[0.1, 0.2, 0.3], help="fleet capacity, share of catalogue")
    p.add_argument(
        "--instances",
        type=positive_int,
        help=f"default {DEFAULT_INSTANCES} (large-models: {PRESET_INSTANCES['large-models']})",
    )
    p.add_argument("--loading-threads", type=positive_int, default=2)
    p.add_argument("--models", type=positive_int, default=2000)
    p.add_argument("--requests", type=positive_int, default=50_000)
    p.add_argument("--rate", type=positive_float, default=10.0, help="requests per second (virtual)")
    p.add_argument(
        "--rates",
        type=positive_floats,
        help="a rate sweep: hit ratio, added p99 of the hottest 10 %% of models and failures at each rate",
    )
    p.add_argument(
        "--load-mib-per-s",
        type=positive_float,
        default=1000.0 / w.LOAD_MS_PER_MIB,
        help="presets and --azure: load speed after the fixed 500 ms start-up (default 200 MiB/s)",
    )
    p.add_argument(
        "--alpha", type=bounded(0.0, 10.0, "--alpha"), default=1.0, help="Zipf exponent of popularity (0, 10]"
    )
    p.add_argument(
        "--size-sigma",
        type=bounded(0.0, 3.0, "--size-sigma", include_low=True),
        default=0.5,
        help="log-normal sigma of model sizes, 0-3 (0: equal)",
    )
    p.add_argument(
        "--service-ms",
        type=non_negative_float,
        default=w.DEFAULT_SERVICE_MS,
        help="presets: median of the models' mean service times (traces: their latency_ms column)",
    )
    p.add_argument(
        "--service-jitter", type=non_negative_float, default=0.5, help="log-normal sigma per request (0: the mean)"
    )
    p.add_argument("--no-service-time", action="store_true", help="requests take no time on the runtime")
    p.add_argument(
        "--max-concurrency", type=non_negative_int, default=0, help="requests a copy serves at once (0: unlimited)"
    )
    p.add_argument(
        "--max-queue", type=whole, default=0, help="requests that may wait per limited copy (0: auto, <0: unbounded)"
    )
    p.add_argument(
        "--client-timeout-s",
        type=non_negative_float,
        default=0.0,
        help="each request's deadline after it arrives (0: none); late: answered after it",
    )
    p.add_argument(
        "--pull-mib-per-s",
        type=non_negative_float,
        default=0.0,
        help="a load first pulls its model's files from the store at this speed (0: pulls not modelled)",
    )
    p.add_argument(
        "--disk-tier",
        type=non_negative_floats,
        default=[0.0],
        help="each instance's disk tier for pulled files, in multiples of its cache capacity; "
        "several: a row each (0: none, every load pulls)",
    )
    p.add_argument("--warmup", type=float, default=0.2, help="share of requests not counted (cache filling)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("results"))
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--compare-libcachesim",
        action="store_true",
        help="also run one cache over the stream: meshd's LRU and GDSF, Belady, libCacheSim's algorithms",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    if words[:1] == ["llm"]:  # copies of one language model (sim/llm.py): a command of its own
        return llm.main(words[1:])
    p = parser()
    args = p.parse_args(argv)
    try:
        policies = parse_policies(args.policies)
    except ValueError as e:
        p.error(str(e))
    if not 0 <= args.warmup < 1:
        p.error(f"--warmup must be in [0, 1), got {args.warmup}")
    if args.trace is not None and args.azure is not None:
        p.error("--trace and --azure: replay one at a time")
    if any(args.disk_tier) and not args.pull_mib_per_s:
        p.error("--disk-tier needs --pull-mib-per-s: without pulls a disk tier saves nothing")
    if args.trace is not None:
        try:
            workloads = [w.read_csv(args.trace)]
        except w.TraceError as e:
            p.error(str(e))
    elif args.azure is not None:
        try:
            speed = args.load_mib_per_s
            workloads = [azure.read(args.azure, n, seed=args.seed, load_mib_per_s=speed) for n in args.azure_windows]
        except w.TraceError as e:
            p.error(str(e))
    else:
        cat = w.catalogue(args.models, random.Random(args.seed), size_sigma=args.size_sigma, service_ms=args.service_ms)
        cat = w.with_load_speed(cat, args.load_mib_per_s)
        names = args.preset
        if args.rates:
            try:
                args.out.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                p.error(f"cannot create {args.out}: {e}")
            for name in names:
                run_sweep(name, cat, args, policies)
            return 0
        workloads = [PRESETS[n](cat, args.requests, args.alpha, args.rate, args.seed) for n in names]
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"cannot create {args.out}: {e}")
    for wl in workloads:
        run_workload(wl, args, policies)
    return 0


def presets(text: str) -> list[str]:
    """`zipf,bursts` or `all`: the presets to run, in the order given, each once."""
    out: list[str] = []
    for part in (x.strip() for x in text.split(",")):
        if part == "all":
            out.extend(n for n in PRESETS if n not in out)
        elif part in PRESETS:
            out.extend([part] if part not in out else [])
        elif part:
            raise argparse.ArgumentTypeError(f"unknown preset {part!r}: one of {', '.join(PRESETS)} or all")
    if not out:
        raise argparse.ArgumentTypeError(f"expected presets, got {text!r}")
    return out


def windows(text: str) -> list[int]:
    """`all,1,2`: 0 for the whole trace, N for its N-th window."""
    out: list[int] = []
    for part in (x.strip() for x in text.split(",")):
        if part == "all":
            out.append(0)
        elif part.isdigit() and int(part) >= 1:
            out.append(int(part))
        elif part:
            raise argparse.ArgumentTypeError(f"windows are 'all' or 1, 2, ..., got {part!r}")
    if not out:
        raise argparse.ArgumentTypeError(f"expected windows, got {text!r}")
    return out


def _instances(args: argparse.Namespace, workload: str) -> int:
    if args.instances is not None:
        return int(args.instances)
    return PRESET_INSTANCES.get(workload, DEFAULT_INSTANCES)


def _fleet(args: argparse.Namespace, total_units: int, share: float, workload: str, disk: float = 0.0) -> Fleet:
    """`disk`: the disk tier, a multiple of each instance's cache capacity (0: none)."""
    instances = _instances(args, workload)
    capacity = max(1, int(total_units * share / instances))
    return Fleet(
        instances,
        capacity,
        loading_threads=args.loading_threads,
        seed=args.seed,
        service_time=not args.no_service_time,
        service_jitter=args.service_jitter,
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        client_timeout_ms=int(args.client_timeout_s * 1000),
        pull_ms_per_gib=1024_000 / args.pull_mib_per_s if args.pull_mib_per_s else 0.0,
        disk_units=int(capacity * disk),
    )


def _labelled(result: Result, args: argparse.Namespace, disk: float) -> Result:
    """With several disk tiers compared, or one, the policy's row says which."""
    if len(args.disk_tier) > 1 or disk:
        result.policy = f"{result.policy}, disk {disk:g}x" if disk else f"{result.policy}, no disk"
    return result


def run_sweep(name: str, cat: w.Catalogue, args: argparse.Namespace, policies: list[Policy]) -> None:
    """The knee: one preset at each of `args.rates`, each capacity and policy."""
    rows: list[tuple[float, float, Result]] = []
    started = time.perf_counter()
    for share in args.capacities:
        for rate in args.rates:
            wl = PRESETS[name](cat, args.requests, args.alpha, rate, args.seed)
            warmup = int(len(wl) * args.warmup)
            for disk in args.disk_tier:
                fleet = _fleet(args, wl.catalogue.total_units, share, name, disk)
                for policy in policies:
                    rows.append((share, rate, _labelled(simulate(wl, fleet, policy, warmup), args, disk)))
    header = (
        f"## {name}: rate sweep, {args.requests} requests over {len(cat)} models (alpha {args.alpha:g}), "
        f"{_instances(args, name)} instances, {args.loading_threads} loading threads, loads at "
        f"{args.load_mib_per_s:g} MiB/s ({time.perf_counter() - started:.0f} s)"
    )
    text = report.sweep_table(name, rows)
    print(header, text, "", sep="\n")
    (args.out / f"{name}-sweep.md").write_text("\n".join([header, "", text, ""]))


def run_workload(wl: w.Workload, args: argparse.Namespace, policies: list[Policy]) -> None:
    total = wl.catalogue.total_units
    warmup = int(len(wl) * args.warmup)
    rows: list[tuple[str, float, Result]] = []
    started = time.perf_counter()
    for share in args.capacities:
        for disk in args.disk_tier:
            fleet = _fleet(args, total, share, wl.name, disk)
            for policy in policies:
                rows.append((wl.name, share, _labelled(simulate(wl, fleet, policy, warmup), args, disk)))
    text = report.table(rows)
    header = (
        f"## {wl.name}: {len(wl)} requests over {len(wl.catalogue)} models, {_instances(args, wl.name)} instances, "
        f"{args.loading_threads} loading threads"
        + (f", a {args.client_timeout_s:g} s client deadline" if args.client_timeout_s else "")
        + (f", pulls at {args.pull_mib_per_s:g} MiB/s" if args.pull_mib_per_s else "")
        + f" ({time.perf_counter() - started:.0f} s)"
    )
    print(header, text, "", sep="\n")
    body = [header, "", text, ""]
    if args.compare_libcachesim:
        single_text = compare_single(wl, args.capacities, warmup, [(share, r) for _, share, r in rows])
        print(single_text, "", sep="\n")
        body += [single_text, ""]
    (args.out / f"{wl.name}.md").write_text("\n".join(body))
    if not args.no_plots:
        written = report.plots(wl.name, rows, args.out)
        if not written:
            print("(no plots: matplotlib is not installed)", file=sys.stderr)


# One cache of the fleet's size, beside the fleet's loads: meshd's default order and the anchors.
ONE_CACHE_ANCHORS = ("meshd LRFU", "meshd RATE", "LFU, perfect memory (anchor)", "popularity oracle (anchor)")


def compare_single(
    wl: w.Workload, capacities: list[float], warmup: int, fleet: Sequence[tuple[float, Result]] = ()
) -> str:
    """One cache holding `capacities` of the catalogue, over the same request stream: hit ratio
    and load-seconds spent on misses, beside the anchors (`sim.single`). With `fleet` (the
    fleet's results at the same capacities, upstream's among them): the fleet's loads beside
    the misses of one cache of its size (issue 20's goal 1 against the anchors)."""
    reqs = list(wl.models)
    units = list(wl.catalogue.units)
    load_ms = list(wl.catalogue.load_ms)
    total = wl.catalogue.total_units
    ratios: dict[str, list[float]] = {}
    load_s: dict[str, list[float]] = {}
    misses: dict[str, list[int]] = {}

    def add(name: str, hits: bytearray, *, ratio: bool = True, load: bool = True) -> None:
        """Record a run in the hit-ratio table (and its misses), the load-seconds table, or both."""
        outcome = single.Outcome.of(hits, reqs, load_ms, warmup)
        if ratio:
            ratios.setdefault(name, []).append(outcome.hit_ratio)
            misses.setdefault(name, []).append(outcome.misses)
        if load:
            load_s.setdefault(name, []).append(outcome.miss_load_s)

    missing = ""
    for share in capacities:
        cap = max(1, int(total * share))
        for e in Eviction:
            add(f"meshd {e.name}", single.meshd_hits(reqs, units, cap, e, load_ms))
        # The anchors rank by what each table counts: requests per unit, or x load time per unit.
        lfu = "LFU, perfect memory (anchor)"
        add(lfu, single.lfu_hits(reqs, units, cap), load=False)
        add(lfu, single.lfu_hits(reqs, units, cap, load_ms), ratio=False)
        if wl.popularity:
            oracle = "popularity oracle (anchor)"
            add(oracle, single.oracle_hits(reqs, units, cap, wl.popularity), load=False)
            add(oracle, single.oracle_hits(reqs, units, cap, wl.popularity, load_ms), ratio=False)
        add("Belady (own)", single.belady_hits(reqs, units, cap))
        try:
            theirs = single.libcachesim_hits(reqs, units, cap)
        except ImportError:
            missing = "\n(libcachesim is not installed: pip install libcachesim)"
            continue
        for name, hits in theirs.items():
            add(f"libCacheSim {name}", hits)
    parts = [
        f"### {wl.name}: one cache, hit ratio by capacity (request hit ratio; sizes in 8 KiB units)",
        report.single_table(capacities, ratios),
        f"### {wl.name}: one cache, load-seconds spent on misses per 1,000 requests (fewer is better)",
        report.single_table(capacities, load_s, "{:.1f}") + missing,
    ]
    anchors = {k: v for k, v in misses.items() if k in ONE_CACHE_ANCHORS}
    against = report.against_upstream(capacities, fleet, anchors)
    if against:
        title = f"### {wl.name}: the fleet's loads beside one cache of its size (misses), against upstream's fleet"
        parts += [title, against]
    return "\n\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
