"""Token streams relayed through meshd against the same engine called directly (issue 43).

    python bench/llm_relay.py [--streams 64,256,1024] [--runs 3] [--pieces 100] [--smoke]

Starts etcd and one meshd beside `meshd llm-runtime` whose engine is our own paced one
(`meshd.testing.fake_llm --token-interval-ms 20`: one SSE piece per stream every 20 ms, as a
GPU engine steps). For each number of concurrent streams it drives the engine directly and
through meshd's OpenAI port, alternating which goes first from run to run, and prints the
medians over --runs:

    pieces/s      pieces that reached the client in the measured window / its length
    ttft          time to the first piece of each stream (p50, p99), streams begun in the window
    gap           time between two arrivals of one stream's pieces (p50, p99); pieces coalesced
                  into one read count as arriving together (gap 0)
    CPU/piece     utime + stime (/proc/<pid>/stat) over the window / pieces, per process on the
                  path: meshd, its llm-runtime, HAProxy (when meshd runs one), the engine and
                  this client; `layer` is every process that is neither engine nor client, and
                  `sys` the part of `layer` spent in the kernel (stime: socket reads and writes)

Each stream is one `/v1/completions` of --pieces pieces; every client keeps one stream open at
a time and opens the next when it ends, their starts spread over one stream's length, so the
measured window (after a warm-up of one stream's length) sees a steady state. The client is a
small HTTP/1.1 reader that counts `data: ` events without parsing them, so its own CPU stays
low and the same on both paths. Every child is stopped by PID on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import grpc

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from _shared import (  # noqa: E402 - bench/ is on sys.path
    asyncio_run,
    command_line,
    cpu_seconds,
    dump_logs,
    log,
    mesh_of_run,
    sigterm_as_interrupt,
    system_seconds,
)

from meshd._proto.mmesh import model_mesh_pb2 as mm  # noqa: E402
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc  # noqa: E402
from meshd.testing.cluster import LocalMesh, Node  # noqa: E402
from meshd.testing.llm import LlmRuntimeArgs, add_llm_node  # noqa: E402

SCRIPT = "bench/llm_relay.py"
MODEL = "paced"
INTERVAL_MS = 20.0
EVENT = b"data: {"
DONE = b"data: [DONE]"
CHUNKED_END = b"0\r\n\r\n"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@dataclass
class Window:
    """What the clients saw in the measured window [start, end)."""

    start: float
    end: float
    pieces: int = 0
    errors: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    gap_ms: list[float] = field(default_factory=list)

    def inside(self, t: float) -> bool:
        return self.start <= t < self.end


class StreamReader(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection that runs streamed completions one after another.

    It counts SSE events (`data: {`) as they arrive, without parsing them: the client should
    cost the same little whatever it reads from."""

    def __init__(self, window: Window) -> None:
        self.window = window
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.tail = b""
        self.head = b""
        self.started = 0.0
        self.last = 0.0
        self.seen_first = False
        self.seen_done = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        if self.done is not None and not self.done.done():
            self.window.errors += 1
            self.done.set_result(None)

    def start(self, request: bytes) -> asyncio.Future[None]:
        assert self.transport is not None
        self.done = asyncio.get_running_loop().create_future()
        self.tail, self.head = b"", b""
        self.seen_first = self.seen_done = False
        self.started = time.perf_counter()
        self.transport.write(request)
        return self.done

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if not self.seen_first and not self.head.startswith(b"HTTP/1.1 200"):
            self.head += data[:16]
            if len(self.head) >= 12 and not self.head.startswith(b"HTTP/1.1 200"):
                log(f"stream refused: {data[:300]!r}")
                self.window.errors += 1
                assert self.transport is not None
                self.transport.close()
                return
        seen = self.tail + data
        n = seen.count(EVENT)
        if n:
            if b'"error"' in seen:
                self.window.errors += 1
            if self.window.inside(now):
                self.window.pieces += n
                if self.seen_first:
                    self.window.gap_ms.append((now - self.last) * 1000)
                    self.window.gap_ms.extend([0.0] * (n - 1))
                else:
                    self.window.gap_ms.extend([0.0] * (n - 1))
            if not self.seen_first:
                self.seen_first = True
                if self.window.inside(self.started):
                    self.window.ttft_ms.append((now - self.started) * 1000)
            self.last = now
        if DONE in seen:
            self.seen_done = True
        self.tail = seen[-16:]
        if self.seen_done and seen.endswith(CHUNKED_END) and self.done is not None and not self.done.done():
            self.done.set_result(None)


