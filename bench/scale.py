"""Scale figures of the model registry: registration rate, memory per mirrored record,
start-up time with a full registry, and watch propagation across three instances.

    python bench/scale.py [--models N] [--concurrency C] [--rate R] [--seconds S] [--quick]

One real etcd, three reference runtimes and three `meshd serve` processes (LocalMesh), every
child stopped by PID on exit. Printed figures only: no thresholds. Phases, in order:

1. start-up, empty registry: from spawning each meshd to its "ready" line (printed once its
   health is SERVING and its instance record is published; the log is polled every 10 ms).
2. registration: N registerModel calls (load=false) to instance 0's external port, C in
   flight; models/s and p50/p99 latency. Each is a CAS create plus waiting for the caller's
   own mirror to show it (read-your-writes), as meshd does for any registry write.
3. mirror catch-up and memory: wait until each instance's mirror holds revision of the last
   registration (from its watch trace, below), then RSS of each meshd before (phase 1) and
   after, as bytes per record. Complemented by tracemalloc in this process: the Python heap a
   `Table` mirror of the same N records holds (no allocator slack, no gRPC buffers).
4. direct etcd writes: the same N create-only CAS writes straight to etcd (under another
   prefix, so no instance mirrors them), C in flight: what etcd and the client allow.
5. watch propagation: record updates (a field meshd ignores, so nothing reacts) written
   straight to etcd at R/s for S s, open loop; each instance runs with MESHD_WATCH_TRACE,
   which appends "<revision> <wall ns>" as each watch batch is applied to its mirror. The
   delay of an update on an instance is (trace time of its revision - time just before its
   put was sent): etcd's commit, the watch stream and meshd's decode and apply, per instance.
   Same host, same wall clock; no polling error.
6. start-up, full registry: instance 2 is stopped and started again with the N records in
   etcd: spawn to "ready" as in phase 1.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import gc
import os
import platform
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import grpc

# Runnable as a plain script from a checkout: make `meshd` importable.
_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from _shared import (  # noqa: E402 - bench/ is on sys.path
    asyncio_run,
    command_line,
    cpu_seconds,
    log,
    mesh_of_run,
    rss_bytes,
    run_pool,
    sigterm_as_interrupt,
)

from meshd._proto.mmesh import model_mesh_pb2 as mm  # noqa: E402
from meshd.core.records import ModelRecord  # noqa: E402
from meshd.demo import percentile  # noqa: E402
from meshd.kv.etcd import EtcdStore  # noqa: E402
from meshd.kv.store import Event, KeyValue, put_if  # noqa: E402
from meshd.kv.table import Table  # noqa: E402
from meshd.kv.watch_trace import read_trace  # noqa: E402
from meshd.testing.cluster import LocalMesh, MeshClient, Node, StartFailed  # noqa: E402
from meshd.testing.procs import free_port, wait_until  # noqa: E402

INSTANCES = 3
READY_POLL_S = 0.01
CATCH_UP_TIMEOUT_S = 600.0
SETTLE_S = 2.0  # before an RSS reading: let the allocator and background tasks settle
# The leader's preload sweep would start loading the benchmark's (file-less) models mid-run.
NODE_SETTINGS: dict[str, str | int] = {"leader_sweep_ms": 24 * 3_600_000}


def model_id(i: int) -> str:
    return f"scale-{i:06d}"


def model_path(i: int) -> str:
    return f"/models/scale/{model_id(i)}"


# ---- phases ----------------------------------------------------------------------------------
def start_timed(mesh: LocalMesh, node_id: str, runtime_port: int, trace: Path, log_name: str) -> tuple[Node, float]:
    """Spawn a meshd and return it with the seconds from spawn to its "ready" line."""
    grpc_port, peer_port = free_port(), free_port()
    t0 = time.monotonic()
    child = mesh.start_meshd(
        node_id, runtime_port, {**NODE_SETTINGS, "watch_trace": str(trace)}, grpc_port, peer_port, name=log_name
    )

    def ready() -> bool:
        if not child.alive():
            raise StartFailed(f"{child.name} exited:\n{child.log_tail()}")
        try:
            return f"meshd {node_id} ready:" in child.log_path.read_text(errors="replace")
        except OSError:
            return False

    wait_until(ready, CATCH_UP_TIMEOUT_S, f"{node_id} ready line", interval_s=READY_POLL_S)
    elapsed = time.monotonic() - t0
    return Node(node_id, grpc_port, peer_port, runtime_port, child, child), elapsed


async def timed_pool(n: int, concurrency: int, op: Callable[[int], Awaitable[None]]) -> tuple[float, list[float]]:
    """Run op(0..n-1) on `concurrency` workers: (wall seconds, latency ms of each op)."""
    latencies: list[float] = []

    async def timed(i: int) -> None:
        t = time.perf_counter()
        await op(i)
        latencies.append((time.perf_counter() - t) * 1e3)

    t0 = time.perf_counter()
    await run_pool(n, concurrency, timed)
    return time.perf_counter() - t0, latencies


async def register_all(node: Node, n: int, concurrency: int, log: Callable[[str], None]) -> tuple[float, list[float]]:
    client = MeshClient.open(node)

    async def register(i: int) -> None:
        info = mm.ModelInfo(type="demo", path=model_path(i))
        await client.mm.registerModel(mm.RegisterModelRequest(modelId=model_id(i), modelInfo=info), timeout=60)
        if (i + 1) % max(1, n // 5) == 0:
            log(f"  registered {i + 1}/{n}")

    try:
        return await timed_pool(n, concurrency, register)
    finally:
        await client.close()


def record_bytes(i: int, seq: int | None = None) -> bytes:
    """What registerModel(load=false) stores, plus a field meshd keeps but ignores."""
    rec = ModelRecord(type="demo", path=model_path(i), last_used=int(time.time() * 1000) - 6 * 3_600_000)
    if seq is not None:
        rec.extra["benchSeq"] = seq
    return rec.encode()


async def direct_writes(etcd_url: str, n: int, concurrency: int) -> tuple[float, list[float]]:
    store = EtcdStore.from_url(etcd_url)
    prefix = f"bench-direct/{uuid.uuid4().hex[:8]}/"

    async def write(i: int) -> None:
        result = await put_if(store, prefix + model_id(i), record_bytes(i), 0)
        if not result.succeeded:
            raise RuntimeError(f"direct write {i} lost its create-only CAS")

    try:
        return await timed_pool(n, concurrency, write)
    finally:
        await store.close()


async def last_revision(etcd_url: str, prefix: str) -> int:
    store = EtcdStore.from_url(etcd_url)
    try:
        # The revision of any read is the store's current revision; this range is empty.
        _, rev = await store.range_prefix(prefix + "\0")
        return rev
    finally:
        await store.close()


def wait_traces(traces: Sequence[Path], revision: int, timeout_s: float) -> None:
    """Until every instance's mirror has applied `revision` (a line at or past it)."""

    def caught_up(path: Path) -> bool:
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 200))
                lines = f.read().split(b"\n")
        except OSError:
            return False
        revs = [int(ln.split()[0]) for ln in lines if len(ln.split()) == 2]
        return bool(revs) and revs[-1] >= revision

    wait_until(lambda: all(caught_up(p) for p in traces), timeout_s, f"mirrors at revision {revision}", 0.05)


