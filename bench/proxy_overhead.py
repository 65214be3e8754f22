"""What meshd costs on the inference path, next to a direct call and a bare Python proxy.

    python bench/proxy_overhead.py [--duration S] [--repeat N] [--quick | --smoke]

Starts etcd, one reference runtime (`python -m meshd.runtimes.demo`) and one meshd via
LocalMesh in a temporary directory, plus `bench/bare_proxy.py` in front of the same
runtime. Registers and loads (sync) one echo model, then, for payloads of ~100 B and
1 MiB and concurrency 1, 8 and 64, drives three targets on that same warm model:

    direct  the runtime's own port
    bare    bare_proxy.py -> runtime       (what any Python gRPC hop costs)
    meshd   meshd -> runtime               (what we cost)
    native  meshd with MESHD_DATAPLANE=native: HAProxy -> runtime, meshd its control plane
            (its own runtime and meshd, same arguments; CPU = HAProxy + meshd). Left out, and
            said so, when no HAProxy can be found or fetched (meshd.testing.haproxy)
    http    meshd's KServe V2 REST port -> runtime (unary only: the same echo request as
            the binary-data extension, JSON header + raw tensor, output asked for as binary;
            the load generator is aiohttp, so compare its CPU per request with care)

The load generator is this process (grpc.aio, one channel per target, N tasks each
sending the same pre-serialised request bytes in a loop). Each case prints req/s,
p50/p99 latency and CPU per request of the proxy and the runtime, from /proc/<pid>/stat
utime+stime deltas over the measured window. Ratios are computed within each run and
the medians across --repeat runs are printed (absolute numbers on a shared 2-core
machine drift; ratios measured side by side drift much less). Targets run in a
different order in each repeat so warm-up and drift do not favour one of them.

Every child process is stopped by PID on exit, including on failure and Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

# Runnable as a plain script from a checkout: make `meshd` importable.
_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from _shared import asyncio_run, sigterm_as_interrupt, stop_uninterrupted  # noqa: E402 - bench/ is on sys.path
from _shared import cpu_seconds as process_cpu_seconds  # noqa: E402

from meshd._proto.mmesh import model_mesh_pb2 as mm  # noqa: E402
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc  # noqa: E402
from meshd.runtimes.models import make_echo_request, write_echo_model  # noqa: E402
from meshd.testing import haproxy  # noqa: E402
from meshd.testing.cluster import LocalMesh, Node  # noqa: E402
from meshd.testing.procs import Child, free_port, port_open, wait_until  # noqa: E402

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
MODEL_ID = "bench-echo"
TINY_PAYLOAD = 64  # raw tensor bytes; the serialised ModelInferRequest is ~100 B
BIG_PAYLOAD = 1 << 20  # 1 MiB: well under meshd's 16 MiB and the runtime's 64 MiB limits
CLIENT_MAX_MESSAGE = 64 << 20
RPC_TIMEOUT_S = 30.0
TARGETS = ("direct", "bare", "meshd", "native", "http")
GRPC_TARGETS = ("direct", "bare", "meshd")
T = TypeVar("T")


# ---- CPU accounting ------------------------------------------------------------------------
def cpu_seconds(pids: int | tuple[int, ...]) -> float:
    """utime + stime of whole processes (all threads), in seconds."""
    return sum(process_cpu_seconds(pid) for pid in ((pids,) if isinstance(pids, int) else pids))


def self_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


# ---- results ---------------------------------------------------------------------------------
@dataclass
class Measured:
    """One target in one case in one run."""

    requests: int
    errors: int
    window_s: float
    latencies_s: list[float]
    cpu_s: dict[str, float]  # process role -> CPU seconds over the window ("proxy", "runtime", "client")

    @property
    def rps(self) -> float:
        return self.requests / self.window_s if self.window_s > 0 else 0.0

    def pct_ms(self, q: float) -> float:
        if not self.latencies_s:
            return float("nan")
        lat = sorted(self.latencies_s)
        k = min(len(lat) - 1, max(0, round(q * (len(lat) - 1))))
        return lat[k] * 1e3

    def cpu_us_per_req(self, role: str) -> float:
        if role not in self.cpu_s or not self.requests:
            return float("nan")
        return self.cpu_s[role] / self.requests * 1e6


@dataclass(frozen=True)
class Case:
    payload_name: str
    payload_bytes: int
    concurrency: int
    shape: str = "unary"  # or "stream": one ModelStreamInfer stream per task, one message at a time

    @property
    def label(self) -> str:
        return self.payload_name if self.shape == "unary" else f"{self.payload_name}~s"


@dataclass
class Results:
    runs: dict[tuple[Case, str], list[Measured]] = field(default_factory=dict)

    def add(self, case: Case, target: str, m: Measured) -> None:
        self.runs.setdefault((case, target), []).append(m)

    def per_run(self, case: Case, target: str) -> list[Measured]:
        return self.runs.get((case, target), [])


def median(values: Sequence[float]) -> float:
    vals = [v for v in values if v == v]  # drop NaN
    return statistics.median(vals) if vals else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")


# ---- load generation -------------------------------------------------------------------------
@dataclass
class Window:
    """What the load tasks read: whether the measured window is open, and whether to stop."""

    recording: bool = False
    stop: bool = False


async def measure(
    window: Window,
    worker: Callable[[], Coroutine[Any, Any, None]],
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    pids: dict[str, int | tuple[int, ...]],
) -> tuple[float, dict[str, float]]:
    """`concurrency` tasks of `worker` through the warm-up, then the window recorded: its
    seconds and the CPU seconds of each role's process over it ("client": this process)."""
    perf = time.perf_counter
    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        await _sleep_or_fail(warmup_s, tasks)
        cpu0 = {role: cpu_seconds(pid) for role, pid in pids.items()}
        client0 = self_cpu_seconds()
        t0 = perf()
        window.recording = True
        await _sleep_or_fail(duration_s, tasks)
        window.recording = False
        t1 = perf()
        cpu1 = {role: cpu_seconds(pid) for role, pid in pids.items()}
        client1 = self_cpu_seconds()
        window.stop = True
        await asyncio.gather(*tasks)
    finally:
        window.stop = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    cpu = {role: cpu1[role] - cpu0[role] for role in pids}
    cpu["client"] = client1 - client0
    return t1 - t0, cpu