async def client(port: int, request: bytes, window: Window, begin: float, stop: float) -> None:
    """One client: streams one after another from `begin` until `stop`, on one connection."""
    await asyncio.sleep(max(0.0, begin - time.perf_counter()))
    loop = asyncio.get_running_loop()
    reader: StreamReader | None = None
    try:
        while time.perf_counter() < stop:
            if reader is None or reader.lost.done():
                _, reader = await loop.create_connection(lambda: StreamReader(window), "127.0.0.1", port)
            await reader.start(request)
    finally:
        if reader is not None and reader.transport is not None:
            reader.transport.close()


@dataclass
class Shot:
    pieces_s: float
    ttft50: float
    ttft99: float
    gap50: float
    gap99: float
    errors: int
    cpu_us: dict[str, float]  # per piece, by process role
    layer_sys_us: float  # per piece, the layer's time in the kernel


async def drive(port: int, streams: int, pieces: int, warmup_s: float, measure_s: float, pids: dict[str, int]) -> Shot:
    body = json.dumps({"model": MODEL, "prompt": "w", "repeat": pieces, "stream": True}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    now = time.perf_counter()
    stream_s = pieces * INTERVAL_MS / 1000
    window = Window(now + warmup_s, now + warmup_s + measure_s)
    tasks = [
        asyncio.create_task(client(port, request, window, now + stream_s * i / streams, window.end))
        for i in range(streams)
    ]
    await asyncio.sleep(max(0.0, window.start - time.perf_counter()))
    before = {role: cpu_seconds(pid) for role, pid in pids.items()}
    sys_before = sum(system_seconds(pid) for role, pid in pids.items() if role in LAYER)
    await asyncio.sleep(max(0.0, window.end - time.perf_counter()))
    after = {role: cpu_seconds(pid) for role, pid in pids.items()}
    sys_after = sum(system_seconds(pid) for role, pid in pids.items() if role in LAYER)
    # The streams open at the window's end finish (the next case starts on a quiet engine).
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=stream_s * 3 + 30)
    per = max(1, window.pieces)
    cpu = {role: (after[role] - before[role]) / per * 1e6 for role in pids}
    return Shot(
        window.pieces / measure_s,
        pct(window.ttft_ms, 0.5),
        pct(window.ttft_ms, 0.99),
        pct(window.gap_ms, 0.5),
        pct(window.gap_ms, 0.99),
        window.errors,
        cpu,
        (sys_after - sys_before) / per * 1e6,
    )


def _cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return 0
    return int(stat[stat.rindex(b")") + 2 :].split()[1])


def engine_of(model_id: str) -> tuple[int, int]:
    """(pid, port) of the engine meshd's runtime started for `model_id` (our engine's --name)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            argv = _cmdline(int(entry))
            if b"meshd.testing.fake_llm" in argv and argv[argv.index(b"--name") + 1] == model_id.encode():
                return int(entry), int(argv[argv.index(b"--port") + 1])
    raise RuntimeError(f"no engine found for {model_id}")


def haproxy_of(meshd_pid: int) -> int | None:
    """The HAProxy meshd runs as its native data plane, if any (a child of meshd)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _parent(int(entry)) == meshd_pid:
            argv = _cmdline(int(entry))
            if argv and b"haproxy" in Path(argv[0].decode(errors="replace")).name.encode():
                return int(entry)
    return None


def start(mesh: LocalMesh, work: Path) -> Node:
    mesh.start_etcd()
    engine = f"{sys.executable} -m meshd.testing.fake_llm --port {{port}} --name {{name}}"
    engine += f" --token-interval-ms {INTERVAL_MS:g}"
    args = LlmRuntimeArgs(Path(sys.executable), engine_command=engine, engine_args=())
    node = add_llm_node(mesh, "relay", args)
    with grpc.insecure_channel(node.target) as ch:
        info = mm.ModelInfo(type="llm", path=str(work))
        mm_grpc.ModelMeshStub(ch).registerModel(mm.RegisterModelRequest(modelId=MODEL, modelInfo=info), timeout=30)
    return node


ROLES = ("meshd", "runtime", "haproxy", "engine", "client")
LAYER = ("meshd", "runtime", "haproxy")


