"""Copies of one language model routed by their engines' load and prompt prefixes, against
the fewest calls in flight (issue 43).

    python bench/llm_routing.py [--runs 3] [--requests 180] [--rate 6] [--smoke]

Starts etcd, three meshd instances each beside `meshd llm-runtime` holding one copy of the
model, and two front instances that hold none (their runtimes have no room for it), routing
the model's calls to those copies: one with `MESHD_LLM_ROUTING=load` (the engines' queues and
KV use, and prefix affinity: decisions.placement.llm), one with `inflight` (what meshd did
before: the copy with the fewest calls in flight from this instance). Each run sends the same
Poisson stream of streamed `/v1/completions` through each front in turn (the order alternating
from run to run), with fresh prompts each run so no run finds another's prefixes cached:

    60 % of the calls begin with one of 8 long system prompts (--system-words words), then a
    short question of their own; 40 % are a prompt of their own (--own-words words).

The engine is our own (`meshd.testing.fake_llm`), standing in for a GPU engine with prefix
caching: llama-cpp-python serves one request at a time, has no /metrics, and its prompt cache
keeps one slot, so on these 2 cores it cannot show a prefix cache under load. Ours runs
--max-running calls at a time and queues the rest; it spends --prefill-ms-per-token on each
prompt token (a word) not in its prefix cache, one prefill at a time, then streams --tokens
tokens --token-ms apart; its prefix cache keeps --cache-tokens tokens in blocks of 16 (LRU),
and it publishes vLLM's metrics, prefix-cache hits included. Figures per front (medians over
runs): time to first token p50/p99 as the client sees it, the share of prompt tokens found in
the engines' prefix caches, the calls each copy served. Every child is stopped by PID on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from _shared import asyncio_run, command_line, log, mesh_of_run, sigterm_as_interrupt  # noqa: E402

from meshd._proto.meshd import peer_pb2, peer_pb2_grpc  # noqa: E402
from meshd._proto.mmesh import model_mesh_pb2 as mm  # noqa: E402
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc  # noqa: E402
from meshd.testing.cluster import LocalMesh, Node  # noqa: E402
from meshd.testing.llm import LlmRuntimeArgs, add_llm_node  # noqa: E402

SCRIPT = "bench/llm_routing.py"
MODEL = "chat"
COPIES = ("copy-1", "copy-2", "copy-3")
FRONTS = {"load": "front-load", "inflight": "front-inflight"}
SYSTEM_PROMPTS = 8
SHARED = 0.6
LOADING_TIMEOUT_MS = 9_000  # copies count as loaded 3 s after their load began


@dataclass
class Shot:
    ttft_ms: list[float]
    errors: int
    hits: float  # prompt tokens found in the engines' prefix caches / prompt tokens looked up
    served: list[int]  # calls each copy served

    def pct(self, q: float) -> float:
        values = sorted(self.ttft_ms)
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(1_000_000)}" for _ in range(n))


def workload(a: argparse.Namespace, seed: int) -> list[tuple[float, str]]:
    """(arrival s, prompt) of each call: Poisson arrivals, fresh prompts per seed."""
    rng = random.Random(seed)
    systems = [words(rng, a.system_words) for _ in range(SYSTEM_PROMPTS)]
    at, calls = 0.0, []
    for _ in range(a.requests):
        at += rng.expovariate(a.rate)
        if rng.random() < SHARED:
            prompt = rng.choice(systems) + " " + words(rng, 16)
        else:
            prompt = words(rng, a.own_words)
        calls.append((at, prompt))
    return calls


def engine_ports() -> list[int]:
    """The ports of the copies' engines (ours, --name MODEL)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"meshd.testing.fake_llm" in argv and argv[argv.index(b"--name") + 1] == MODEL.encode():
            found.append(int(argv[argv.index(b"--port") + 1]))
    return sorted(found)


