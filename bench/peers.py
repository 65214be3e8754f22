"""meshd beside Ray Serve's model multiplexing: the same models, traces, processes and client.

    python bench/peers.py [--models N] [--cache-models K] [--requests R] [--warmup W]
                          [--concurrency C] [--zipf S] [--kill-requests R2] [--runs N]
                          [--systems meshd,meshd-lru,ray,ray-grpc] [--seed X] [--quick]

The workload (one seed): N models whose size, load time and service time are drawn from one
distribution (size lognormal around 8 MiB, 2-32 MiB; load time 40 ms + 10 ms per MiB, times a
uniform 0.5-1.5; service time uniform 2-8 ms), written as model files of the reference
runtime's format with `hold_memory` (meshd.runtimes.model_work: a load sleeps its load time
then allocates and writes its size, held until the model is dropped; a request sleeps its
service time and computes y = W x + b). Traces: W warm-up then R measured requests over a
Zipf(S) popularity ("zipf"), R requests whose Zipf ranking rotates by N/4 models four times
("shift"), and R2 Zipf requests during which one model-serving process is killed ("kill").

The systems, three model-serving processes each, each process allowed K models:
    meshd  etcd + 3 meshd, each beside a reference runtime (meshd.runtimes.demo) with
           capacity K x the mean model size; clients spread round-robin over the 3 meshd
           (gRPC KServe V2 ModelInfer with the mm-model-id header); meshd's own eviction
           order (RATE) unless --meshd-eviction names one;
    meshd-lru  the same with MESHD_EVICTION=lru: Ray's multiplexing's order, so the two
           differ only in their machinery (placement, routing, load queue);
    ray    a local Ray cluster with one Serve deployment of 3 replicas,
           @serve.multiplexed(max_num_models_per_replica=K), reached through Serve's HTTP
           ingress with the serve_multiplexed_model_id header (bench/peers_ray.py, run in
           its own venv under .venvs/, built by this script on first use: pip install
           ray[serve]);
    ray-grpc  the same, a Ray cluster of its own, reached through Serve's gRPC ingress:
           KServe V2 ModelInfer, the bytes meshd is sent, with the multiplexed_model_id
           metadata (one channel, as to one proxy).
All run the same model code (meshd.runtimes.model_work). C requests are in flight from one
client process (uvloop); every answer is checked against the model file (bias[0] is the
model's index, so an answer from the wrong model is caught).

Per system and trace: throughput, p50/p99/p99.9, loads (meshd: InstanceStats; Ray: counters
each replica writes), "hit%" = 1 - loads/requests (the same definition for both), errors and
wrong answers, CPU per request of the serving layer (utime+stime from /proc of every process
of the system, minus the model work: the page writes of the loads, calibrated here, and the
y = W x + b of each request), the client's own CPU per request, and resident memory (all
processes of the system, and the model-serving processes alone). Kill run: the runtime of one
meshd instance, or one Ray replica, is SIGKILLed after a third of the requests; reported:
failed requests, when the last failure came, throughput before and after, and when Ray's
controller had a new replica up.

Every process started is stopped by PID on exit (Ray's whole process tree included),
failure and Ctrl-C too. Exit status 0 only when no zipf/shift request failed or was wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc

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
    rss_bytes,
    run_pool,
    sigterm_as_interrupt,
)

from meshd._proto.inference import grpc_predict_v2_pb2 as pb  # noqa: E402
from meshd._proto.mmesh import model_mesh_pb2 as mm  # noqa: E402
from meshd.decisions.cache import Eviction  # noqa: E402
from meshd.demo import percentile, zipf_weights  # noqa: E402
from meshd.runtimes import model_work  # noqa: E402
from meshd.runtimes.models import (  # noqa: E402
    DemoModel,
    decode_infer_response,
    make_infer_request,
    pack_f32,
    unpack_f32,
)
from meshd.testing.cluster import LocalMesh, MeshClient, Node, StartFailed  # noqa: E402
from meshd.testing.procs import Child, Children, free_ports  # noqa: E402
from meshd.testing.venvs import ensure_venv  # noqa: E402

INFER = "/inference.GRPCInferenceService/ModelInfer"
PROCESSES = 3
RPC_TIMEOUT_S = 60.0
RAY_VERSION = "2.60.0"
RAY_START_TIMEOUT_S = 180.0
MIB = 1 << 20
TRACES = ("zipf", "shift")
SYSTEMS = ("meshd", "meshd-lru", "ray", "ray-grpc")  # ray: Serve's HTTP ingress; ray-grpc: its gRPC ingress
MESHD_SYSTEMS = {"meshd": "", "meshd-lru": "lru"}  # -> eviction order ("": --meshd-eviction, default rate-capped)
GRPC_MODEL_HEADER = "multiplexed_model_id"  # where Serve's gRPC ingress reads the model id


# ---- the workload ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Planned:
    model_id: str
    grpc_body: bytes  # serialised ModelInferRequest
    http_body: bytes  # {"x": [row]}
    expected: tuple[float, ...]


@dataclass
class Workload:
    directory: Path
    models: dict[str, DemoModel]
    warmup: list[Planned]
    traces: dict[str, list[Planned]]  # zipf, shift, kill

    @property
    def mean_size(self) -> int:
        return round(statistics.fmean(m.size_bytes or 0 for m in self.models.values()))


def draw_models(n: int, seed: int, equal_sizes: bool = True) -> list[DemoModel]:
    """N linear models (4 inputs, 2 outputs; bias[0] = index) with drawn load and service time,
    and one size (8 MiB: a count of models and their bytes are then the same capacity) or a
    drawn one (`equal_sizes` False)."""
    rng = random.Random(f"peers-models:{seed}")
    out = []
    for index in range(n):
        drawn = min(32.0, max(2.0, rng.lognormvariate(math.log(8.0), 0.6)))  # drawn either way: same stream
        size_mib = 8.0 if equal_sizes else drawn
        load_ms = round((40 + 10 * size_mib) * rng.uniform(0.5, 1.5), 1)
        service_ms = round(rng.uniform(2.0, 8.0), 2)
        weights = tuple(tuple(round(rng.uniform(-1, 1), 4) for _ in range(4)) for _ in range(2))
        bias = (float(index), round(rng.uniform(-1, 1), 4))
        out.append(DemoModel("linear", 4, 2, weights, bias, int(size_mib * MIB), load_ms, service_ms, True))
    return out


def plan(models: dict[str, DemoModel], ids: Sequence[str], rng: random.Random) -> list[Planned]:
    planned = []
    for model_id in ids:
        model = models[model_id]
        row = unpack_f32(pack_f32(rng.uniform(-1.0, 1.0) for _ in range(model.inputs)))  # float32 values
        body = make_infer_request(model_id, [row]).SerializeToString()
        planned.append(Planned(model_id, body, json.dumps({"x": [row]}).encode(), tuple(model.predict([row])[0])))
    return planned


def build_workload(directory: Path, args: argparse.Namespace) -> Workload:
    directory.mkdir(parents=True, exist_ok=True)
    models: dict[str, DemoModel] = {}
    for index, model in enumerate(draw_models(args.models, args.seed, args.model_sizes == "equal")):
        model_id = f"model-{index:04d}"
        model.save(directory / f"{model_id}.json")
        models[model_id] = model
    rng = random.Random(args.seed)
    ranked = list(models)
    rng.shuffle(ranked)  # popularity rank -> model
    weights = zipf_weights(len(ranked), args.zipf)
    zipf = rng.choices(ranked, weights=weights, k=args.warmup + args.requests)
    shift: list[str] = []
    phases = 4
    for p in range(phases):
        k = len(ranked) * (p + 1) // phases
        rotated = ranked[k:] + ranked[:k]  # the hot set moves to models that were cold
        n = args.requests // phases + (1 if p < args.requests % phases else 0)
        shift += rng.choices(rotated, weights=weights, k=n)
    kill = rng.choices(ranked, weights=weights, k=args.kill_requests)
    return Workload(
        directory,
        models,
        plan(models, zipf[: args.warmup], rng),
        {
            "zipf": plan(models, zipf[args.warmup :], rng),
            "shift": plan(models, shift, rng),
            "kill": plan(models, kill, rng),
        },
    )


# ---- processes and their figures -------------------------------------------------------------
def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return int(data[data.rindex(b")") + 2 :].split()[19])


def descendants(root: int) -> set[int]:
    """root and every process below it (from /proc ppid links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        ppid = int(data[data.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = {root}, [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


@dataclass
class Snapshot:
    """CPU seconds per (pid, start time) of a system's processes, and who serves models."""

    cpu: dict[tuple[int, int], float]
    model_procs: set[tuple[int, int]]
    rss_all: int
    rss_models: int


def snapshot(pids: Sequence[int], model_pids: Sequence[int]) -> Snapshot:
    cpu: dict[tuple[int, int], float] = {}
    models: set[tuple[int, int]] = set()
    rss_all = rss_models = 0
    for pid in set(pids):
        st = _start_time(pid)
        c = cpu_seconds(pid)
        if st is None or c != c:
            continue
        cpu[(pid, st)] = c
        r = rss_bytes(pid)
        rss_all += r
        if pid in model_pids:
            models.add((pid, st))
            rss_models += r
    return Snapshot(cpu, models, rss_all, rss_models)


def cpu_between(a: Snapshot, b: Snapshot) -> tuple[float, float]:
    """(all processes, model-serving processes) CPU seconds from a to b; a process started in
    between counts from zero, one gone in between counts up to a."""
    total = models = 0.0
    for key in a.cpu.keys() | b.cpu.keys():
        d = b.cpu.get(key, a.cpu.get(key, 0.0)) - a.cpu.get(key, 0.0)
        total += d
        if key in a.model_procs or key in b.model_procs:
            models += d
    return total, models


def model_work_cpu_s(mean_size: int) -> tuple[float, float]:
    """(CPU s per load, CPU s per request) of the model work itself, measured in this process:
    allocating and writing a mean-sized model's memory; one y = W x + b."""
    n = 5
    t0 = time.process_time()
    for _ in range(n):
        model_work.hold_memory(mean_size)
    per_load = (time.process_time() - t0) / n
    w, b, x = ((0.1, 0.2, 0.3, 0.4), (0.5, 0.6, 0.7, 0.8)), (1.0, 2.0), (1.0, 1.0, 1.0, 1.0)
    t0 = time.process_time()
    for _ in range(20000):
        model_work.linear(w, b, x)
    return per_load, (time.process_time() - t0) / 20000


# ---- results ---------------------------------------------------------------------------------
@dataclass
class TimedTally(Tally):
    # (finish time, ok) per request, for the kill run's timeline
    timeline: list[tuple[float, bool]] = field(default_factory=list)


@dataclass
class TraceResult:
    system: str
    trace: str
    requests: int
    elapsed_s: float
    tally: TimedTally
    loads: int
    cpu_s: float
    model_proc_cpu_s: float
    client_cpu_s: float
    rss_all: int
    rss_models: int
    model_work_s: float
    held: int = 0  # models loaded across the system at the end of the trace

    @property
    def rps(self) -> float:
        return self.requests / self.elapsed_s

    @property
    def hit_ratio(self) -> float:
        return 1.0 - self.loads / self.requests

    def lat(self, q: float) -> float:
        return percentile(self.tally.latencies_ms, q) if self.tally.latencies_ms else float("nan")

    @property
    def layer_cpu_ms(self) -> float:
        return (self.cpu_s - self.model_work_s) / self.requests * 1e3


@dataclass
class KillResult:
    system: str
    requests: int
    killed: str
    kill_at: float  # seconds from the start of the trace
    failed: int
    wrong: int
    last_failure_after_s: float  # from the kill; NaN when none failed
    rps_before: float
    rps_after: float
    replaced_after_s: float  # Ray: a new replica process seen; NaN: never / not applicable
    first_errors: list[str]


# ---- the two clients -------------------------------------------------------------------------
Call = Callable[[int, Planned], Awaitable[list[float]]]


class CallFailed(Exception):
    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code


async def drive(
    planned: list[Planned], call: Call, concurrency: int, on_done: Callable[[int], None] = lambda n: None
) -> TimedTally:
    tally = TimedTally()
    done = 0
    perf = time.perf_counter

    async def send(i: int) -> None:
        nonlocal done
        p = planned[i]
        t0 = perf()
        try:
            got = await call(i, p)
            ok = answer_ok(got, p.expected)
        except CallFailed as e:
            tally.failed(e.code, f"request {i} ({p.model_id}): {e.code}: {str(e)[:200]}")
            tally.timeline.append((perf(), False))
            return
        finally:
            done += 1
            on_done(done)
        tally.latencies_ms.append((perf() - t0) * 1e3)
        tally.timeline.append((perf(), ok))
        tally.answered(ok, f"request {i} ({p.model_id})")

    await run_pool(len(planned), concurrency, send)
    return tally


def grpc_call(channels: Sequence[grpc.aio.Channel], header: str = "mm-model-id") -> Call:
    """KServe V2 ModelInfer over gRPC, round-robin over `channels`, the model id in `header`
    (meshd's `mm-model-id`; Ray Serve's gRPC ingress reads `multiplexed_model_id`)."""
    calls = [ch.unary_unary(INFER) for ch in channels]

    async def call(i: int, p: Planned) -> list[float]:
        try:
            raw = await calls[i % len(calls)](p.grpc_body, metadata=((header, p.model_id),), timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            # The first line: Ray's actor errors run to a dozen lines per request.
            raise CallFailed(e.code().name, (e.details() or "").split("\n", 1)[0]) from None
        try:
            rows = decode_infer_response(pb.ModelInferResponse.FromString(raw))
        except ValueError as e:
            raise CallFailed("BAD_ANSWER", str(e)) from None
        return rows[0] if len(rows) == 1 else []

    return call


def http_call(session: aiohttp.ClientSession, url: str) -> Call:
    timeout = aiohttp.ClientTimeout(total=RPC_TIMEOUT_S)

    async def call(i: int, p: Planned) -> list[float]:
        headers = {"serve_multiplexed_model_id": p.model_id, "content-type": "application/json"}
        try:
            async with session.post(url, data=p.http_body, headers=headers, timeout=timeout) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise CallFailed(f"HTTP_{resp.status}", body[:200].decode(errors="replace"))
        except (aiohttp.ClientError, TimeoutError) as e:
            raise CallFailed(type(e).__name__, str(e)) from None
        try:
            answer = json.loads(body)
            rows = answer["y"]
        except (ValueError, KeyError, TypeError) as e:
            raise CallFailed("BAD_ANSWER", str(e)) from None
        if answer.get("model") != p.model_id or len(rows) != 1:
            return []
        return [float(v) for v in rows[0]]

    return call


# ---- one system under the traces -------------------------------------------------------------
class System:
    """What the trace runner needs from a system; `meshd` and `ray` below fill it in."""

    name = ""

    def pids(self) -> list[int]:
        raise NotImplementedError

    def model_pids(self) -> list[int]:
        raise NotImplementedError

    async def loads(self) -> int:
        raise NotImplementedError

    async def held(self) -> int:
        """Models loaded across the system now."""
        raise NotImplementedError

    def kill_one(self) -> str:
        raise NotImplementedError

    def replaced(self) -> bool:
        return False


async def run_traces(
    system: System, call: Call, workload: Workload, args: argparse.Namespace, per_load_s: float, per_req_s: float
) -> tuple[list[TraceResult], KillResult | None]:
    n = system.name
    if workload.warmup:
        warm = await drive(workload.warmup, call, args.concurrency, progress(f"[{n}] warm-up", len(workload.warmup)))
        log(f"  [{n}] warm-up: {warm.ok} ok, {warm.n_errors} errors {dict(warm.errors)}, {warm.wrong} wrong")
        for e in warm.first_errors[:2]:
            log(f"    {e}")
    results = []
    for trace in TRACES:
        planned = workload.traces[trace]
        loads0 = await system.loads()
        s0 = snapshot(system.pids(), system.model_pids())
        c0 = cpu_seconds(os.getpid())
        t0 = time.perf_counter()
        tally = await drive(planned, call, args.concurrency, progress(f"[{n}] {trace}", len(planned)))
        elapsed = time.perf_counter() - t0
        c1 = cpu_seconds(os.getpid())
        s1 = snapshot(system.pids(), system.model_pids())
        loads = await system.loads() - loads0
        cpu, model_cpu = cpu_between(s0, s1)
        r = TraceResult(
            n,
            trace,
            len(planned),
            elapsed,
            tally,
            loads,
            cpu,
            model_cpu,
            c1 - c0,
            s1.rss_all,
            s1.rss_models,
            loads * per_load_s + len(planned) * per_req_s,
            await system.held(),
        )
        log(
            f"  [{n}] {trace}: {r.rps:.0f} req/s, p99 {r.lat(99):.0f} ms, {loads} loads, "
            f"{tally.n_errors} errors, {tally.wrong} wrong"
        )
        results.append(r)
    kill = None
    if args.kill_requests:
        kill = await kill_run(system, call, workload.traces["kill"], args)
    return results, kill


async def kill_run(system: System, call: Call, planned: list[Planned], args: argparse.Namespace) -> KillResult:
    n = system.name
    kill_after = len(planned) // 3
    t0 = time.perf_counter()
    killed: dict[str, Any] = {}

    def on_done(k: int) -> None:
        if k == kill_after and not killed:
            killed["what"] = system.kill_one()
            killed["at"] = time.perf_counter()
            log(f"  [{n}] kill: {killed['what']} after {k} requests")

    async def watch_replacement() -> None:
        while True:
            await asyncio.sleep(0.1)
            if "at" in killed and "replaced" not in killed and system.replaced():
                killed["replaced"] = time.perf_counter()

    watcher = asyncio.create_task(watch_replacement())
    try:
        tally = await drive(planned, call, args.concurrency, on_done)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    end = time.perf_counter()
    at = killed.get("at", end)
    failures = [t for t, ok in tally.timeline if not ok]
    before = sum(1 for t, _ in tally.timeline if t <= at)
    after = len(tally.timeline) - before
    result = KillResult(
        n,
        len(planned),
        killed.get("what", "nothing"),
        at - t0,
        tally.n_errors,
        tally.wrong,
        (max(failures) - at) if failures else float("nan"),
        before / (at - t0) if at > t0 else float("nan"),
        after / (end - at) if end > at else float("nan"),
        (killed["replaced"] - at) if "replaced" in killed else float("nan"),
        tally.first_errors,
    )
    log(f"  [{n}] kill run: {result.failed} failed, {result.wrong} wrong")
    return result


class MeshdSystem(System):
    name = "meshd"

    def __init__(self, mesh: LocalMesh, nodes: list[Node], clients: list[MeshClient], name: str = "meshd") -> None:
        self.mesh, self.nodes, self.clients = mesh, nodes, clients
        self.name = name  # "meshd" (its default eviction, or --meshd-eviction) or "meshd-lru"

    def pids(self) -> list[int]:
        etcd = [self.mesh.etcd.pid] if self.mesh.etcd is not None and self.mesh.etcd.pid else []
        return etcd + [n.meshd.pid for n in self.nodes] + self.model_pids()

    def model_pids(self) -> list[int]:
        return [n.runtime.pid for n in self.nodes]

    async def loads(self) -> int:
        return sum([int((await c.stats()).loads) for c in self.clients])

    async def held(self) -> int:
        return sum([len((await c.stats()).loadedModels) for c in self.clients])

    def kill_one(self) -> str:
        node = self.nodes[-1]
        node.runtime.send_signal(signal.SIGKILL)
        return f"runtime of {node.instance_id} (pid {node.runtime.pid})"


def meshd_settings(eviction: str, metrics_port: int) -> dict[str, str | int]:
    """One meshd's settings: metrics on, as a deployment runs it (Ray keeps its own metrics and
    access logs on); the eviction order when one is named ("": meshd's default)."""
    settings: dict[str, str | int] = {"metrics": f"prometheus:port={metrics_port}"}
    if eviction:
        settings["eviction"] = eviction
    return settings


def meshd_capacity(args: argparse.Namespace, workload: Workload) -> int:
    """Bytes of models each meshd runtime may hold: `--meshd-cache-mib`, else the model count
    Ray is given times the mean model size."""
    if args.meshd_cache_mib:
        return int(args.meshd_cache_mib * MIB)
    return int(args.cache_models * workload.mean_size)


def run_meshd(
    workload: Workload, args: argparse.Namespace, workdir: Path, costs: tuple[float, float], name: str = "meshd"
) -> Any:
    """`name`: "meshd" (eviction `--meshd-eviction`, default meshd's own) or "meshd-lru" (LRU: Ray's order)."""
    eviction = MESHD_SYSTEMS[name] or args.meshd_eviction
    with mesh_of_run(LocalMesh(workdir / "meshd", service=f"bench-peers-{uuid.uuid4().hex[:8]}")) as mesh:
        mesh.start_etcd()
        runtime_args = [
            "--capacity-bytes",
            str(meshd_capacity(args, workload)),
            "--default-model-size",
            str(workload.mean_size),
            *(["--max-loading-concurrency", str(args.meshd_loading_threads)] if args.meshd_loading_threads else []),
            "--log-level",
            "WARNING",
        ]
        metrics_ports = free_ports(PROCESSES)
        nodes = [
            mesh.add_node(f"peers-{i}", runtime_args=runtime_args, settings=meshd_settings(eviction, port))
            for i, port in enumerate(metrics_ports)
        ]
        log(f"  [{name}] up: " + "; ".join(f"meshd {n.meshd.pid} runtime {n.runtime.pid}" for n in nodes))

        async def go() -> tuple[list[TraceResult], KillResult | None]:
            clients = [MeshClient.open(n) for n in nodes]
            try:
                for model_id in workload.models:
                    path = workload.directory / f"{model_id}.json"
                    await clients[0].mm.registerModel(
                        mm.RegisterModelRequest(modelId=model_id, modelInfo=mm.ModelInfo(type="demo", path=str(path))),
                        timeout=30,
                    )
                call = grpc_call([c.channel for c in clients])
                return await run_traces(MeshdSystem(mesh, nodes, clients, name), call, workload, args, *costs)
            finally:
                for c in clients:
                    await c.close()

        out = asyncio_run(go())
        log(f"  [{name}] where requests waited (whole run): " + waits(metrics_ports))
        if any(r.tally.n_errors or r.tally.wrong for r in out[0]):
            dump_logs(mesh, log)
        return out


WAIT_HISTOGRAMS = {
    "loading queue": "modelmesh_loading_queue_delay_milliseconds",
    "load": "modelmesh_loadmodel_milliseconds",
    "cache miss": "modelmesh_cache_miss_milliseconds",
}


def waits(ports: Sequence[int]) -> str:
    """p50/p99 of meshd's own wait histograms, summed over the instances, and the loads each ran."""
    texts = []
    for port in ports:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
                texts.append(resp.read().decode())
        except OSError as e:
            return f"metrics unreadable: {e}"
    parts = []
    for label, name in WAIT_HISTOGRAMS.items():
        buckets: dict[float, float] = {}
        for text in texts:
            for le, count in histogram_buckets(text, name).items():
                buckets[le] = buckets.get(le, 0.0) + count
        parts.append(f"{label} p50 {bucket_quantile(buckets, 0.5)} p99 {bucket_quantile(buckets, 0.99)} ms")
    loads = [histogram_buckets(t, WAIT_HISTOGRAMS["load"]).get(math.inf, 0.0) for t in texts]
    return "; ".join(parts) + f"; loads per instance {[int(x) for x in loads]}"


def histogram_buckets(text: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts of a Prometheus histogram, summed over its label sets."""
    out: dict[float, float] = {}
    prefix = f"{name}_bucket{{"
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        labels, _, value = line.rpartition(" ")
        le = labels.split('le="', 1)[1].split('"', 1)[0]
        bound = math.inf if le == "+Inf" else float(le)
        out[bound] = out.get(bound, 0.0) + float(value)
    return out


def bucket_quantile(buckets: dict[float, float], q: float) -> str:
    """The upper bound of the bucket holding quantile q ("<= X"), from cumulative counts."""
    total = buckets.get(math.inf, 0.0)
    if not total:
        return "-"
    for bound in sorted(buckets):
        if buckets[bound] >= q * total:
            return f"<={bound:g}"
    return "-"


class RaySystem(System):
    name = "ray"

    def __init__(self, driver: Child, stats_dir: Path, seen: dict[int, int | None], name: str = "ray") -> None:
        self.driver, self.stats_dir, self.seen = driver, stats_dir, seen
        self.name = name  # "ray" (Serve's HTTP ingress) or "ray-grpc"
        self.killed_replica: int | None = None
        self.replicas_at_kill: set[int] = set()

    def pids(self) -> list[int]:
        pids = descendants(self.driver.pid)
        for p in pids:  # remembered, so every one is stopped at the end even if orphaned
            self.seen.setdefault(p, _start_time(p))
        return sorted(pids)

    def model_pids(self) -> list[int]:
        return [p for p in descendants(self.driver.pid) if cmdline(p).startswith("ray::ServeReplica")]

    async def loads(self) -> int:
        return self._sum("loads")

    async def held(self) -> int:
        live = set(self.model_pids())
        return self._sum("held", lambda stats: int(stats.get("pid", 0)) in live)

    def _sum(self, key: str, counted: Callable[[dict[str, Any]], bool] = lambda _: True) -> int:
        # Each replica flushes its counters every 0.1 s (off its load path): wait one flush.
        time.sleep(0.3)
        total = 0
        for path in self.stats_dir.glob("replica-*.json"):
            with contextlib.suppress(OSError, ValueError):
                stats = json.loads(path.read_text())
                if counted(stats):
                    total += int(stats[key])
        return total

    def kill_one(self) -> str:
        replicas = sorted(self.model_pids())
        self.pids()
        victim = replicas[-1]
        self.replicas_at_kill = set(replicas)
        os.kill(victim, signal.SIGKILL)
        self.killed_replica = victim
        return f"Serve replica pid {victim}"

    def replaced(self) -> bool:
        now = set(self.model_pids())
        return bool(now - self.replicas_at_kill)


def stop_ray(driver: Child, seen: dict[int, int | None]) -> None:
    """SIGTERM the driver (Serve and Ray shut down), then SIGKILL every process of its tree
    that is still there: each pid seen during the run, checked by start time against reuse."""
    held = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        if driver.alive():
            for p in descendants(driver.pid):
                seen.setdefault(p, _start_time(p))
        driver.stop(timeout_s=30)
        for pid, st in seen.items():
            if pid != driver.pid and st is not None and _start_time(pid) == st:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ray_python(args: argparse.Namespace) -> Path:
    log(f"  [ray] venv: ray[serve]=={args.ray_version} (built on first use, pip install from PyPI)")
    return ensure_venv("ray-serve", [f"ray[serve]=={args.ray_version}"])


def run_ray(
    workload: Workload, args: argparse.Namespace, workdir: Path, costs: tuple[float, float], ingress: str = "http"
) -> Any:
    """Ray Serve through its HTTP ingress, or (`ingress="grpc"`) its gRPC one."""
    python = ray_python(args)
    ray_dir = workdir / "ray"
    stats_dir = ray_dir / "stats"
    stats_dir.mkdir(parents=True)
    ready = ray_dir / "ready.json"
    port, grpc_port = free_ports(2)
    group = Children(ray_dir / "logs")
    seen: dict[int, int | None] = {}
    driver = group.start(
        "ray-driver",
        [
            str(python),
            str(_REPO / "bench" / "peers_ray.py"),
            "--port",
            str(port),
            *(("--grpc-port", str(grpc_port)) if ingress == "grpc" else ()),
            "--models-dir",
            str(workload.directory),
            "--stats-dir",
            str(stats_dir),
            "--ready-file",
            str(ready),
            "--temp-dir",
            str(ray_dir / "session"),
            "--replicas",
            str(PROCESSES),
            "--max-models",
            str(args.cache_models),
            "--max-ongoing",
            str(args.concurrency),
        ],
        # meshd/_proto too: its generated messages call their module "inference.grpc_predict_v2_pb2",
        # and Serve's gRPC proxy pickles each request by that name to send it to a replica.
        env={
            "PYTHONPATH": os.pathsep.join((str(_REPO), str(_REPO / "meshd" / "_proto"))),
            "RAY_USAGE_STATS_ENABLED": "0",
        },
    )
    try:
        deadline = time.monotonic() + RAY_START_TIMEOUT_S
        while not ready.exists():
            if not driver.alive():
                raise StartFailed(f"Ray driver exited with {driver.proc.returncode}:\n{driver.log_tail()}")
            if time.monotonic() > deadline:
                raise StartFailed(f"Ray Serve not ready in {RAY_START_TIMEOUT_S:.0f} s:\n{driver.log_tail()}")
            time.sleep(0.2)
        system = RaySystem(driver, stats_dir, seen, "ray-grpc" if ingress == "grpc" else "ray")
        pids = system.pids()
        log(f"  [{system.name}] up: driver {driver.pid}, replicas {system.model_pids()}, {len(pids)} processes")

        async def go() -> tuple[list[TraceResult], KillResult | None]:
            if ingress == "grpc":
                async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                    return await run_traces(system, grpc_call([channel], GRPC_MODEL_HEADER), workload, args, *costs)
            connector = aiohttp.TCPConnector(limit=args.concurrency)
            async with aiohttp.ClientSession(connector=connector) as session:
                call = http_call(session, f"http://127.0.0.1:{port}/")
                return await run_traces(system, call, workload, args, *costs)

        out = asyncio_run(go())
        if any(r.tally.n_errors or r.tally.wrong for r in out[0]):
            log(driver.log_tail())
        return out
    except BaseException:
        log(driver.log_tail())
        raise
    finally:
        stop_ray(driver, seen)


# ---- report ----------------------------------------------------------------------------------
def med(values: Sequence[float]) -> float:
    vals = [v for v in values if v == v]
    return statistics.median(vals) if vals else float("nan")


def fmt(v: float, spec: str) -> str:
    return "-" if v != v else format(v, spec)


def spread(values: Sequence[float]) -> str:
    """min-max over the runs ("-" for one run)."""
    vals = [v for v in values if v == v]
    return f"{min(vals):.0f}-{max(vals):.0f}" if len(vals) > 1 else "-"


def report(
    runs: list[dict[str, tuple[list[TraceResult], KillResult | None]]],
    args: argparse.Namespace,
    workload: Workload,
    command: str,
    elapsed_s: float,
) -> list[str]:
    out = ["", f"command: {command}"]
    sizes = [m.size_bytes or 0 for m in workload.models.values()]
    loads = [m.load_ms for m in workload.models.values()]
    svc = [m.service_ms for m in workload.models.values()]
    out.append(
        f"python {platform.python_version()}, grpcio {grpc.__version__}, aiohttp {aiohttp.__version__}, "
        f"ray {args.ray_version}, {os.cpu_count()} cpus (client and both systems share them); "
        f"{len(runs)} run(s), medians; elapsed {elapsed_s:.0f} s"
    )
    out.append(
        f"{args.models} models: size {min(sizes) / MIB:.1f}-{max(sizes) / MIB:.1f} MiB (mean "
        f"{workload.mean_size / MIB:.1f}), load {min(loads):.0f}-{max(loads):.0f} ms (mean "
        f"{statistics.fmean(loads):.0f}), service {min(svc):.1f}-{max(svc):.1f} ms; {PROCESSES} processes x "
        f"{args.cache_models} models (meshd capacity "
        f"{'--meshd-cache-mib' if args.meshd_cache_mib else f'{args.cache_models} x mean size'} = "
        f"{meshd_capacity(args, workload) / MIB:.0f} MiB; Ray max_num_models_per_replica "
        f"{args.cache_models}); meshd loading threads "
        f"{args.meshd_loading_threads or 'runtime default (2)'} (Ray: 1 per replica, its multiplex lock); "
        f"model sizes {args.model_sizes}; "
        f"meshd eviction {args.meshd_eviction or 'default (rate-capped)'}, meshd-lru lru; "
        f"meshd metrics on; zipf {args.zipf:g}; concurrency {args.concurrency}; "
        f"{len(workload.warmup)} warm-up, {args.requests} per trace, seed {args.seed}"
    )
    out.append("")
    hdr = (
        f"{'trace':<6} {'system':<9} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'p99.9 ms':>8} {'loads':>6} "
        f"{'hit%':>6} {'errors':>6} {'wrong':>5} {'layer ms/req':>12} {'model-proc ms/req':>17} "
        f"{'client ms/req':>13} {'RSS MiB':>8} {'model-proc RSS':>14} {'held':>5} "
        f"{'req/s range':>11} {'p99 range':>11} {'loads range':>11}"
    )
    out.append(hdr)
    out.append("-" * len(hdr))
    systems = [s for s in args.system_list if all(s in r for r in runs)]
    for trace in TRACES:
        for s in systems:
            rs = [next(t for t in r[s][0] if t.trace == trace) for r in runs]
            out.append(
                f"{trace:<6} {s:<9} {fmt(med([r.rps for r in rs]), '7.0f')} "
                f"{fmt(med([r.lat(50) for r in rs]), '7.1f')} "
                f"{fmt(med([r.lat(99) for r in rs]), '7.1f')} {fmt(med([r.lat(99.9) for r in rs]), '8.1f')} "
                f"{fmt(med([r.loads for r in rs]), '6.0f')} {fmt(med([100 * r.hit_ratio for r in rs]), '6.1f')} "
                f"{sum(r.tally.n_errors for r in rs):>6} {sum(r.tally.wrong for r in rs):>5} "
                f"{fmt(med([r.layer_cpu_ms for r in rs]), '12.2f')} "
                f"{fmt(med([r.model_proc_cpu_s / r.requests * 1e3 for r in rs]), '17.2f')} "
                f"{fmt(med([r.client_cpu_s / r.requests * 1e3 for r in rs]), '13.2f')} "
                f"{fmt(med([r.rss_all / MIB for r in rs]), '8.0f')} "
                f"{fmt(med([r.rss_models / MIB for r in rs]), '14.0f')} "
                f"{fmt(med([r.held for r in rs]), '5.0f')} "
                f"{spread([r.rps for r in rs]):>11} {spread([r.lat(99) for r in rs]):>11} "
                f"{spread([r.loads for r in rs]):>11}"
            )
    out.append("")
    out.append(
        "hit% = 1 - loads/requests; layer ms/req = CPU of every process of the system (meshd: etcd, 3 meshd, "
        "3 runtimes; Ray: driver, GCS, raylet, agents, controller, proxy, 3 replicas) minus the model work, "
        "per request; model-proc = the 3 runtimes / the 3 replicas alone (model work included); "
        "RSS at the end of the trace; held = models loaded across the system at the end; ranges: min-max over runs"
    )
    pairs = [(m, o) for m in systems if m in MESHD_SYSTEMS for o in systems if o not in MESHD_SYSTEMS]
    for mine, other in pairs:
        for trace in TRACES:
            ratios = []
            for r in runs:
                m = next(t for t in r[mine][0] if t.trace == trace)
                y = next(t for t in r[other][0] if t.trace == trace)
                ratios.append((m.rps / y.rps, m.lat(99) / y.lat(99), m.loads / max(1, y.loads)))
            out.append(
                f"{trace}: {mine}/{other} throughput {med([x[0] for x in ratios]):.2f}x, p99 ratio "
                f"{med([x[1] for x in ratios]):.2f}, loads ratio {med([x[2] for x in ratios]):.2f} "
                f"(per run: {', '.join(f'{x[0]:.2f}' for x in ratios)})"
            )
    kills = [(s, r[s][1]) for r in runs for s in systems if r[s][1] is not None]
    if kills:
        out.append("")
        out.append(f"kill run: {args.kill_requests} zipf requests, one model-serving process SIGKILLed after a third")
        hdr2 = (
            f"{'system':<9} {'killed':<34} {'failed':>6} {'wrong':>5} {'last failure s':>14} "
            f"{'req/s before':>12} {'req/s after':>11} {'replaced s':>10}"
        )
        out.append(hdr2)
        out.append("-" * len(hdr2))
        for s, k in kills:
            assert k is not None
            out.append(
                f"{s:<9} {k.killed[:34]:<34} {k.failed:>6} {k.wrong:>5} {fmt(k.last_failure_after_s, '14.2f')} "
                f"{fmt(k.rps_before, '12.0f')} {fmt(k.rps_after, '11.0f')} {fmt(k.replaced_after_s, '10.2f')}"
            )
            out.extend(f"    {e}" for e in k.first_errors[:3])
    for r in runs:
        for s in systems:
            for t in r[s][0]:
                if t.tally.n_errors or t.tally.wrong:
                    out.append(f"{s} {t.trace}: {t.tally.errors} {t.tally.wrong} wrong; first: {t.tally.first_errors}")
    return out


# ---- main ------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="peers.py", description="meshd and Ray Serve multiplexing on the same models, traces and client."
    )
    p.add_argument("--models", type=int, help="models (default 300; --quick 40)")
    p.add_argument("--cache-models", type=int, help="models each serving process holds (default 16; --quick 4)")
    p.add_argument(
        "--meshd-cache-mib",
        type=float,
        default=0.0,
        help="model bytes per meshd runtime (default: --cache-models x the mean model size); "
        "e.g. what Ray's replicas held, for a comparison on equal bytes",
    )
    p.add_argument(
        "--meshd-eviction",
        choices=("", *(e.value for e in Eviction)),
        default="",
        help="meshd's eviction order (MESHD_EVICTION; default: meshd's own, rate)",
    )
    p.add_argument(
        "--meshd-loading-threads",
        type=int,
        default=1,
        help="loads each meshd runtime runs at once (default 1: Ray Serve's multiplexing loads one model at "
        "a time per replica, under one asyncio.Lock in serve/multiplex.py; 0: the reference runtime's 2)",
    )
    p.add_argument(
        "--model-sizes",
        choices=("equal", "drawn"),
        default="equal",
        help="equal (default): every model 8 MiB, so Ray's count and meshd's bytes are the same capacity; "
        "drawn: lognormal 2-32 MiB",
    )
    p.add_argument("--requests", type=int, help="measured requests per trace (default 2000; --quick 200)")
    p.add_argument("--warmup", type=int, help="warm-up requests (default 500; --quick 50)")
    p.add_argument("--kill-requests", type=int, help="requests of the kill run, 0 = none (default 2000; --quick 0)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent (default 1.0)")
    p.add_argument(
        "--runs",
        type=int,
        help="runs of each system, order alternating; medians with the spread (default 3; --quick 1)",
    )
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="comma-separated subset of meshd, meshd-lru (meshd with LRU eviction, Ray's order), ray (Serve's HTTP "
        "ingress), ray-grpc (its gRPC ingress); default all",
    )
    p.add_argument(
        "--ray-version", default=RAY_VERSION, help=f"ray[serve] version for its venv (default {RAY_VERSION})"
    )
    p.add_argument("--quick", action="store_true", help="a short run for smoke testing")
    p.add_argument("--keep-workdir", action="store_true")
    a = p.parse_args(argv)
    defaults = {
        "models": (40, 300),
        "cache_models": (4, 16),
        "requests": (200, 2000),
        "warmup": (50, 500),
        "kill_requests": (0, 2000),
        "runs": (1, 3),
    }
    for k, (quick, full) in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, quick if a.quick else full)
    if min(a.models, a.cache_models, a.requests, a.concurrency, a.runs) < 1 or a.warmup < 0 or a.kill_requests < 0:
        p.error("--models, --cache-models, --requests, --concurrency, --runs must be >= 1; the rest >= 0")
    if a.meshd_loading_threads < 0:
        p.error("--meshd-loading-threads must be >= 0 (0: the reference runtime's default)")
    if a.meshd_cache_mib < 0 or a.meshd_cache_mib != a.meshd_cache_mib:  # NaN too
        p.error("--meshd-cache-mib must be >= 0 (0: --cache-models x the mean model size)")
    if a.kill_requests and a.kill_requests < 30:
        p.error("--kill-requests must be 0 or >= 30")
    a.system_list = [s.strip() for s in a.systems.split(",") if s.strip()]
    if not a.system_list or any(s not in SYSTEMS for s in a.system_list):
        p.error(f"--systems takes a subset of {', '.join(SYSTEMS)}")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = command_line("peers.py", argv)
    sigterm_as_interrupt()
    started = time.monotonic()
    tmp = tempfile.TemporaryDirectory(prefix="meshd-peers-")
    workdir = Path(tmp.name)
    runs: list[dict[str, tuple[list[TraceResult], KillResult | None]]] = []
    try:
        workload = build_workload(workdir / "models", args)
        costs = model_work_cpu_s(workload.mean_size)
        log(
            f"workdir {workdir}; {args.models} models (mean {workload.mean_size / MIB:.1f} MiB); model work: "
            f"{costs[0] * 1e3:.2f} ms CPU per load, {costs[1] * 1e6:.1f} us per request"
        )
        for run in range(args.runs):
            results: dict[str, tuple[list[TraceResult], KillResult | None]] = {}
            order = args.system_list if run % 2 == 0 else args.system_list[::-1]
            for s in order:
                log(f"run {run + 1}/{args.runs}: {s}")
                suffix = {"ray-grpc": "g", "meshd-lru": "l"}.get(s, "")
                where = workdir / f"run{run}{suffix}"  # short: Ray's socket paths
                if s in MESHD_SYSTEMS:
                    results[s] = run_meshd(workload, args, where, costs, s)
                else:
                    results[s] = run_ray(workload, args, where, costs, "grpc" if s == "ray-grpc" else "http")
            runs.append(results)
    except KeyboardInterrupt:
        log("interrupted; stopped every child")
        return 130
    except (StartFailed, RuntimeError) as e:
        log(f"could not run: {e}")
        return 1
    finally:
        if args.keep_workdir:
            log(f"kept {workdir}")
        else:
            tmp.cleanup()
    for line in report(runs, args, workload, command, time.monotonic() - started):
        print(line)
    bad = any(t.tally.n_errors or t.tally.wrong for r in runs for res in r.values() for t in res[0])
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