async def drive(
    channel: grpc.aio.Channel,
    request: bytes,
    metadata: tuple[tuple[str, str], ...],
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    pids: dict[str, int | tuple[int, ...]],
    shape: str = "unary",
) -> Measured:
    """N tasks sending `request` in a loop; only the window after warm-up is recorded.

    shape "stream": each task opens one ModelStreamInfer stream and sends `request` on it,
    waiting for each answer before the next (a request is one message each way)."""
    call = channel.unary_unary(INFER)  # no serialisers: bytes in, bytes out
    open_stream = channel.stream_stream(STREAM_INFER)
    window = Window()
    latencies: list[float] = []
    errors = 0  # in the window
    all_errors = 0
    expected_len = len(request)  # echo: the response is about the request's size
    perf = time.perf_counter

    async def stream_worker() -> None:
        stream = open_stream(metadata=metadata, timeout=3600)
        try:
            while not window.stop:
                t0 = perf()
                await stream.write(request)
                resp = await stream.read()
                if resp is grpc.aio.EOF:
                    raise RuntimeError(f"stream ended: {await stream.code()} {await stream.details()}")
                if window.recording:
                    latencies.append(perf() - t0)
                elif len(resp) < expected_len // 2:
                    raise RuntimeError(f"short response: {len(resp)} bytes for a {expected_len}-byte request")
        finally:
            stream.cancel()

    async def worker() -> None:
        nonlocal errors, all_errors
        while not window.stop:
            t0 = perf()
            try:
                resp = await call(request, metadata=metadata, timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                all_errors += 1
                if all_errors == 1:  # what went wrong, once per case: the count alone says little
                    print(f"  first error: {e.code().name}: {e.details()}", file=sys.stderr, flush=True)
                if window.recording:
                    errors += 1
                if all_errors > 100:
                    raise RuntimeError(f"too many errors, last: {e.code().name}: {e.details()}") from None
                continue
            if window.recording:
                latencies.append(perf() - t0)
            elif len(resp) < expected_len // 2:  # sanity check, outside the window
                raise RuntimeError(f"short response: {len(resp)} bytes for a {expected_len}-byte request")

    run = stream_worker if shape == "stream" else worker
    seconds, cpu = await measure(window, run, concurrency, warmup_s, duration_s, pids)
    return Measured(len(latencies), errors, seconds, latencies, cpu)


def http_echo_body(payload_bytes: int) -> tuple[bytes, dict[str, str]]:
    """The echo request as KServe V2 HTTP with the binary-data extension, and its headers."""
    raw = make_echo_request(MODEL_ID, payload_bytes).raw_input_contents[0]
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [payload_bytes],
                    "datatype": "UINT8",
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    headers = {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"}
    return header + raw, headers


async def drive_http(
    url: str,
    payload_bytes: int,
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    pids: dict[str, int | tuple[int, ...]],
) -> Measured:
    """`drive` over HTTP: N tasks posting the echo request to meshd's REST port in a loop."""
    import aiohttp

    body, headers = http_echo_body(payload_bytes)
    window = Window()
    latencies: list[float] = []
    errors = 0
    perf = time.perf_counter
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=RPC_TIMEOUT_S)) as http:

        async def worker() -> None:
            nonlocal errors
            while not window.stop:
                t0 = perf()
                async with http.post(url, data=body, headers=headers) as resp:
                    answer = await resp.read()
                if resp.status != 200:
                    errors += 1
                    if errors > 100:
                        raise RuntimeError(f"too many errors, last: {resp.status} {answer[:200]!r}")
                    continue
                if window.recording:
                    latencies.append(perf() - t0)
                elif len(answer) < payload_bytes:
                    raise RuntimeError(f"short response: {len(answer)} bytes for a {payload_bytes}-byte tensor")

        seconds, cpu = await measure(window, worker, concurrency, warmup_s, duration_s, pids)
    return Measured(len(latencies), errors, seconds, latencies, cpu)