async def counters(session: aiohttp.ClientSession, ports: list[int]) -> tuple[float, float, list[int]]:
    """(prefix-cache hits, queries) in tokens summed over the engines, and the calls each ran."""
    hits = queries = 0.0
    ran = []
    for port in ports:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
            text = await r.text()
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}
        hits += values.get("vllm:prefix_cache_hits_total", 0.0)
        queries += values.get("vllm:prefix_cache_queries_total", 0.0)
        ran.append(int(values.get("vllm:request_success_total", 0.0)))
    return hits, queries, ran


async def drive(a: argparse.Namespace, front: Node, calls: list[tuple[float, str]], ports: list[int]) -> Shot:
    ttft: list[float] = []
    errors = 0
    url = f"{front.http_url}/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        hits0, queries0, counts0 = await counters(session, ports)
        start = time.perf_counter()

        async def one(at: float, prompt: str) -> None:
            nonlocal errors
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            sent = time.perf_counter()
            body = {"model": MODEL, "prompt": prompt, "max_tokens": a.tokens, "stream": True}
            try:
                async with session.post(url, json=body) as r:
                    if r.status != 200:
                        errors += 1
                        await r.read()
                        return
                    first = True
                    async for line in r.content:
                        if first and line.startswith(b"data: {"):
                            ttft.append((time.perf_counter() - sent) * 1000)
                            first = False
            except aiohttp.ClientError:
                errors += 1

        await asyncio.gather(*(one(at, prompt) for at, prompt in calls))
        hits1, queries1, counts1 = await counters(session, ports)
    share = (hits1 - hits0) / (queries1 - queries0) if queries1 > queries0 else 0.0
    return Shot(ttft, errors, share, [b - c for b, c in zip(counts1, counts0, strict=True)])


def start(a: argparse.Namespace, mesh: LocalMesh, work: Path) -> tuple[dict[str, Node], list[int]]:
    mesh.start_etcd()
    engine = f"{sys.executable} -m meshd.testing.fake_llm --port {{port}} --name {{name}}"
    engine += f" --token-interval-ms {a.token_ms:g} --max-running {a.max_running}"
    engine += f" --prefill-ms-per-token {a.prefill_ms_per_token:g} --cache-tokens {a.cache_tokens}"
    # No copy scaling: the three copies stay where they are for the whole run.
    settings: dict[str, str | int] = {"rate_check_ms": 600_000, "request_timeout_ms": 120_000}
    holder = LlmRuntimeArgs(
        Path(sys.executable), engine_command=engine, engine_args=(), loading_timeout_ms=LOADING_TIMEOUT_MS
    )
    for name in COPIES:
        add_llm_node(mesh, name, holder, settings)
    # The fronts' runtimes have no room for the model: they route, never hold it.
    no_room = LlmRuntimeArgs(
        Path(sys.executable),
        engine_command=engine,
        engine_args=(),
        memory_bytes=1 << 20,
        loading_timeout_ms=LOADING_TIMEOUT_MS,  # theirs sets when they take peers' copies as loaded
    )
    fronts = {
        policy: add_llm_node(mesh, name, no_room, {**settings, "llm_routing": policy})
        for policy, name in FRONTS.items()
    }
    first = mesh.nodes[0]
    with grpc.insecure_channel(first.target) as ch:
        info = mm.ModelInfo(type="llm", path=str(work))
        mm_grpc.ModelMeshStub(ch).registerModel(mm.RegisterModelRequest(modelId=MODEL, modelInfo=info), timeout=30)
    for node in mesh.nodes[: len(COPIES)]:
        with grpc.insecure_channel(f"127.0.0.1:{node.peer_port}") as ch:
            req = peer_pb2.InternalOpRequest(modelId=MODEL, load=True, sync=True)
            state = peer_pb2_grpc.MeshPeerStub(ch).InternalOperation(req, timeout=60).state
            if state != peer_pb2.InternalOpResponse.LOADED:
                raise RuntimeError(f"{node.instance_id} did not load {MODEL}: state {state}")
    time.sleep(max(3.0, LOADING_TIMEOUT_MS / 3000) + 1)  # until the fronts take the copies as loaded
    ports = engine_ports()
    if len(ports) != len(COPIES):
        raise RuntimeError(f"expected {len(COPIES)} engines, found {len(ports)}")
    return fronts, ports