async def propagation(
    etcd_url: str, registry_prefix: str, n_models: int, rate: int, seconds: float
) -> tuple[list[tuple[int, int]], float, list[float]]:
    """Open-loop updates at `rate`/s: [(revision, ns just before the put was sent)], achieved
    rate, and each put's round trip in ms (etcd's share of the delay, and the writer's)."""
    store = EtcdStore.from_url(etcd_url)
    total = int(rate * seconds)
    sent: list[tuple[int, int]] = []
    round_trips_ms: list[float] = []
    values = [(registry_prefix + model_id(k % n_models), record_bytes(k % n_models, k)) for k in range(total)]

    async def put(key: str, value: bytes) -> None:
        t = time.time_ns()
        rev = await store.put(key, value)
        round_trips_ms.append((time.time_ns() - t) / 1e6)
        sent.append((rev, t))

    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tasks: list[asyncio.Task[None]] = []
        for k, (key, value) in enumerate(values):
            delay = t0 + k / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(put(key, value)))
        await asyncio.gather(*tasks)
        achieved = total / (loop.time() - t0)
    finally:
        await store.close()
    return sorted(sent), achieved, round_trips_ms


def delays_ms(sent: list[tuple[int, int]], trace: list[tuple[int, int]]) -> list[float]:
    """Per update: first trace line at or past its revision, minus its send time."""
    trace = sorted(trace)
    revs = [r for r, _ in trace]
    out: list[float] = []
    for rev, t_sent in sent:
        k = bisect.bisect_left(revs, rev)
        if k < len(trace):
            out.append((trace[k][1] - t_sent) / 1e6)
    return out