async def _sleep_or_fail(seconds: float, tasks: list[asyncio.Task[None]]) -> None:
    done, _ = await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_EXCEPTION)
    for t in done:
        t.result()  # raises a worker's error
    if done:
        raise RuntimeError("a load task stopped early")


# ---- setup -----------------------------------------------------------------------------------
def start_bare_proxy(log_dir: Path, target: str) -> tuple[Child, int]:
    port = free_port()
    argv = [sys.executable, str(Path(__file__).resolve().parent / "bare_proxy.py")]
    child = Child("bare-proxy", [*argv, "--port", str(port), "--target", target], log_dir)

    def up() -> bool:
        if not child.alive():
            raise RuntimeError(f"bare proxy exited with {child.proc.returncode}:\n{child.log_tail()}")
        return port_open(port)

    try:
        wait_until(up, 30.0, f"bare proxy on port {port}")
    except BaseException:
        child.stop()
        raise
    return child, port


async def register_echo(node: Node, model_path: Path) -> None:
    async with grpc.aio.insecure_channel(node.target) as ch:
        stub = mm_grpc.ModelMeshStub(ch)
        info = mm.ModelInfo(type="demo", path=str(model_path))
        await stub.registerModel(
            mm.RegisterModelRequest(modelId=MODEL_ID, modelInfo=info, loadNow=True, sync=True), timeout=60
        )


def start_native(
    workdir: Path,
    etcd_url: str,
    runtime_args: list[str],
    meshd_settings: dict[str, str | int],
    log: Callable[[str], None],
) -> tuple[LocalMesh | None, NativeNode | None]:
    """A meshd with the native data plane beside its own runtime (same arguments), in a
    service of its own on the same etcd; (None, None) when no HAProxy can be had here."""
    found = haproxy.find_or_fetch()
    if found is None:
        log("no HAProxy found or fetched: the native column is left out")
        return None, None
    settings = {**meshd_settings, "data_plane": "native", "haproxy": found}
    if "metrics" in settings:
        settings["metrics"] = f"prometheus:port={free_port()}"
    settings.pop("serving_socket", None)  # its own runtime, reached over TCP
    native_mesh = LocalMesh(workdir / "native", service=f"bench-native-{uuid.uuid4().hex[:8]}")
    native_mesh.etcd_url = etcd_url
    try:
        node = native_mesh.add_node("bench-native", runtime_args=runtime_args, settings=settings)
        pid = haproxy.child_of(node.meshd.pid)
        if pid is None:
            raise RuntimeError("meshd --dataplane native is running without an haproxy child")
    except BaseException:
        stop_uninterrupted(native_mesh)
        raise
    log(f"native: meshd {node.meshd.pid}, haproxy {pid} ({found}), runtime {node.runtime.pid}")
    return native_mesh, NativeNode(node, pid)


