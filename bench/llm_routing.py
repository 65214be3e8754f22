"""Copies of one language model routed by their engines' load and prompt prefixes, against
the fewest calls in flight (issue 43).

    python bench/llm_routing.py [--engine fake|vllm] [--runs 3] [--requests N] [--rate R] [--smoke]

Starts etcd, three meshd instances each beside `meshd llm-runtime` holding one copy of the
model, and two front instances that hold none (their runtimes have no room for it), routing
the model's calls to those copies: one with `MESHD_LLM_ROUTING=load` (the engines' queues and
KV use, and prefix affinity: decisions.placement.llm), one with `inflight` (what meshd did
before: the copy with the fewest calls in flight from this instance). Each run sends the same
Poisson stream of streamed `/v1/completions` through each front in turn (the order alternating
from run to run), with fresh prompts each run so no run finds another's prefixes cached
(--paired: the same arrivals and the same calls sharing the same system prompt through both
fronts in a run, in new words for each front):

    60 % of the calls begin with one of 8 long system prompts (--system-words words), then a
    short question of their own; 40 % are a prompt of their own (--own-words words).

--engine fake (the default, and the test suite's --smoke): our own engine
(`meshd.testing.fake_llm`), standing in for a GPU engine with prefix caching. It runs
--max-running calls at a time and queues the rest; it spends --prefill-ms-per-token on each
prompt token (a word) not in its prefix cache, one prefill at a time, then streams --tokens
tokens --token-ms apart; its prefix cache keeps --cache-tokens tokens in blocks of 16 (LRU),
and it publishes vLLM's metrics, prefix-cache hits included.

--engine vllm: vLLM's CPU build (its venv built on first use, ~3 GiB of memory an engine), a
random-weight Llama made on the spot (VLLM_SHAPE; its tokenizer makes a token of each byte),
vLLM's automatic prefix caching in 128-token blocks, one OpenMP thread an engine. The three
engines share the machine's cores, so "faster than one copy serves" is what the cores serve.
llama-cpp-python is not offered: it serves one request at a time, has no /metrics, and its
prompt cache keeps one slot.

Figures per front (medians over runs): time to first token p50/p99 as the client sees it,
the share of prompt tokens found in the engines' prefix caches (their own
`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`), the calls each copy
served, and the CPU time the engines' processes spent on the shot (the work prefix hits save;
the log adds, per run, the time to first token of the calls behind a system prompt). With
--engine fake, then the simulator's for the same calls (`sim:load`, `sim:inflight`: `python -m
sim llm`'s rules and engine on this run's seeds, calls per copy largest first; no hops). Every
child is stopped by PID on exit (each engine with its process group).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from _shared import CLK_TCK, asyncio_run, command_line, log, mesh_of_run, sigterm_as_interrupt  # noqa: E402

from meshd._proto.meshd import peer_pb2, peer_pb2_grpc  # noqa: E402
from meshd._proto.mmesh import model_mesh_pb2 as mm  # noqa: E402
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc  # noqa: E402
from meshd.testing.cluster import LocalMesh, Node  # noqa: E402
from meshd.testing.llm import (  # noqa: E402
    VLLM_ENGINE_BYTES,
    VLLM_ENV,
    LlmRuntimeArgs,
    add_llm_node,
    make_hf_llama,
    vllm_python,
)
from sim import llm as sim_llm  # noqa: E402

SCRIPT = "bench/llm_routing.py"
MODEL = "chat"
COPIES = ("copy-1", "copy-2", "copy-3")
FRONTS = {"load": "front-load", "inflight": "front-inflight"}
SYSTEM_PROMPTS = 8
SHARED = 0.6
LOADING_TIMEOUT_MS = 9_000  # copies count as loaded 3 s after their load began
# vLLM's CPU build: a random-weight Llama (hidden 256, 2 layers, 4 heads, 4,096 positions; a
# token a byte) large enough that a long prompt's prefill costs what a cached prefix saves: on
# one core ~450 ms for 1,230 prompt tokens, ~80 ms with 1,024 of them cached; ~4 ms a token.
VLLM_SHAPE = (256, 2, 4, 4096)
VLLM_BLOCK_TOKENS = 128  # vLLM's KV block on CPU: prefixes are cached in whole blocks
VLLM_START_TIMEOUT_MS = 300_000  # three engines starting at once on 2 cores: ~1 min
# One OpenMP thread per engine and no pinning: vLLM's default pins every engine's thread to
# core 0 (it keeps the other for itself), so three engines would share one core.
VLLM_THREADS_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
# Per engine: what the options default to (calls per front and run, calls/s, prompt words).
DEFAULTS: dict[str, dict[str, int | float]] = {
    "fake": {"requests": 180, "rate": 6.0, "system_words": 300, "own_words": 150},
    # A system prompt of 150 words is ~1,180 bytes, so tokens: more than the 1,024 characters
    # meshd hashes as a prefix, and 9 of vLLM's 128-token blocks.
    "vllm": {"requests": 90, "rate": 3.0, "system_words": 150, "own_words": 60},
}


@dataclass
class Shot:
    ttft_ms: list[float]
    shared_ms: list[float]  # the time to first token of the calls behind a system prompt
    errors: int
    hits: float  # prompt tokens found in the engines' prefix caches / prompt tokens looked up
    served: list[int]  # calls each copy served
    engine_cpu_s: float  # CPU time the engines spent on the shot, all three together

    def pct(self, q: float, shared_only: bool = False) -> float:
        values = sorted(self.shared_ms if shared_only else self.ttft_ms)
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(1_000_000)}" for _ in range(n))


@dataclass(frozen=True)
class Call:
    at: float  # s after the shot's start
    prompt: str
    shared: bool  # behind one of the system prompts


def workload(a: argparse.Namespace, seed: int) -> list[Call]:
    """Each call: Poisson arrivals, fresh prompts per seed (sim.llm draws the same)."""
    rng = random.Random(seed)
    systems = [words(rng, a.system_words) for _ in range(SYSTEM_PROMPTS)]
    at, calls = 0.0, []
    for _ in range(a.requests):
        at += rng.expovariate(a.rate)
        if rng.random() < SHARED:
            calls.append(Call(at, rng.choice(systems) + " " + words(rng, 16), True))
        else:
            calls.append(Call(at, words(rng, a.own_words), False))
    return calls


def paired_workload(a: argparse.Namespace, seed: int, fresh: int) -> list[Call]:
    """--paired: the arrivals, which calls share which system prompt and the prompts' lengths
    from `seed` (the same for both fronts in a run); the words from `fresh` (new for each front
    and run, so none finds another's prefixes cached)."""
    rng, text = random.Random(seed), random.Random(fresh)
    systems = [words(text, a.system_words) for _ in range(SYSTEM_PROMPTS)]
    at, calls = 0.0, []
    for _ in range(a.requests):
        at += rng.expovariate(a.rate)
        if rng.random() < SHARED:
            calls.append(Call(at, systems[rng.randrange(SYSTEM_PROMPTS)] + " " + words(text, 16), True))
        else:
            calls.append(Call(at, words(text, a.own_words), False))
    return calls


def seed_of(policy: str, run: int) -> int:
    """The seed of a front's calls in a run (fresh prompts each run, other ones per front)."""
    return 1001 * run + (0 if policy == "load" else 500)


def simulated(a: argparse.Namespace, policy: str) -> list[sim_llm.Outcome]:
    """The simulator's runs of the same calls (`python -m sim llm`: the same rules, engine and seeds)."""
    mix = sim_llm.Mix(a.requests, a.rate, a.system_words, a.own_words, a.tokens)
    setup = sim_llm.Setup(
        copies=len(COPIES),
        instances=len(COPIES),
        max_running=a.max_running,
        prefill_ms_per_token=a.prefill_ms_per_token,
        token_ms=a.token_ms,
        cache_tokens=a.cache_tokens,
    )
    return [sim_llm.simulate(mix, setup, policy, seed_of(policy, run)) for run in range(a.runs)]


@dataclass(frozen=True, order=True)
class Engine:
    port: int
    pid: int  # its process group's too (the runtime starts each engine in its own)


def engines(runtimes: list[int]) -> list[Engine]:
    """The engines the copies' runtimes (their PIDs) started: each runtime's child with a
    --port (other benches' engines of the same name are not ours)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent in runtimes and b"--port" in argv:
            found.append(Engine(int(argv[argv.index(b"--port") + 1]), int(entry)))
    return sorted(found)


def group_cpu_seconds(groups: set[int]) -> float:
    """CPU time (user + system) of every live process in these process groups: an engine and
    its workers (vLLM's EngineCore and worker)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) in groups:
            total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def metric_sums(text: str) -> dict[str, float]:
    """Prometheus text: each metric's value summed over its label sets (vLLM counts finished
    requests once per reason, our engine once)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
    return values


async def counters(session: aiohttp.ClientSession, ports: list[Engine]) -> tuple[float, float, list[int]]:
    """(prefix-cache hits, queries) in tokens summed over the engines, and the calls each ran."""
    hits = queries = 0.0
    ran = []
    for engine in ports:
        async with session.get(f"http://127.0.0.1:{engine.port}/metrics") as r:
            values = metric_sums(await r.text())
        hits += values.get("vllm:prefix_cache_hits_total", 0.0)
        queries += values.get("vllm:prefix_cache_queries_total", 0.0)
        ran.append(int(values.get("vllm:request_success_total", 0.0)))
    return hits, queries, ran


async def drive(a: argparse.Namespace, front: Node, calls: list[Call], ports: list[Engine]) -> Shot:
    ttft: list[float] = []
    shared: list[float] = []
    errors = 0
    url = f"{front.http_url}/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        hits0, queries0, counts0 = await counters(session, ports)
        groups = {engine.pid for engine in ports}
        cpu0 = group_cpu_seconds(groups)
        start = time.perf_counter()

        async def one(call: Call) -> None:
            nonlocal errors
            await asyncio.sleep(max(0.0, start + call.at - time.perf_counter()))
            sent = time.perf_counter()
            body: dict[str, object] = {"model": MODEL, "prompt": call.prompt, "max_tokens": a.tokens, "stream": True}
            if a.engine == "vllm":
                body["ignore_eos"] = True  # random weights may end an answer at once: each is --tokens long
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
                            if call.shared:
                                shared.append(ttft[-1])
                            first = False
            except aiohttp.ClientError:
                errors += 1

        await asyncio.gather(*(one(call) for call in calls))
        hits1, queries1, counts1 = await counters(session, ports)
        cpu = group_cpu_seconds(groups) - cpu0
    share = (hits1 - hits0) / (queries1 - queries0) if queries1 > queries0 else 0.0
    return Shot(ttft, shared, errors, share, [b - c for b, c in zip(counts1, counts0, strict=True)], cpu)


def runtime_args(a: argparse.Namespace, work: Path) -> tuple[LlmRuntimeArgs, str, Path]:
    """The copies' runtime, and the model's type and path to register."""
    if a.engine == "vllm":
        python = vllm_python()
        base, _ = make_hf_llama(python, work / "hf", 0, seed=1, shape=VLLM_SHAPE)
        engine_args: tuple[str, ...] = ("--dtype", "bfloat16", "--max-model-len", str(VLLM_SHAPE[3]))
        if a.cache_tokens:  # else vLLM's own: VLLM_CPU_KVCACHE_SPACE, 1 GiB (524,288 tokens here)
            engine_args += ("--num-gpu-blocks-override", str(a.cache_tokens // VLLM_BLOCK_TOKENS))
        holder = LlmRuntimeArgs(
            python,
            memory_bytes=VLLM_ENGINE_BYTES + (512 << 20),
            default_model_size=VLLM_ENGINE_BYTES,
            engine="vllm",
            engine_args=engine_args,
            env={**VLLM_ENV, **VLLM_THREADS_ENV},
            loading_timeout_ms=VLLM_START_TIMEOUT_MS,
        )
        return holder, "vllm", base
    engine = f"{sys.executable} -m meshd.testing.fake_llm --port {{port}} --name {{name}}"
    engine += f" --token-interval-ms {a.token_ms:g} --max-running {a.max_running}"
    engine += f" --prefill-ms-per-token {a.prefill_ms_per_token:g} --cache-tokens {a.cache_tokens}"
    holder = LlmRuntimeArgs(
        Path(sys.executable), engine_command=engine, engine_args=(), loading_timeout_ms=LOADING_TIMEOUT_MS
    )
    return holder, "llm", work


def load_copy(node: Node) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{node.peer_port}") as ch:
        req = peer_pb2.InternalOpRequest(modelId=MODEL, load=True, sync=True)
        state = peer_pb2_grpc.MeshPeerStub(ch).InternalOperation(req, timeout=VLLM_START_TIMEOUT_MS / 1000).state
    if state != peer_pb2.InternalOpResponse.LOADED:
        raise RuntimeError(f"{node.instance_id} did not load {MODEL}: state {state}")


def start(a: argparse.Namespace, mesh: LocalMesh, work: Path) -> tuple[dict[str, Node], list[Engine]]:
    mesh.start_etcd()
    holder, model_type, path = runtime_args(a, work)
    # No copy scaling: the three copies stay where they are for the whole run.
    settings: dict[str, str | int] = {"rate_check_ms": 600_000, "request_timeout_ms": 120_000}
    copies = [add_llm_node(mesh, name, holder, settings) for name in COPIES]
    # The fronts' runtimes have no room for the model: they route, never hold it. Theirs sets
    # when they take peers' copies as loaded (a third of it after the load began).
    no_room = dataclasses.replace(holder, memory_bytes=1 << 20, loading_timeout_ms=LOADING_TIMEOUT_MS)
    fronts = {
        policy: add_llm_node(mesh, name, no_room, {**settings, "llm_routing": policy})
        for policy, name in FRONTS.items()
    }
    with grpc.insecure_channel(copies[0].target) as ch:
        info = mm.ModelInfo(type=model_type, path=str(path))
        mm_grpc.ModelMeshStub(ch).registerModel(mm.RegisterModelRequest(modelId=MODEL, modelInfo=info), timeout=30)
    started = time.perf_counter()
    with ThreadPoolExecutor(len(copies)) as pool:  # vLLM's engines start in ~30 s each: at once
        list(pool.map(load_copy, copies))
    log(f"{len(copies)} copies loaded in {time.perf_counter() - started:.0f} s")
    time.sleep(max(3.0, LOADING_TIMEOUT_MS / 3000) + 1)  # until the fronts take the copies as loaded
    ports = engines([node.runtime.pid for node in copies])
    if len(ports) != len(COPIES):
        raise RuntimeError(f"expected {len(COPIES)} engines, found {len(ports)}")
    return fronts, ports


async def measure(a: argparse.Namespace, fronts: dict[str, Node], ports: list[Engine]) -> dict[str, list[Shot]]:
    shots: dict[str, list[Shot]] = {policy: [] for policy in fronts}
    warm = workload(argparse.Namespace(**{**vars(a), "requests": 12, "rate": 4.0}), seed=-1)
    for front in fronts.values():
        await drive(a, front, warm, ports)
    for run in range(a.runs):
        order = list(fronts) if run % 2 == 0 else list(reversed(fronts))
        for policy in order:
            if a.paired:
                calls = paired_workload(a, run, fresh=1000 * run + (0 if policy == "load" else 500))
            else:
                calls = workload(a, seed_of(policy, run))
            shot = await drive(a, fronts[policy], calls, ports)
            shots[policy].append(shot)
            log(
                f"run {run + 1} {policy:8}: ttft p50 {shot.pct(0.5):.0f} ms, p99 {shot.pct(0.99):.0f} ms "
                f"(behind a system prompt: p50 {shot.pct(0.5, True):.0f} ms, p99 {shot.pct(0.99, True):.0f} ms), "
                f"prefix hits {shot.hits:.0%}, per copy {shot.served}, engines' CPU {shot.engine_cpu_s:.1f} s, "
                f"errors {shot.errors}"
            )
            await asyncio.sleep(1.0)  # the engines' queues drain before the next front
    return shots


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=sorted(DEFAULTS), default="fake", help="ours, or vLLM's CPU build")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--requests", type=int, help="calls per front and run (fake 180, vllm 90)")
    p.add_argument("--rate", type=float, help="calls per second, Poisson (fake 6, vllm 3)")
    p.add_argument("--system-words", type=int, help="length of each shared system prompt (fake 300, vllm 150)")
    p.add_argument("--own-words", type=int, help="length of a prompt of its own (fake 150, vllm 60)")
    p.add_argument("--tokens", type=int, default=32, help="tokens per answer")
    p.add_argument("--token-ms", type=float, default=20.0, help="fake: ms between tokens")
    p.add_argument("--max-running", type=int, default=4, help="fake: calls served at a time")
    p.add_argument("--prefill-ms-per-token", type=float, default=1.0, help="fake: ms a prompt token not cached")
    p.add_argument(
        "--cache-tokens", type=int, help="prefix cache size in tokens (fake 2048; vllm: its own, 1 GiB of KV)"
    )
    p.add_argument(
        "--paired",
        action="store_true",
        help="the same arrivals and prompt sharing through both fronts in a run, in other words "
        "(else each front its own seed's calls, which the simulator's rows mirror)",
    )
    p.add_argument("--smoke", action="store_true", help="one short run (the test suite's)")
    a = p.parse_args(argv)
    for key, value in DEFAULTS[a.engine].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.cache_tokens is None and a.engine == "fake":
        a.cache_tokens = 2048
    if a.smoke:
        a.runs, a.requests, a.rate = 1, 16, (8.0 if a.engine == "fake" else 4.0)
    if a.runs < 1 or a.requests < 1 or a.rate <= 0:
        p.error("--runs and --requests must be >= 1, --rate > 0")
    if a.engine == "vllm" and a.cache_tokens is not None and a.cache_tokens < VLLM_SHAPE[3]:
        p.error(f"--cache-tokens must hold one whole call with vllm: at least {VLLM_SHAPE[3]}")
    sigterm_as_interrupt()
    if a.engine == "vllm":
        cache = f"{a.cache_tokens} tokens" if a.cache_tokens else "vLLM's own, 1 GiB"
        engine = (
            f"3 copies of a random-weight Llama {VLLM_SHAPE[0]} wide, {VLLM_SHAPE[1]} layers on vLLM's CPU build "
            f"(one thread each, prefix cache {cache})"
        )
    else:
        engine = (
            f"3 copies of our engine ({a.max_running} at a time, {a.prefill_ms_per_token:g} ms a prompt token "
            f"not cached, {a.tokens} tokens {a.token_ms:g} ms apart, prefix cache {a.cache_tokens} tokens)"
        )
    lines = [
        f"# {command_line(SCRIPT, argv)}",
        f"# {os.cpu_count()} cores; {engine}; {a.requests} calls at {a.rate:g}/s, {a.tokens} tokens each, "
        f"{SHARED:.0%} behind one of {SYSTEM_PROMPTS} system prompts of {a.system_words} words; medians of {a.runs}",
        f"{'routing':12} {'ttft p50':>9} {'ttft p99':>9} {'prefix hits':>11} {'calls per copy':>16} "
        f"{'engines CPU s':>13} {'errors':>6}",
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
        cpu = statistics.median(s.engine_cpu_s for s in runs)
        errors = sum(s.errors for s in runs)
        lines.append(f"{policy:12} {p50:9.0f} {p99:9.0f} {hits:11.0%} {per_copy:>16} {cpu:13.1f} {errors:6d}")
    # The simulator on the same calls (it models our engine): its figures beside these
    # (docs/simulator.md, "Against the bench").
    for policy in shots if a.engine == "fake" and not a.paired else ():
        sims = simulated(a, policy)
        p50 = statistics.median(o.pct(0.5) for o in sims)
        p99 = statistics.median(o.pct(0.99) for o in sims)
        hits = statistics.median(o.hits for o in sims)
        ranked = [sorted(o.served, reverse=True) for o in sims]  # copies by calls: the bench's order is its ports'
        per_copy = "/".join(str(round(statistics.median(r[i] for r in ranked))) for i in range(len(COPIES)))
        lines.append(f"{'sim:' + policy:12} {p50:9.0f} {p99:9.0f} {hits:11.0%} {per_copy:>16} {'-':>13} {'-':>6}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