# ---- in-process complement: a Table's heap per record -----------------------------------------
class _Snapshot:
    """Just enough of a KVStore for `Table.start`: a fixed listing, a watch that never fires.

    Values are fresh bytes on each listing, as from etcd, so the mirror's copy is counted."""

    def __init__(self, kvs: list[tuple[str, bytes]]) -> None:
        self.kvs = sorted(kvs)
        self.keys = [k for k, _ in self.kvs]

    async def range_page(
        self, prefix: str, after: str | None, limit: int, revision: int
    ) -> tuple[list[KeyValue], int, bool]:
        start = 0 if after is None else bisect.bisect_right(self.keys, after)
        page = [
            KeyValue(k, bytes(bytearray(v)), r + 1, r + 1)
            for r, (k, v) in enumerate(self.kvs[start : start + limit], start)
        ]
        return page, len(self.kvs), start + limit < len(self.kvs)

    async def _never(self) -> AsyncIterator[list[Event]]:
        await asyncio.Event().wait()
        yield []

    def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[list[Event]]:
        return self._never()


async def table_heap_bytes(n: int) -> tuple[int, int]:
    """The Python heap a Table mirror of `n` records holds once started, and its peak while
    starting (the listing's pages in flight as well), both over the heap before."""
    snapshot = _Snapshot([(f"r/{model_id(i)}", record_bytes(i)) for i in range(n)])
    table: Table[ModelRecord] = Table(snapshot, "r/", ModelRecord.decode, ModelRecord.encode)  # type: ignore[arg-type]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    await table.start()
    gc.collect()
    after, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    await table.stop()
    assert len(table) == n
    return after - before, peak - before