def rows_for(streams: int, shots: dict[str, list[Shot]]) -> list[str]:
    out = []
    for path in ("direct", "meshd"):
        s = shots[path]

        def med(f: str, s: list[Shot] = s) -> float:
            return float(statistics.median(getattr(x, f) for x in s))

        cpu = {r: statistics.median(x.cpu_us.get(r, float("nan")) for x in s) for r in ROLES}
        layer = statistics.median(sum(x.cpu_us.get(r, 0.0) for r in LAYER) for x in s)
        kernel = statistics.median(x.layer_sys_us for x in s)
        errors = sum(x.errors for x in s)
        out.append(
            f"{streams:>7} {path:6} {med('pieces_s'):9.0f} {med('ttft50'):8.2f} {med('ttft99'):8.2f} "
            f"{med('gap50'):7.2f} {med('gap99'):7.2f} {layer:7.1f} {kernel:7.1f} "
            + " ".join(f"{cpu[r]:7.1f}" if cpu[r] == cpu[r] else f"{'-':>7}" for r in ROLES)
            + f" {errors:6}"
        )
    ratio = statistics.median(m.pieces_s / d.pieces_s for m, d in zip(shots["meshd"], shots["direct"], strict=True))
    added = statistics.median(m.ttft50 - d.ttft50 for m, d in zip(shots["meshd"], shots["direct"], strict=True))
    out.append(f"{streams:>7} {'ratio':6} {ratio:9.3f} {added:+8.2f}   (meshd/direct pieces/s; added ttft p50, ms)")
    return out


async def measure(a: argparse.Namespace, node: Node) -> tuple[list[str], int]:
    """The table's rows, and how many streams failed in all."""
    engine_pid, engine_port = engine_of(MODEL)
    pids = {"meshd": node.meshd.proc.pid, "runtime": node.runtime.proc.pid, "engine": engine_pid, "client": os.getpid()}
    haproxy = haproxy_of(node.meshd.proc.pid)
    if haproxy is not None:
        pids["haproxy"] = haproxy
    ports = {"direct": engine_port, "meshd": node.http_port}
    stream_s = a.pieces * INTERVAL_MS / 1000
    rows = []
    errors = 0
    for streams in a.streams:
        shots: dict[str, list[Shot]] = {"direct": [], "meshd": []}
        for run in range(a.runs):
            order = ["direct", "meshd"] if run % 2 == 0 else ["meshd", "direct"]
            for path in order:
                shot = await drive(ports[path], streams, a.pieces, stream_s, a.seconds, pids)
                log(f"{streams} streams, run {run}, {path}: {shot.pieces_s:.0f} pieces/s, {shot.errors} errors")
                shots[path].append(shot)
                errors += shot.errors
        rows += rows_for(streams, shots)
    return rows, errors


async def warm(node: Node) -> None:
    """The first call loads the model (starts its engine)."""
    window = Window(0.0, float("inf"))
    body = json.dumps({"model": MODEL, "prompt": "w", "repeat": 2, "stream": True}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    loop = asyncio.get_running_loop()
    _, reader = await loop.create_connection(lambda: StreamReader(window), "127.0.0.1", node.http_port)
    await asyncio.wait_for(reader.start(request), 120)
    assert reader.transport is not None
    reader.transport.close()
    if window.errors or window.pieces != 2:
        raise RuntimeError(f"the first call through meshd failed: {window}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256, 1024])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--pieces", type=int, default=100, help="pieces per stream (20 ms apart)")
    p.add_argument("--seconds", type=float, default=4.0, help="the measured window of each case")
    p.add_argument("--smoke", action="store_true", help="one short run of small cases (the test suite's)")
    a = p.parse_args(argv)
    if a.smoke:
        a.streams, a.runs, a.pieces, a.seconds = [4, 16], 1, 10, 1.0
    if a.runs < 1 or a.pieces < 2 or a.seconds <= 0 or any(n < 1 for n in a.streams):
        p.error("--runs and every --streams must be >= 1, --pieces >= 2, --seconds > 0")
    sigterm_as_interrupt()
    lines = [
        f"# {command_line(SCRIPT, argv)}",
        f"# {os.cpu_count()} cores; engine paced {INTERVAL_MS:g} ms a piece, {a.pieces} pieces a stream; "
        f"medians of {a.runs}; ms; CPU in us per piece",
        f"{'streams':>7} {'path':6} {'pieces/s':>9} {'ttft50':>8} {'ttft99':>8} {'gap50':>7} {'gap99':>7} "
        f"{'layer':>7} {'sys':>7} " + " ".join(f"{r:>7}" for r in ROLES) + f" {'errors':>6}",
    ]
    with tempfile.TemporaryDirectory(prefix="meshd-bench-relay-") as tmp:
        mesh = LocalMesh(Path(tmp) / "mesh", service="bench-llm-relay")
        with mesh_of_run(mesh):
            node = start(mesh, Path(tmp))
            asyncio_run(warm(node))
            rows, errors = asyncio_run(measure(a, node))
            lines += rows
            if errors:  # what meshd, its runtime and the engine said about them
                dump_logs(mesh, log)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