# ---- the run ---------------------------------------------------------------------------------
@dataclass
class Settings:
    duration_s: float
    warmup_s: float
    repeat: int
    payloads: list[tuple[str, int]]
    concurrencies: list[int]
    stream_concurrencies: list[int] = field(default_factory=lambda: [1, 8])
    unix_socket: bool = False
    direct_port: int = 0  # the runtime's inference TCP port

    def cases(self) -> list[Case]:
        unary = [Case(n, b, c) for n, b in self.payloads for c in self.concurrencies]
        name, size = self.payloads[0]
        return unary + [Case(name, size, c, "stream") for c in self.stream_concurrencies]


@dataclass
class NativeNode:
    """The meshd running the native data plane, beside its own runtime."""

    node: Node
    haproxy_pid: int


async def run_all(
    settings: Settings,
    node: Node,
    bare: Child,
    bare_port: int,
    native: NativeNode | None,
    log: Callable[[str], None],
) -> Results:
    opts = [
        ("grpc.max_receive_message_length", CLIENT_MAX_MESSAGE),
        ("grpc.max_send_message_length", CLIENT_MAX_MESSAGE),
    ]
    addrs = {
        "direct": f"127.0.0.1:{settings.direct_port}",
        "bare": f"127.0.0.1:{bare_port}",
        "meshd": node.target,
    }
    if native is not None:
        addrs["native"] = native.node.target
    pids: dict[str, dict[str, int | tuple[int, ...]]] = {
        "direct": {"runtime": node.runtime.pid},
        "bare": {"proxy": bare.pid, "runtime": node.runtime.pid},
        "meshd": {"proxy": node.meshd.pid, "runtime": node.runtime.pid},
        "http": {"proxy": node.meshd.pid, "runtime": node.runtime.pid},
    }
    if native is not None:
        pids["native"] = {
            "proxy": (native.node.meshd.pid, native.haproxy_pid),
            "haproxy": native.haproxy_pid,  # the split of "proxy", for the report
            "control": native.node.meshd.pid,
            "runtime": native.node.runtime.pid,
        }
    http_url = f"{node.http_url}/v2/models/{MODEL_ID}/infer"
    # One channel (one HTTP/2 connection) per target, kept for the whole run.
    channels = {t: grpc.aio.insecure_channel(a, options=opts) for t, a in addrs.items()}
    metadata = (("mm-model-id", MODEL_ID),)
    results = Results()
    try:
        requests = {size: make_echo_request(MODEL_ID, size).SerializeToString() for _, size in settings.payloads}
        for rep in range(settings.repeat):
            order = TARGETS[rep % len(TARGETS) :] + TARGETS[: rep % len(TARGETS)]
            for case in settings.cases():
                for target in order:
                    if target == "http" and case.shape != "unary":
                        continue  # no streams over HTTP
                    if target not in pids:
                        continue  # no native data plane here
                    if target == "http":
                        m = await drive_http(
                            http_url,
                            case.payload_bytes,
                            case.concurrency,
                            settings.warmup_s,
                            settings.duration_s,
                            pids[target],
                        )
                    else:
                        m = await drive(
                            channels[target],
                            requests[case.payload_bytes],
                            metadata,
                            case.concurrency,
                            settings.warmup_s,
                            settings.duration_s,
                            pids[target],
                            case.shape,
                        )
                    results.add(case, target, m)
                    log(
                        f"  run {rep + 1}/{settings.repeat} {case.label:>7} c={case.concurrency:<3} {target:<6} "
                        f"{m.rps:9.0f} req/s  p50 {m.pct_ms(0.5):7.3f} ms  p99 {m.pct_ms(0.99):7.3f} ms"
                        # as before, the HTTP line shows no error count
                        + (f"  errors {m.errors}" if m.errors and target != "http" else "")
                    )
    finally:
        for ch in channels.values():
            await ch.close()
    return results


# ---- report ----------------------------------------------------------------------------------
def fmt(v: float, spec: str) -> str:
    return "-" if v != v else format(v, spec)