async def measure(a: argparse.Namespace, fronts: dict[str, Node], ports: list[int]) -> dict[str, list[Shot]]:
    shots: dict[str, list[Shot]] = {policy: [] for policy in fronts}
    warm = workload(argparse.Namespace(**{**vars(a), "requests": 12, "rate": 4.0}), seed=-1)
    for front in fronts.values():
        await drive(a, front, warm, ports)
    for run in range(a.runs):
        order = list(fronts) if run % 2 == 0 else list(reversed(fronts))
        for policy in order:
            calls = workload(a, seed=1000 * run + len(shots[policy]) + (0 if policy == "load" else 500))
            shot = await drive(a, fronts[policy], calls, ports)
            shots[policy].append(shot)
            log(
                f"run {run + 1} {policy:8}: ttft p50 {shot.pct(0.5):.0f} ms, p99 {shot.pct(0.99):.0f} ms, "
                f"prefix hits {shot.hits:.0%}, per copy {shot.served}, errors {shot.errors}"
            )
            await asyncio.sleep(1.0)  # the engines' queues drain before the next front
    return shots


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--requests", type=int, default=180, help="calls per front and run")
    p.add_argument("--rate", type=float, default=6.0, help="calls per second (Poisson)")
    p.add_argument("--system-words", type=int, default=300, help="length of each shared system prompt")
    p.add_argument("--own-words", type=int, default=150, help="length of a prompt of its own")
    p.add_argument("--tokens", type=int, default=32, help="tokens per answer")
    p.add_argument("--token-ms", type=float, default=20.0)
    p.add_argument("--max-running", type=int, default=4)
    p.add_argument("--prefill-ms-per-token", type=float, default=1.0)
    p.add_argument("--cache-tokens", type=int, default=2048)
    p.add_argument("--smoke", action="store_true", help="one short run (the test suite's)")
    a = p.parse_args(argv)
    if a.smoke:
        a.runs, a.requests, a.rate = 1, 16, 8.0
    if a.runs < 1 or a.requests < 1 or a.rate <= 0:
        p.error("--runs and --requests must be >= 1, --rate > 0")
    sigterm_as_interrupt()
    lines = [
        f"# {command_line(SCRIPT, argv)}",
        f"# {os.cpu_count()} cores; 3 copies of our engine ({a.max_running} at a time, "
        f"{a.prefill_ms_per_token:g} ms a prompt token not cached, {a.tokens} tokens {a.token_ms:g} ms apart, "
        f"prefix cache {a.cache_tokens} tokens); {a.requests} calls at {a.rate:g}/s, "
        f"{SHARED:.0%} behind one of {SYSTEM_PROMPTS} system prompts of {a.system_words} words; medians of {a.runs}",
        f"{'routing':9} {'ttft p50':>9} {'ttft p99':>9} {'prefix hits':>11} {'calls per copy':>16} {'errors':>6}",
    ]
    with tempfile.TemporaryDirectory(prefix="meshd-bench-routing-") as tmp:
        mesh = LocalMesh(Path(tmp) / "mesh", service="bench-llm-routing")
        with mesh_of_run(mesh):
            fronts, ports = start(a, mesh, Path(tmp))
            shots = asyncio_run(measure(a, fronts, ports))
    for policy, runs in shots.items():
        p50 = statistics.median(s.pct(0.5) for s in runs)
        p99 = statistics.median(s.pct(0.99) for s in runs)
        hits = statistics.median(s.hits for s in runs)
        per_copy = "/".join(str(round(statistics.median(s.served[i] for s in runs))) for i in range(len(ports)))
        errors = sum(s.errors for s in runs)
        lines.append(f"{policy:9} {p50:9.0f} {p99:9.0f} {hits:11.0%} {per_copy:>16} {errors:6d}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