# ---- the run ---------------------------------------------------------------------------------
def run(args: argparse.Namespace, workdir: Path, log: Callable[[str], None]) -> list[str]:
    out: list[str] = []
    mesh = LocalMesh(workdir / "mesh", service=f"scale-{uuid.uuid4().hex[:8]}")
    traces = [workdir / f"trace-{i}.txt" for i in range(INSTANCES)]
    with mesh_of_run(mesh):
        mesh.start_etcd()
        registry_prefix = f"/tas-runtime/{mesh.service}/registry/"
        nodes: list[Node] = []
        empty_start: list[float] = []
        for i in range(INSTANCES):
            runtime, port = mesh.start_runtime(f"scale-{i}-runtime")
            node, s = start_timed(mesh, f"scale-{i}", port, traces[i], f"scale-{i}")
            node.runtime = runtime
            nodes.append(node)
            empty_start.append(s)
        log(
            f"up: etcd pid {mesh.etcd.pid if mesh.etcd else '?'}; "
            + "; ".join(f"{n.instance_id} meshd pid {n.meshd.pid}" for n in nodes)
        )
        time.sleep(SETTLE_S)
        rss0 = [rss_bytes(n.meshd.pid) for n in nodes]
        cpu0 = [cpu_seconds(n.meshd.pid) for n in nodes]

        log(f"registering {args.models} models through {nodes[0].instance_id}, {args.concurrency} in flight")
        reg_s, reg_lat = asyncio_run(register_all(nodes[0], args.models, args.concurrency, log))
        rev = asyncio_run(last_revision(mesh.etcd_url, registry_prefix))
        t_wait = time.monotonic()
        wait_traces(traces, rev, CATCH_UP_TIMEOUT_S)
        catch_up_s = time.monotonic() - t_wait
        time.sleep(SETTLE_S)
        rss1 = [rss_bytes(n.meshd.pid) for n in nodes]
        cpu1 = [cpu_seconds(n.meshd.pid) for n in nodes]

        log("in-process: tracemalloc of a Table mirror")
        heap, heap_peak = asyncio_run(table_heap_bytes(args.models))

        log(f"direct etcd writes: {args.models}, {args.concurrency} in flight")
        direct_s, direct_lat = asyncio_run(direct_writes(mesh.etcd_url, args.models, args.concurrency))

        log(f"watch propagation: {args.rate} updates/s for {args.seconds:g} s")
        cpu2 = [cpu_seconds(n.meshd.pid) for n in nodes]
        sent, achieved, put_ms = asyncio_run(
            propagation(mesh.etcd_url, registry_prefix, args.models, args.rate, args.seconds)
        )
        wait_traces(traces, sent[-1][0], CATCH_UP_TIMEOUT_S)
        cpu3 = [cpu_seconds(n.meshd.pid) for n in nodes]
        per_instance = [delays_ms(sent, read_trace(p)) for p in traces]

        log(f"restarting {nodes[2].instance_id} with {args.models} records in etcd")
        nodes[2].meshd.stop(sig=nodes[2].meshd.teardown_signal)
        full_trace = workdir / "trace-restart.txt"
        restarted, full_start = start_timed(
            mesh, nodes[2].instance_id, nodes[2].runtime_port, full_trace, f"{nodes[2].instance_id}-restarted"
        )
        time.sleep(SETTLE_S)
        rss_restart = rss_bytes(restarted.meshd.pid)

    n = args.models
    mib = 1 << 20
    out.append(f"start-up to ready, empty registry:   {', '.join(f'{s:.2f} s' for s in empty_start)}")
    out.append(f"start-up to ready, {n} records:  {full_start:.2f} s (instance 2 restarted)")
    out.append(
        f"registration via API: {n / reg_s:.0f} models/s ({n} in {reg_s:.1f} s, {args.concurrency} in flight), "
        f"p50 {percentile(reg_lat, 50):.1f} ms, p99 {percentile(reg_lat, 99):.1f} ms; "
        f"meshd CPU {(cpu1[0] - cpu0[0]) / n * 1e3:.2f} ms/model on the registering instance"
    )
    out.append(
        f"direct etcd CAS creates: {n / direct_s:.0f} records/s, p50 {percentile(direct_lat, 50):.1f} ms, "
        f"p99 {percentile(direct_lat, 99):.1f} ms; API/direct rate {direct_s and (n / reg_s) / (n / direct_s):.2f}"
    )
    out.append(f"mirror catch-up after the last registration: {catch_up_s:.2f} s (all three instances)")
    for i, node in enumerate(nodes):
        out.append(
            f"memory {node.instance_id}: RSS {rss0[i] / mib:.1f} -> {rss1[i] / mib:.1f} MiB, "
            f"{(rss1[i] - rss0[i]) / n:.0f} bytes/record"
            + (
                " (also served the registrations)"
                if i == 0
                else f"; mirror CPU {(cpu1[i] - cpu0[i]) / n * 1e6:.0f} us/record"
            )
        )
    out.append(
        f"memory {nodes[2].instance_id} restarted with {n} records: RSS {rss_restart / mib:.1f} MiB, "
        f"{(rss_restart - rss0[2]) / n:.0f} bytes/record over its empty start"
    )
    out.append(
        f"tracemalloc, Table mirror in-process: {heap / n:.0f} bytes/record ({heap / mib:.1f} MiB for {n}); "
        f"peak while listing {heap_peak / n:.0f} bytes/record"
    )
    out.append(
        f"watch propagation: {len(sent)} updates at {achieved:.0f}/s achieved ({args.rate}/s asked), {args.seconds:g} s"
    )
    out.append(
        f"  etcd put round trip seen by the writer: p50 {percentile(put_ms, 50):.1f} ms, "
        f"p99 {percentile(put_ms, 99):.1f} ms, max {max(put_ms):.1f} ms"
    )
    for i, node in enumerate(nodes):
        d = per_instance[i]
        out.append(
            f"  {node.instance_id}: {len(d)} seen, p50 {percentile(d, 50):.1f} ms, p99 {percentile(d, 99):.1f} ms, "
            f"max {max(d) if d else float('nan'):.1f} ms; "
            f"meshd CPU {(cpu3[i] - cpu2[i]) / max(1, len(sent)) * 1e6:.0f} us/update"
        )
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--models", type=int, default=None, help="records to register (default 100000; --quick 300)")
    p.add_argument("--concurrency", type=int, default=32, help="registrations in flight (default 32)")
    p.add_argument("--rate", type=int, default=None, help="record updates per second (default 1000; --quick 200)")
    p.add_argument("--seconds", type=float, default=None, help="seconds of updates (default 30; --quick 2)")
    p.add_argument("--quick", action="store_true", help="a small run for the smoke test")
    p.add_argument("--keep-workdir", action="store_true")
    a = p.parse_args(argv)
    a.models = a.models if a.models is not None else (300 if a.quick else 100_000)
    a.rate = a.rate if a.rate is not None else (200 if a.quick else 1000)
    a.seconds = a.seconds if a.seconds is not None else (2.0 if a.quick else 30.0)
    if a.models < 1 or a.concurrency < 1 or a.rate < 1 or a.seconds <= 0:
        p.error("--models, --concurrency and --rate must be >= 1, --seconds > 0")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = command_line("scale.py", argv)
    sigterm_as_interrupt()

    started = time.monotonic()
    tmp = tempfile.TemporaryDirectory(prefix="meshd-scale-bench-")
    try:
        lines = run(args, Path(tmp.name), log)
    except KeyboardInterrupt:
        log("interrupted; stopped every child")
        return 130
    except (StartFailed, TimeoutError, grpc.aio.AioRpcError) as e:
        log(f"scale benchmark failed: {e}")
        return 1
    finally:
        if args.keep_workdir:
            log(f"kept {tmp.name}")
        else:
            tmp.cleanup()
    print(f"command: {command}")
    print(
        f"python {platform.python_version()}, grpcio {grpc.__version__}, {os.cpu_count()} cpus; "
        f"{INSTANCES} instances; elapsed {time.monotonic() - started:.0f} s"
    )
    for line in lines:
        print(line)
    print("summary: ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