def report(results: Results, settings: Settings, command: str, elapsed_s: float) -> list[str]:
    out: list[str] = []
    cases = sorted({c for c, _ in results.runs}, key=lambda c: (c.shape, c.payload_bytes, c.concurrency))
    runs = settings.repeat
    out.append("")
    out.append(f"command: {command}")
    out.append(
        f"python {platform.python_version()}, grpcio {grpc.__version__}, {os.cpu_count()} cpus, "
        f"{runs} run(s) x {settings.duration_s:g} s per case (+{settings.warmup_s:g} s warm-up); "
        f"medians across runs; elapsed {elapsed_s:.0f} s"
    )
    out.append("")
    out.append("Per target (CPU = utime+stime of that process over the window / requests)")
    hdr = (
        f"{'payload':>7} {'conc':>4} {'target':<6} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'proxy us/req':>12} {'runtime us/req':>14} {'proxy/runtime':>13} {'client us/req':>13} {'errors':>6}"
    )
    out.append(hdr)
    out.append("-" * len(hdr))
    for case in cases:
        for target in TARGETS:
            ms = results.per_run(case, target)
            if not ms:
                continue
            proxy = median([m.cpu_us_per_req("proxy") for m in ms])
            rt = median([m.cpu_us_per_req("runtime") for m in ms])
            proxy_rt = median([ratio(m.cpu_us_per_req("proxy"), m.cpu_us_per_req("runtime")) for m in ms])
            out.append(
                f"{case.label:>7} {case.concurrency:>4} {target:<6} "
                f"{fmt(median([m.rps for m in ms]), '9.0f')} "
                f"{fmt(median([m.pct_ms(0.5) for m in ms]), '8.3f')} "
                f"{fmt(median([m.pct_ms(0.99) for m in ms]), '8.3f')} "
                f"{fmt(proxy, '12.1f'):>12} {fmt(rt, '14.1f'):>14} "
                f"{fmt(proxy_rt, '13.2f'):>13} "
                f"{fmt(median([m.cpu_us_per_req('client') for m in ms]), '13.1f'):>13} "
                f"{sum(m.errors for m in ms):>6}"
            )
        out.append("")

    out.append("Ratios (computed within each run, then the median across runs)")
    hdr2 = (
        f"{'payload':>7} {'conc':>4} {'meshd/direct':>12} {'bare/direct':>11} {'meshd/bare':>10} "
        f"{'+p50 meshd ms':>13} {'+p50 bare ms':>12} {'meshd cpu/rt':>12} {'bare cpu/rt':>11} {'meshd/bare cpu':>14} "
        f"{'meshd cpu/direct rt':>19} {'bare cpu/direct rt':>18}"
    )
    out.append("throughput ratios are req/s; cpu ratios are proxy CPU per request over the runtime's (or bare's)")
    out.append(
        "cpu/rt divides by the runtime's CPU in the same run (behind the proxy); cpu/direct rt by the runtime's "
        "CPU when called directly, which is less at high concurrency (no proxy batching its calls)"
    )
    out.append(hdr2)
    out.append("-" * len(hdr2))
    summary: dict[tuple[str, int], dict[str, float]] = {}
    for case in cases:
        d, b, x = (results.per_run(case, t) for t in GRPC_TARGETS)
        n = min(len(d), len(b), len(x))
        row = {
            "md": median([ratio(x[i].rps, d[i].rps) for i in range(n)]),
            "bd": median([ratio(b[i].rps, d[i].rps) for i in range(n)]),
            "mb": median([ratio(x[i].rps, b[i].rps) for i in range(n)]),
            "p50m": median([x[i].pct_ms(0.5) - d[i].pct_ms(0.5) for i in range(n)]),
            "p50b": median([b[i].pct_ms(0.5) - d[i].pct_ms(0.5) for i in range(n)]),
            "cm": median([ratio(x[i].cpu_us_per_req("proxy"), x[i].cpu_us_per_req("runtime")) for i in range(n)]),
            "cb": median([ratio(b[i].cpu_us_per_req("proxy"), b[i].cpu_us_per_req("runtime")) for i in range(n)]),
            "cmb": median([ratio(x[i].cpu_us_per_req("proxy"), b[i].cpu_us_per_req("proxy")) for i in range(n)]),
            "cmd": median([ratio(x[i].cpu_us_per_req("proxy"), d[i].cpu_us_per_req("runtime")) for i in range(n)]),
            "cbd": median([ratio(b[i].cpu_us_per_req("proxy"), d[i].cpu_us_per_req("runtime")) for i in range(n)]),
        }
        summary[(case.label, case.concurrency)] = row
        out.append(
            f"{case.label:>7} {case.concurrency:>4} {fmt(row['md'], '12.2f')} {fmt(row['bd'], '11.2f')} "
            f"{fmt(row['mb'], '10.2f')} {fmt(row['p50m'], '+13.3f')} {fmt(row['p50b'], '+12.3f')} "
            f"{fmt(row['cm'], '12.2f')} {fmt(row['cb'], '11.2f')} {fmt(row['cmb'], '14.2f')} "
            f"{fmt(row['cmd'], '19.2f')} {fmt(row['cbd'], '18.2f')}"
        )
    out.append("")
    native_rows = []
    native_summary: dict[tuple[str, int], dict[str, float]] = {}
    for case in cases:
        d, x, nv = (results.per_run(case, t) for t in ("direct", "meshd", "native"))
        n = min(len(d), len(x), len(nv))
        if not n:
            continue
        row = {
            "nd": median([ratio(nv[i].rps, d[i].rps) for i in range(n)]),
            "nm": median([ratio(nv[i].rps, x[i].rps) for i in range(n)]),
            "p50n": median([nv[i].pct_ms(0.5) - d[i].pct_ms(0.5) for i in range(n)]),
            "cn": median([ratio(nv[i].cpu_us_per_req("proxy"), nv[i].cpu_us_per_req("runtime")) for i in range(n)]),
            "cnm": median([ratio(nv[i].cpu_us_per_req("proxy"), x[i].cpu_us_per_req("proxy")) for i in range(n)]),
            "cnd": median([ratio(nv[i].cpu_us_per_req("proxy"), d[i].cpu_us_per_req("runtime")) for i in range(n)]),
        }
        native_summary[(case.label, case.concurrency)] = row
        native_rows.append(
            f"{case.label:>7} {case.concurrency:>4} {fmt(row['nd'], '13.2f')} {fmt(row['nm'], '12.2f')} "
            f"{fmt(row['p50n'], '+14.3f')} {fmt(row['cn'], '13.2f')} {fmt(row['cnm'], '15.2f')} "
            f"{fmt(median([nv[i].cpu_us_per_req('haproxy') for i in range(n)]), '14.1f')} "
            f"{fmt(median([nv[i].cpu_us_per_req('control') for i in range(n)]), '12.1f')} "
            f"{fmt(row['cnd'], '20.2f')}"
        )
    if native_rows:
        out.append("Native data plane (MESHD_DATAPLANE=native: HAProxy carries, meshd controls; CPU = HAProxy + meshd)")
        hdr4 = (
            f"{'payload':>7} {'conc':>4} {'native/direct':>13} {'native/meshd':>12} {'+p50 native ms':>14} "
            f"{'native cpu/rt':>13} {'native/meshd cpu':>15} {'haproxy us/req':>14} {'meshd us/req':>12} "
            f"{'native cpu/direct rt':>20}"
        )
        out.append(hdr4)
        out.append("-" * len(hdr4))
        out.extend(native_rows)
        out.append("")
    http_rows = []
    cpu = Measured.cpu_us_per_req
    for case in cases:
        d, x, h = (results.per_run(case, t) for t in ("direct", "meshd", "http"))
        n = min(len(d), len(x), len(h))
        if not n:
            continue
        http_rows.append(
            f"{case.label:>7} {case.concurrency:>4} "
            f"{fmt(median([ratio(h[i].rps, d[i].rps) for i in range(n)]), '11.2f')} "
            f"{fmt(median([ratio(h[i].rps, x[i].rps) for i in range(n)]), '10.2f')} "
            f"{fmt(median([h[i].pct_ms(0.5) - d[i].pct_ms(0.5) for i in range(n)]), '+12.3f')} "
            f"{fmt(median([ratio(cpu(h[i], 'proxy'), cpu(h[i], 'runtime')) for i in range(n)]), '11.2f')} "
            f"{fmt(median([ratio(cpu(h[i], 'proxy'), cpu(x[i], 'proxy')) for i in range(n)]), '13.2f')}"
        )
    if http_rows:
        out.append("HTTP (KServe V2 REST, binary-data extension) through meshd, against direct gRPC and meshd's gRPC")
        hdr3 = (
            f"{'payload':>7} {'conc':>4} {'http/direct':>11} {'http/meshd':>10} {'+p50 http ms':>12} "
            f"{'http cpu/rt':>11} {'http/grpc cpu':>13}"
        )
        out.append(hdr3)
        out.append("-" * len(hdr3))
        out.extend(http_rows)
        out.append("")
    tiny = settings.payloads[0][0]
    c8 = summary.get((tiny, 8))
    c1 = summary.get((tiny, 1))
    if c8 and c1:
        out.append(
            f"summary: {tiny} requests, concurrency 8: meshd {c8['md']:.2f}x direct throughput "
            f"(bare proxy {c8['bd']:.2f}x; meshd/bare {c8['mb']:.2f}), meshd CPU {c8['cm']:.2f}x the runtime's "
            f"per request (bare {c8['cb']:.2f}x); concurrency 1 p50 +{c1['p50m']:.2f} ms (bare +{c1['p50b']:.2f} ms) "
            f"[median of {runs} x {settings.duration_s:g} s, grpcio {grpc.__version__}, {os.cpu_count()} cpus]"
        )
    big = summary.get((settings.payloads[-1][0], 8)) if len(settings.payloads) > 1 else None
    stream8 = summary.get((f"{tiny}~s", 8))
    goals: list[tuple[str, dict[str, float] | None, float | None]] = [
        (f"{tiny} unary, c=8", c8, 1.2),
        (f"{settings.payloads[-1][0]} unary, c=8", big, 1.0),
        (f"{tiny} stream messages, c=8", stream8, None),
    ]
    for name, figures, goal in goals:
        if figures:
            # The goal is judged on the stricter of the two denominators.
            worst = max((v for v in (figures["cm"], figures["cmd"]) if v == v), default=float("nan"))
            met = "met" if goal is not None and worst <= goal else "NOT met"
            verdict = "" if goal is None else f" (goal <= {goal:.1f}: {met})"
            out.append(
                f"meshd CPU per request / runtime CPU per request, {name}: {figures['cm']:.2f} "
                f"(over the direct run's runtime CPU: {figures['cmd']:.2f}){verdict}"
            )
    out.extend(native_goals(native_summary, tiny, settings.payloads[-1][0] if len(settings.payloads) > 1 else None))
    return out


