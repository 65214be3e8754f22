"""A 3-instance mesh against one instance: same models, same Zipf traffic, same per-instance cache.

    python bench/cluster_load.py [--models N] [--cache-models K] [--requests R] [--concurrency C]
                                 [--zipf S] [--load-delay-ms D] [--warmup W] [--seed X] [--quick]

Writes N generated demo models (meshd.runtimes.models.generate_models) and one seeded request
sequence: W warm-up requests then R measured ones, each for a model drawn from a Zipf(S)
popularity over the N models, each with its own random input row. Then runs two scenarios, one
after the other, each in its own LocalMesh (own etcd, own processes):

    mesh    etcd + 3 meshd, each beside its own reference runtime sized for K models;
            request i goes to instance i % 3's external port (clients spread round-robin)
    single  etcd + 1 meshd + 1 runtime sized for K models (the same per-instance capacity);
            every request goes to it

Every model is registered (no load) before traffic. With the defaults the traffic uses more
models than one instance holds (60 models, 12 per instance: the mesh holds 36, one instance 12).
C client tasks send the sequence in order through one channel per instance; every answer is
checked against the model file (y = W x + b, and bias[0] is the model's index, so an answer
from the wrong model is caught too). Figures cover the measured requests only: InstanceStats
are read from every instance before and after and the difference is used.

Per scenario: throughput, hit ratio (hits / (hits + misses) summed over instances), "served
without a load" (1 - loads / R), loads, evictions, errors and wrong answers (both must be 0),
p50/p99 latency, the share of requests that took a peer hop ((sum of InstanceStats.requests
over instances - R) / R: an instance counts requests from clients and from peers alike, so
every forwarded attempt, including a refused one that was rerouted, adds one), and meshd and
runtime CPU per request (utime + stime from /proc over the measured window). A per-instance
block shows how requests, loads and evictions spread over the mesh.

`--data-plane both` runs each scenario once per data plane on the same trace: python (every
request through meshd's Python path) and native (rows `-nat`: MESHD_DATAPLANE=native, warm
requests carried by HAProxy, meshd CPU counting its HAProxy too).

Every child process is stopped by PID on exit, including on failure and Ctrl-C. Exit status
0 only when both scenarios ran without errors or wrong answers.

Open loop (`--rates 5,10,20,40`, issue 24): instead of C clients in a closed loop, requests
arrive as a Poisson process at each rate, each sent when it is due whatever is still in
flight, to a fresh 3-instance mesh per rate and per `--load-queue` setting (value: meshd's
default; fifo: upstream's queue). Per rate: hit ratio (hits summed over instances / requests),
p99 latency of the hottest 10 % of models and of all requests, RESOURCE_EXHAUSTED refusals
(with their p99 time to answer) and other failures, loads. The same sweep as `python -m sim
--rates`, on real processes with the reference runtime's load delay. Exit status 0 when no
request failed other than RESOURCE_EXHAUSTED and no answer was wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc

# Runnable as a plain script from a checkout: make `meshd` importable.
_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from _shared import (  # noqa: E402 - bench/ is on sys.path
    Tally,
    answer_ok,
    asyncio_run,
    command_line,
    cpu_seconds,
    dump_logs,
    log,
    mesh_of_run,
    progress,
    run_pool,
    sigterm_as_interrupt,
)

from meshd._proto.inference import grpc_predict_v2_pb2 as pb  # noqa: E402
from meshd._proto.mmesh import model_mesh_pb2 as mm  # noqa: E402
from meshd.demo import percentile, zipf_weights  # noqa: E402
from meshd.runtimes.models import (  # noqa: E402
    DemoModel,
    decode_infer_response,
    generate_models,
    make_infer_request,
    pack_f32,
    unpack_f32,
)
from meshd.testing import haproxy  # noqa: E402
from meshd.testing.cluster import LocalMesh, MeshClient, Node, StartFailed, sized_runtime_args  # noqa: E402

INFER = "/inference.GRPCInferenceService/ModelInfer"
MODEL_SIZE_BYTES = 4 << 20  # what each model reports when loaded; capacity = K x this
MESH_INSTANCES = 3
RPC_TIMEOUT_S = 60.0
T = TypeVar("T")


# ---- the workload ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Planned:
    model_id: str
    request: bytes  # serialised ModelInferRequest
    expected: tuple[float, ...]  # the one output row the model file says


@dataclass(frozen=True)
class Workload:
    paths: dict[str, Path]
    warmup: list[Planned]
    measured: list[Planned]
    distinct_measured: int


def build_workload(directory: Path, n_models: int, warmup: int, requests: int, zipf: float, seed: int) -> Workload:
    generated = generate_models(directory, n_models, size_bytes=MODEL_SIZE_BYTES)
    models = {g.id: DemoModel.load(g.path) for g in generated}
    ids = [g.id for g in generated]
    rng = random.Random(seed)
    # Popularity rank -> model: shuffled, so the hot models are not simply the lowest ids.
    ranked = ids[:]
    rng.shuffle(ranked)
    plan = rng.choices(ranked, weights=zipf_weights(len(ranked), zipf), k=warmup + requests)
    planned: list[Planned] = []
    for model_id in plan:
        model = models[model_id]
        # The runtime sees float32 inputs: compute the expectation from exactly those.
        row = unpack_f32(pack_f32(rng.uniform(-1.0, 1.0) for _ in range(model.inputs)))
        req = make_infer_request(model_id, [row]).SerializeToString()
        planned.append(Planned(model_id, req, tuple(model.predict([row])[0])))
    measured = planned[warmup:]
    return Workload({g.id: g.path for g in generated}, planned[:warmup], measured, len({p.model_id for p in measured}))


# ---- results ---------------------------------------------------------------------------------
STAT_FIELDS = ("requests", "hits", "misses", "loads", "loadFailures", "evictions")


@dataclass
class InstanceDelta:
    instance_id: str
    client_requests: int  # sent to this instance's external port by the load generator
    counts: dict[str, int]  # STAT_FIELDS over the measured window
    loaded_models: int  # at the end
    used_bytes: int
    capacity_bytes: int
    meshd_cpu_s: float
    runtime_cpu_s: float


@dataclass
class ScenarioResult:
    name: str
    instances: int
    requests: int
    elapsed_s: float
    tally: Tally
    per_instance: list[InstanceDelta]
    setup_s: float = 0.0
    warmup_s: float = 0.0

    def total(self, key: str) -> int:
        return sum(d.counts[key] for d in self.per_instance)

    @property
    def rps(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s > 0 else float("nan")

    @property
    def hit_ratio(self) -> float:
        h, m = self.total("hits"), self.total("misses")
        return h / (h + m) if h + m else float("nan")

    @property
    def no_load_share(self) -> float:
        return 1.0 - self.total("loads") / self.requests if self.requests else float("nan")

    @property
    def peer_hop_share(self) -> float:
        return (self.total("requests") - self.requests) / self.requests if self.requests else float("nan")

    def cpu_ms_per_req(self, role: str) -> float:
        s = sum(d.meshd_cpu_s if role == "meshd" else d.runtime_cpu_s for d in self.per_instance)
        return s / self.requests * 1e3 if self.requests else float("nan")


# ---- driving traffic -------------------------------------------------------------------------
async def send_all(
    planned: list[Planned],
    channels: list[grpc.aio.Channel],
    concurrency: int,
    tally: Tally | None,
    on_done: Callable[[int], None] = lambda n: None,
) -> None:
    """Send `planned` in order, request i to channels[i % len(channels)], `concurrency` in flight.

    Every answer is checked; with `tally` None (warm-up) the first error or wrong answer aborts.
    """
    calls = [ch.unary_unary(INFER) for ch in channels]  # bytes in, bytes out
    done = 0
    perf = time.perf_counter

    async def send(i: int) -> None:
        nonlocal done
        p = planned[i]
        t0 = perf()
        try:
            raw = await calls[i % len(calls)](p.request, metadata=(("mm-model-id", p.model_id),), timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            msg = f"request {i} ({p.model_id}) -> instance {i % len(calls)}: {e.code().name}: {e.details()}"
            if tally is None:
                raise RuntimeError(f"warm-up failed: {msg}") from None
            tally.failed(e.code().name, msg)
            return
        finally:
            done += 1
            on_done(done)
        elapsed_ms = (perf() - t0) * 1e3
        try:
            got = decode_infer_response(pb.ModelInferResponse.FromString(raw))
            ok = len(got) == 1 and answer_ok(got[0], p.expected)
        except ValueError:
            ok = False
        if tally is None:
            if not ok:
                raise RuntimeError(f"warm-up: wrong answer for request {i} ({p.model_id})")
            return
        tally.latencies_ms.append(elapsed_ms)
        tally.answered(ok, f"request {i} ({p.model_id})")

    await run_pool(len(planned), concurrency, send)


NATIVE_COUNTERS_S = 1.2  # the native data plane's counters reach the stats within a second


def serving_cpu_s(node: Node) -> float:
    """CPU seconds of the serving layer: meshd, and its HAProxy with the native data plane."""
    proxy = haproxy.child_of(node.meshd.pid)
    return cpu_seconds(node.meshd.pid) + (cpu_seconds(proxy) if proxy is not None else 0.0)


async def run_traffic(
    name: str,
    nodes: list[Node],
    workload: Workload,
    concurrency: int,
    log: Callable[[str], None],
) -> ScenarioResult:
    clients = [MeshClient.open(n) for n in nodes]
    channels = [c.channel for c in clients]
    try:
        t_reg = time.perf_counter()
        for model_id, path in workload.paths.items():
            await clients[0].mm.registerModel(
                mm.RegisterModelRequest(modelId=model_id, modelInfo=mm.ModelInfo(type="demo", path=str(path))),
                timeout=30,
            )
        log(f"  [{name}] registered {len(workload.paths)} models in {time.perf_counter() - t_reg:.1f} s")

        t_warm = time.perf_counter()
        if workload.warmup:
            await send_all(
                workload.warmup,
                channels,
                concurrency,
                None,
                progress(f"[{name}] warm-up", len(workload.warmup), log),
            )
        warmup_s = time.perf_counter() - t_warm

        await asyncio.sleep(NATIVE_COUNTERS_S)  # native requests reach the stats once counted
        before = [await c.stats() for c in clients]
        cpu0 = [(serving_cpu_s(n), cpu_seconds(n.runtime.pid)) for n in nodes]
        tally = Tally()
        t0 = time.perf_counter()
        await send_all(
            workload.measured,
            channels,
            concurrency,
            tally,
            progress(f"[{name}] measured", len(workload.measured), log),
        )
        elapsed = time.perf_counter() - t0
        cpu1 = [(serving_cpu_s(n), cpu_seconds(n.runtime.pid)) for n in nodes]
        await asyncio.sleep(NATIVE_COUNTERS_S)
        after = [await c.stats() for c in clients]

        n_req = len(workload.measured)
        per_instance = [
            InstanceDelta(
                instance_id=nodes[k].instance_id,
                client_requests=len(range(k, n_req, len(nodes))),
                counts={f: getattr(after[k], f) - getattr(before[k], f) for f in STAT_FIELDS},
                loaded_models=len(after[k].loadedModels),
                used_bytes=after[k].usedBytes,
                capacity_bytes=after[k].capacityBytes,
                meshd_cpu_s=cpu1[k][0] - cpu0[k][0],
                runtime_cpu_s=cpu1[k][1] - cpu0[k][1],
            )
            for k in range(len(nodes))
        ]
        return ScenarioResult(name, len(nodes), n_req, elapsed, tally, per_instance, warmup_s=warmup_s)
    finally:
        for c in clients:
            await c.close()


def run_scenario(
    name: str,
    instances: int,
    args: argparse.Namespace,
    workload: Workload,
    workdir: Path,
    log: Callable[[str], None],
    settings: dict[str, str | int],
) -> ScenarioResult:
    mesh = LocalMesh(workdir / name, service=f"bench-{name}-{uuid.uuid4().hex[:8]}", settings=settings)
    t_setup = time.perf_counter()
    with mesh_of_run(mesh):
        mesh.start_etcd()
        runtime_args = sized_runtime_args(args.cache_models, MODEL_SIZE_BYTES, args.load_delay_ms)
        nodes = [mesh.add_node(f"{name}-{i}", runtime_args=runtime_args) for i in range(instances)]
        setup_s = time.perf_counter() - t_setup
        log(
            f"  [{name}] up in {setup_s:.1f} s: etcd pid {mesh.etcd.pid if mesh.etcd else '?'}; "
            + "; ".join(f"{n.instance_id} meshd pid {n.meshd.pid} runtime pid {n.runtime.pid}" for n in nodes)
        )
        result = asyncio_run(run_traffic(name, nodes, workload, args.concurrency, log))
        result.setup_s = setup_s
        if result.tally.n_errors or result.tally.wrong:
            dump_logs(mesh, log)
        return result


# ---- open loop (issue 24) ----------------------------------------------------------------------
@dataclass
class OpenLoopRow:
    load_queue: str
    rate: float
    requests: int
    hits: int
    loads: int
    hot_ms: list[float]
    all_ms: list[float]
    exhausted_ms: list[float]  # time to a RESOURCE_EXHAUSTED answer
    other_errors: dict[str, int]
    wrong: int
    first_errors: list[str]


async def send_open_loop(
    planned: list[Planned], channels: list[grpc.aio.Channel], rate: float, hot: set[str], seed: int
) -> tuple[list[tuple[str, float, bool]], int]:
    """Send `planned` as Poisson arrivals at `rate`/s (request i to instance i % n); each
    outcome is (status code name, ms, hot). Returns the outcomes and the wrong answers."""
    calls = [ch.unary_unary(INFER) for ch in channels]
    rng = random.Random(seed)
    outcomes: list[tuple[str, float, bool]] = []
    wrong = 0

    async def one(i: int, p: Planned) -> None:
        nonlocal wrong
        t0 = time.perf_counter()
        try:
            raw = await calls[i % len(calls)](p.request, metadata=(("mm-model-id", p.model_id),), timeout=RPC_TIMEOUT_S)
            got = decode_infer_response(pb.ModelInferResponse.FromString(raw))
            wrong += not (len(got) == 1 and answer_ok(got[0], p.expected))
            code = "OK"
        except grpc.aio.AioRpcError as e:
            code = e.code().name
            if code != "RESOURCE_EXHAUSTED":
                log(f"    request {i} ({p.model_id}): {code}: {e.details()}")
        outcomes.append((code, (time.perf_counter() - t0) * 1e3, p.model_id in hot))

    tasks: list[asyncio.Task[None]] = []
    due = time.perf_counter()
    for i, p in enumerate(planned):
        due += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        tasks.append(asyncio.create_task(one(i, p)))
    await asyncio.gather(*tasks)
    return outcomes, wrong


async def open_loop_traffic(
    nodes: list[Node], workload: Workload, rate: float, hot: set[str], seed: int
) -> OpenLoopRow:
    clients = [MeshClient.open(n) for n in nodes]
    channels = [c.channel for c in clients]
    try:
        for model_id, path in workload.paths.items():
            await clients[0].mm.registerModel(
                mm.RegisterModelRequest(modelId=model_id, modelInfo=mm.ModelInfo(type="demo", path=str(path))),
                timeout=30,
            )
        await send_open_loop(workload.warmup, channels, rate, hot, seed)  # fills the caches
        before = [await c.stats() for c in clients]
        outcomes, wrong = await send_open_loop(workload.measured, channels, rate, hot, seed + 1)
        after = [await c.stats() for c in clients]
    finally:
        for c in clients:
            await c.close()
    hits = sum(a.hits - b.hits for a, b in zip(after, before, strict=True))
    loads = sum(a.loads - b.loads for a, b in zip(after, before, strict=True))
    others: dict[str, int] = {}
    for code, _, _ in outcomes:
        if code not in ("OK", "RESOURCE_EXHAUSTED"):
            others[code] = others.get(code, 0) + 1
    return OpenLoopRow(
        load_queue="",
        rate=rate,
        requests=len(outcomes),
        hits=hits,
        loads=loads,
        hot_ms=[ms for code, ms, h in outcomes if h and code == "OK"],
        all_ms=[ms for code, ms, _ in outcomes if code == "OK"],
        exhausted_ms=[ms for code, ms, _ in outcomes if code == "RESOURCE_EXHAUSTED"],
        other_errors=others,
        wrong=wrong,
        first_errors=[],
    )


def run_open_loop(args: argparse.Namespace, workdir: Path) -> list[OpenLoopRow]:
    rows: list[OpenLoopRow] = []
    for load_queue in args.load_queue_list:
        for rate in args.rate_list:
            n = max(100, int(rate * args.seconds))
            workload = build_workload(workdir / "models", args.models, n // 2, n, args.zipf, args.seed)
            counts: dict[str, int] = {}
            for p in workload.measured:
                counts[p.model_id] = counts.get(p.model_id, 0) + 1
            hot = set(sorted(counts, key=lambda m: -counts[m])[: max(1, args.models // 10)])
            name = f"{load_queue}-{rate:g}"
            with mesh_of_run(LocalMesh(workdir / name, service=f"bench-{name}-{uuid.uuid4().hex[:8]}")) as mesh:
                mesh.start_etcd()
                runtime_args = sized_runtime_args(args.cache_models, MODEL_SIZE_BYTES, args.load_delay_ms)
                settings: dict[str, str | int] = {"load_queue": load_queue}
                nodes = [
                    mesh.add_node(f"{name}-{i}", runtime_args=runtime_args, settings=settings)
                    for i in range(MESH_INSTANCES)
                ]
                row = asyncio_run(open_loop_traffic(nodes, workload, rate, hot, args.seed))
            row.load_queue = load_queue
            log(f"  [{name}] {row.requests} requests: {len(row.exhausted_ms)} refused, {row.other_errors} other errors")
            rows.append(row)
    return rows


def open_loop_report(rows: list[OpenLoopRow], args: argparse.Namespace, command: str) -> list[str]:
    out = [
        "",
        f"command: {command}",
        f"{MESH_INSTANCES} instances, {args.models} models x {MODEL_SIZE_BYTES >> 20} MiB, cache {args.cache_models} "
        f"per instance, zipf {args.zipf:g}, load delay {args.load_delay_ms} ms, Poisson arrivals, "
        f"{args.seconds:g} s measured per rate after half as many warm-up requests",
        "",
        "| load queue | rate/s | requests | hit ratio | hot 10 % p99 ms | p99 ms (served) | RESOURCE_EXHAUSTED "
        "| its p99 ms | other failures | loads |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        p99 = [fmt(percentile(v, 99) if v else float("nan"), ".0f") for v in (r.hot_ms, r.all_ms, r.exhausted_ms)]
        out.append(
            f"| {r.load_queue} | {r.rate:g} | {r.requests} | {r.hits / r.requests:.3f} | {p99[0]} | {p99[1]} "
            f"| {len(r.exhausted_ms)} | {p99[2]} | {sum(r.other_errors.values())} {r.other_errors or ''} | {r.loads} |"
        )
    return out


# ---- report ----------------------------------------------------------------------------------
def fmt(v: float, spec: str) -> str:
    return "-" if v != v else format(v, spec)


def report(
    results: list[ScenarioResult], args: argparse.Namespace, workload: Workload, command: str, elapsed_s: float
) -> list[str]:
    out: list[str] = []
    out.append("")
    out.append(f"command: {command}")
    out.append(
        f"python {platform.python_version()}, grpcio {grpc.__version__}, {os.cpu_count()} cpus; "
        f"{args.models} models x {MODEL_SIZE_BYTES >> 20} MiB, cache {args.cache_models} models per instance, "
        f"zipf {args.zipf:g}, load delay {args.load_delay_ms} ms, concurrency {args.concurrency}, "
        f"{len(workload.warmup)} warm-up + {len(workload.measured)} measured requests "
        f"({workload.distinct_measured} distinct models), seed {args.seed}; elapsed {elapsed_s:.0f} s"
    )
    out.append("")
    hdr = (
        f"{'scenario':<10} {'inst':>4} {'cached':>6} {'req/s':>7} {'hit%':>6} {'no-load%':>8} {'loads':>6} "
        f"{'evict':>6} {'errors':>6} {'wrong':>5} {'p50 ms':>8} {'p99 ms':>8} {'peer-hop%':>9} "
        f"{'meshd ms/req':>12} {'rt ms/req':>9}"
    )
    out.append(hdr)
    out.append("-" * len(hdr))
    for r in results:
        lat = r.tally.latencies_ms
        out.append(
            f"{r.name:<10} {r.instances:>4} {r.instances * args.cache_models:>6} {fmt(r.rps, '7.1f')} "
            f"{fmt(100 * r.hit_ratio, '6.1f')} {fmt(100 * r.no_load_share, '8.1f')} {r.total('loads'):>6} "
            f"{r.total('evictions'):>6} {r.tally.n_errors:>6} {r.tally.wrong:>5} "
            f"{fmt(percentile(lat, 50) if lat else float('nan'), '8.1f')} "
            f"{fmt(percentile(lat, 99) if lat else float('nan'), '8.1f')} "
            f"{fmt(100 * r.peer_hop_share, '9.1f')} "
            f"{fmt(r.cpu_ms_per_req('meshd'), '12.2f')} {fmt(r.cpu_ms_per_req('runtime'), '9.2f')}"
        )
    out.append("")
    out.append(
        "hit% = hits/(hits+misses) over instances; no-load% = 1 - loads/requests; "
        "peer-hop% = (sum of instance requests - client requests)/client requests; "
        "ms/req = process CPU (all instances; meshd includes its HAProxy on -nat rows) per client request"
    )
    out.append("")
    out.append("per instance (measured window)")
    hdr2 = (
        f"{'instance':<10} {'client req':>10} {'requests':>8} {'hits':>6} {'misses':>6} {'loads':>6} "
        f"{'loadFail':>8} {'evict':>6} {'loaded':>6} {'used/cap MiB':>13}"
    )
    out.append(hdr2)
    out.append("-" * len(hdr2))
    for r in results:
        for d in r.per_instance:
            c = d.counts
            out.append(
                f"{d.instance_id:<10} {d.client_requests:>10} {c['requests']:>8} {c['hits']:>6} {c['misses']:>6} "
                f"{c['loads']:>6} {c['loadFailures']:>8} {c['evictions']:>6} {d.loaded_models:>6} "
                f"{f'{d.used_bytes >> 20}/{d.capacity_bytes >> 20}':>13}"
            )
    for r in results:
        if r.tally.n_errors or r.tally.wrong:
            out.append("")
            out.append(f"{r.name}: {r.tally.n_errors} errors {r.tally.errors}, {r.tally.wrong} wrong answers; first:")
            out.extend(f"  {m}" for m in r.tally.first_errors)
    by_name = {r.name: r for r in results}
    if "mesh" in by_name and "single" in by_name:
        m, s = by_name["mesh"], by_name["single"]
        out.append("")
        out.append(
            f"summary: mesh of {m.instances} {m.rps / s.rps:.2f}x the throughput of one instance "
            f"({m.rps:.0f} vs {s.rps:.0f} req/s); loads {m.total('loads')} vs {s.total('loads')}; "
            f"hit ratio {100 * m.hit_ratio:.1f}% vs {100 * s.hit_ratio:.1f}%; "
            f"{100 * m.peer_hop_share:.1f}% of mesh requests took a peer hop"
        )
    for scenario in ("mesh", "single"):
        if scenario in by_name and f"{scenario}-nat" in by_name:
            p, n = by_name[scenario], by_name[f"{scenario}-nat"]
            p50 = [percentile(r.tally.latencies_ms, 50) if r.tally.latencies_ms else float("nan") for r in (p, n)]
            out.append(
                f"summary: {scenario}, native against python data plane on the same trace: "
                f"{n.rps:.0f} vs {p.rps:.0f} req/s, serving-layer CPU {n.cpu_ms_per_req('meshd'):.2f} vs "
                f"{p.cpu_ms_per_req('meshd'):.2f} ms/req, p50 {p50[1]:.1f} vs {p50[0]:.1f} ms, "
                f"hit ratio {100 * n.hit_ratio:.1f}% vs {100 * p.hit_ratio:.1f}%"
            )
    return out


# ---- main ------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="cluster_load.py",
        description="A 3-instance mesh vs one instance under the same Zipf traffic and per-instance cache size.",
    )
    p.add_argument("--models", type=int, help="models registered (default 60; --quick 24)")
    p.add_argument("--cache-models", type=int, help="models one instance holds (default 12; --quick 4)")
    p.add_argument("--requests", type=int, help="measured requests per scenario (default 3000; --quick 300)")
    p.add_argument("--warmup", type=int, help="warm-up requests before measuring (default 500; --quick 60)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of model popularity (default 1.0)")
    p.add_argument("--load-delay-ms", type=int, help="the runtime's simulated load time (default 100; --quick 50)")
    p.add_argument("--seed", type=int, default=7, help="seed of the request sequence (default 7)")
    p.add_argument("--scenarios", default="mesh,single", help="comma-separated subset of mesh,single (default both)")
    p.add_argument("--quick", action="store_true", help="a short run (~30 s) for smoke testing")
    p.add_argument("--keep-workdir", action="store_true", help="keep the temp dir (logs) after the run")
    p.add_argument("--rates", help="open loop: Poisson arrivals at each of these rates/s (e.g. 5,10,20,40)")
    p.add_argument("--seconds", type=float, default=30.0, help="open loop: measured seconds per rate (default 30)")
    p.add_argument("--load-queue", default="value,fifo", help="open loop: MESHD_LOAD_QUEUE settings to compare")
    p.add_argument(
        "--data-plane",
        default="python",
        help="closed loop: MESHD_DATAPLANE of the meshd processes: python, native or both (same trace on each)",
    )
    a = p.parse_args(argv)
    try:
        a.rate_list = [float(x) for x in (a.rates or "").split(",") if x.strip()]
    except ValueError:
        p.error(f"--rates takes comma-separated numbers, got {a.rates!r}")
    if any(r <= 0 for r in a.rate_list) or a.seconds <= 0:
        p.error("--rates and --seconds must be positive")
    a.load_queue_list = [x.strip() for x in a.load_queue.split(",") if x.strip()]
    if not a.load_queue_list or any(x not in ("value", "fifo") for x in a.load_queue_list):
        p.error("--load-queue takes value, fifo or both")
    quick = a.quick
    defaults = {
        "models": 24 if quick else 60,
        "cache_models": 4 if quick else 12,
        "requests": 300 if quick else 3000,
        "warmup": 60 if quick else 500,
        "load_delay_ms": 50 if quick else 100,
    }
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if min(a.models, a.cache_models, a.requests, a.concurrency) < 1 or a.warmup < 0 or a.load_delay_ms < 0:
        p.error("--models, --cache-models, --requests, --concurrency must be >= 1; --warmup, --load-delay-ms >= 0")
    a.data_plane_list = ["python", "native"] if a.data_plane == "both" else [a.data_plane]
    if a.data_plane_list[0] not in ("python", "native"):
        p.error("--data-plane takes python, native or both")
    a.scenario_list = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    if not a.scenario_list or any(s not in ("mesh", "single") for s in a.scenario_list):
        p.error("--scenarios takes mesh, single or both")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = command_line("cluster_load.py", argv)
    sigterm_as_interrupt()

    started = time.monotonic()
    tmp = tempfile.TemporaryDirectory(prefix="meshd-cluster-bench-")
    workdir = Path(tmp.name)
    try:
        if args.rate_list:
            rows = run_open_loop(args, workdir)
        else:
            workload = build_workload(workdir / "models", args.models, args.warmup, args.requests, args.zipf, args.seed)
            results = run_closed_loop(args, workload, workdir)
    except KeyboardInterrupt:
        log("interrupted; stopped every child")
        return 130
    except StartFailed as e:
        log(f"could not start the mesh: {e}")
        return 1
    finally:
        if args.keep_workdir:
            log(f"kept {workdir}")
        else:
            tmp.cleanup()
    if args.rate_list:
        for line in open_loop_report(rows, args, command):
            print(line)
        return 1 if any(r.other_errors or r.wrong for r in rows) else 0
    for line in report(results, args, workload, command, time.monotonic() - started):
        print(line)
    return 1 if any(r.tally.n_errors or r.tally.wrong for r in results) else 0


def run_closed_loop(args: argparse.Namespace, workload: Workload, workdir: Path) -> list[ScenarioResult]:
    log(
        f"workdir {workdir}; {args.models} models, {len(workload.warmup)} warm-up + "
        f"{len(workload.measured)} measured requests ({workload.distinct_measured} distinct models)"
    )
    sizes = {"mesh": MESH_INSTANCES, "single": 1}
    results: list[ScenarioResult] = []
    native: dict[str, str | int] = {}
    if "native" in args.data_plane_list:
        found = haproxy.find_or_fetch()
        if found is None:
            raise StartFailed("--data-plane native: no HAProxy found or fetched here (docs/native.md)")
        native = {"data_plane": "native", "haproxy": found}
    runs = [(s, dp) for dp in args.data_plane_list for s in args.scenario_list]
    for scenario, data_plane in runs:
        name = scenario if data_plane == "python" else f"{scenario}-nat"
        log(f"scenario {name}: {sizes[scenario]} instance(s), data plane {data_plane}")
        settings = native if data_plane == "native" else {}
        r = run_scenario(name, sizes[scenario], args, workload, workdir, log, settings)
        log(
            f"  [{name}] {r.requests} requests in {r.elapsed_s:.1f} s ({r.rps:.1f} req/s), "
            f"{r.tally.n_errors} errors, {r.tally.wrong} wrong"
        )
        results.append(r)
    return results


if __name__ == "__main__":
    raise SystemExit(main())