def native_goals(summary: dict[tuple[str, int], dict[str, float]], tiny: str, big: str | None) -> list[str]:
    """The native data plane's goals (issue 18), each with its figure and whether it is met."""
    if not summary:
        return ["native data plane: not measured (no HAProxy found or fetched here; docs/native.md)"]
    checks: list[tuple[str, tuple[str, int], str, float, bool]] = [
        (f"native throughput / direct, {tiny} unary c=8", (tiny, 8), "nd", 0.7, True),
        (f"native CPU per request / runtime's, {tiny} unary c=8", (tiny, 8), "cn", 0.3, False),
        (f"native added p50 ms, {tiny} unary c=1", (tiny, 1), "p50n", 0.3, False),
    ]
    if big is not None:
        checks.append((f"native CPU per request / runtime's, {big} unary c=8", (big, 8), "cn", 0.5, False))
    out = []
    for name, key, field_name, goal, at_least in checks:
        figures = summary.get(key)
        if figures is None:
            continue
        value = figures[field_name]
        also = ""
        if field_name == "cn":  # judged on the stricter of the two denominators
            also = f" (over the direct run's runtime CPU: {figures['cnd']:.2f})"
            value = max((v for v in (value, figures["cnd"]) if v == v), default=float("nan"))
        met = value >= goal if at_least else value <= goal
        sign = ">=" if at_least else "<="
        out.append(f"{name}: {figures[field_name]:.2f}{also} (goal {sign} {goal:g}: {'met' if met else 'NOT met'})")
    return out


# ---- main ------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Settings]:
    p = argparse.ArgumentParser(
        prog="proxy_overhead.py", description="meshd vs a direct call vs a bare Python proxy, same runtime and model."
    )
    p.add_argument("--duration", type=float, help="measured seconds per case (default 3; --quick 0.5; --smoke 0.2)")
    p.add_argument("--warmup", type=float, help="warm-up seconds per case before measuring (default 0.5)")
    p.add_argument("--repeat", type=int, help="runs; medians are reported (default 3; --quick/--smoke 1)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a short run (~30 s) for smoke testing")
    mode.add_argument("--smoke", action="store_true", help="the shortest run that still covers every case")
    p.add_argument("--keep-workdir", action="store_true", help="keep the temp dir (logs) after the run")
    p.add_argument(
        "--unix-socket",
        action="store_true",
        help="meshd and the bare proxy reach the runtime's inference port over a unix socket (default TCP)",
    )
    p.add_argument("--payloads", default="100B,1MiB", help="which payloads (default 100B,1MiB)")
    p.add_argument("--no-native", action="store_true", help="leave out the native data plane column")
    p.add_argument("--concurrency", default="1,8,64", help="unary concurrencies (default 1,8,64)")
    p.add_argument("--stream-concurrency", default="1,8", help="stream concurrencies, '' for none (default 1,8)")
    a = p.parse_args(argv)
    if a.smoke:
        duration, warmup, repeat = 0.2, 0.1, 1
    elif a.quick:
        duration, warmup, repeat = 0.5, 0.2, 1
    else:
        duration, warmup, repeat = 3.0, 0.5, 3
    s = Settings(
        duration_s=a.duration if a.duration is not None else duration,
        warmup_s=a.warmup if a.warmup is not None else warmup,
        repeat=a.repeat if a.repeat is not None else repeat,
        payloads=[(n, b) for n, b in (("100B", TINY_PAYLOAD), ("1MiB", BIG_PAYLOAD)) if n in a.payloads.split(",")],
        concurrencies=_ints(p, a.concurrency),
        stream_concurrencies=_ints(p, a.stream_concurrency),
        unix_socket=a.unix_socket,
    )
    if not s.payloads:
        p.error("--payloads: name 100B and/or 1MiB")
    if s.duration_s <= 0 or s.warmup_s < 0 or s.repeat < 1:
        p.error("--duration must be > 0, --warmup >= 0, --repeat >= 1")
    return a, s


def _ints(p: argparse.ArgumentParser, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        p.error(f"not a comma-separated list of integers: {text!r}")
    if any(v < 1 for v in values):
        p.error(f"concurrency must be at least 1: {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    args, settings = parse_args(argv)
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(["proxy_overhead.py", *argv])
    sigterm_as_interrupt()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    started = time.monotonic()
    tmp = tempfile.TemporaryDirectory(prefix="meshd-bench-")
    workdir = Path(tmp.name)
    mesh = LocalMesh(workdir, service=f"bench-{uuid.uuid4().hex[:8]}")
    try:
        log(f"workdir {workdir}; starting etcd, runtime, meshd, bare proxy")
        mesh.start_etcd()
        # Capacity far beyond the one echo model, so nothing is ever evicted.
        # --inject-id: the runtime announces idInjectionPath [1] for ModelInfer, as KServe
        # adapters do, so meshd's splice (its fast path: the body already names the model) is
        # on the measured path.
        runtime_args = ["--capacity-bytes", str(1 << 30), "--inject-id"]
        native_runtime_args = list(runtime_args)  # the native meshd's own runtime: over TCP
        # Metrics on (the default in production), on a free port: their cost is measured too.
        settings_for_meshd: dict[str, str | int] = {"metrics": f"prometheus:port={free_port()}"}
        upstream = None
        direct_port = 0
        if settings.unix_socket:
            sock = workdir / "runtime-serving.sock"
            direct_port = free_port()  # the runtime serves inference on both; direct calls use TCP
            runtime_args += ["--serving-socket", str(sock), "--serving-port", str(direct_port)]
            settings_for_meshd["serving_socket"] = str(sock)
            upstream = f"unix:{sock}"
        node = mesh.add_node("bench-a", runtime_args=runtime_args, settings=settings_for_meshd)
        settings.direct_port = direct_port or node.runtime_port
        bare, bare_port = start_bare_proxy(workdir / "logs", upstream or f"127.0.0.1:{node.runtime_port}")
        native_mesh: LocalMesh | None = None
        try:
            model_path = write_echo_model(workdir / "models" / f"{MODEL_ID}.json")
            asyncio_run(register_echo(node, model_path))
            native = None
            if not args.no_native:
                native_mesh, native = start_native(workdir, mesh.etcd_url, native_runtime_args, settings_for_meshd, log)
                if native is not None:
                    asyncio_run(register_echo(native.node, model_path))
            log(
                f"pids: meshd {node.meshd.pid}, runtime {node.runtime.pid}, bare proxy {bare.pid}; "
                f"{settings.repeat} run(s) x {len(settings.cases()) * len(TARGETS)} cases x "
                f"{settings.warmup_s + settings.duration_s:g} s"
            )
            results = asyncio_run(run_all(settings, node, bare, bare_port, native, log))
        finally:
            bare.stop()
            if native_mesh is not None:
                stop_uninterrupted(native_mesh)
    except KeyboardInterrupt:
        log("interrupted; stopping children")
        return 130
    finally:
        stop_uninterrupted(mesh)
        if args.keep_workdir:
            log(f"kept {workdir}")
        else:
            tmp.cleanup()
    for line in report(results, settings, command, time.monotonic() - started):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
