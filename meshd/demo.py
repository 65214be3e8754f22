"""`meshd demo`: a self-contained mesh on this machine, driven with real traffic.

Starts an embedded etcd, reference runtimes and meshd instances as child processes,
writes a set of small numeric models, registers them through the management API, sends
Zipf-distributed inference requests through meshd (checking every answer against the
model file), shows progress, prints a summary and stops everything it started.
The cache holds fewer models than the traffic uses, so loads and evictions happen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.runtimes.models import DemoModel, decode_infer_response, generate_models, make_infer_request
from meshd.testing.cluster import LocalMesh, MeshClient, StartFailed, sized_runtime_args
from meshd.testing.triton import (
    TRITON_VERSION,
    TritonInstall,
    TritonMissing,
    backend_directory,
    find_triton,
    remove_shm,
    start_triton_node,
    write_python_model,
)

MODEL_SIZE_BYTES = 4 << 20
RETRIES_429 = 10  # a language model request answered 429 is sent again, up to this many times


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=int, default=3, help="meshd instances, each with its own runtime (default 3)")
    p.add_argument("--models", type=int, default=16, help="models registered (default 16)")
    p.add_argument("--cache-models", type=int, default=4, help="models that fit in one instance's cache (default 4)")
    p.add_argument("--requests", type=int, default=1000, help="inference requests sent (default 1000)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of model popularity (default 1.0)")
    p.add_argument("--load-delay-ms", type=int, default=150, help="simulated model load time (default 150)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--workdir", type=Path, help="keep files here (default: a temporary folder, removed after)")
    p.add_argument(
        "--runtime",
        choices=["reference", "triton", "llamacpp"],
        default="reference",
        help="reference: meshd's reference runtime; triton: a real tritonserver per instance, under "
        "`meshd adapter`, serving the models as Python-backend models (needs the nvidia-pytriton wheel); "
        "llamacpp: language models (tiny random GGUFs) on llama.cpp engines under `meshd llm-runtime`, "
        "asked through meshd's OpenAI-compatible port (its venv is compiled on first use: ~9 min on 2 cores)",
    )
    p.add_argument(
        "--engine-python",
        type=Path,
        help="with --runtime llamacpp: the Python of a venv with llama-cpp-python[server] and gguf you already have "
        "(default: one the demo builds under .venvs in a checkout, else ~/.cache/meshd/venvs)",
    )
    p.add_argument(
        "--triton-python",
        type=Path,
        help="with --runtime triton: a Python whose environment has the nvidia-pytriton wheel and numpy<2 "
        "(default: this one)",
    )


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    wrong: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (rank**s) for rank in range(1, n + 1)]


async def drive(
    args: argparse.Namespace, mesh: LocalMesh, models: dict[str, DemoModel], infos: dict[str, mm.ModelInfo]
) -> int:
    clients = [MeshClient.open(node) for node in mesh.nodes]
    try:
        for model_id, info in infos.items():
            await clients[0].mm.registerModel(mm.RegisterModelRequest(modelId=model_id, modelInfo=info), timeout=30)
        print(f"registered {len(infos)} models", flush=True)

        rng = random.Random(args.seed)
        ids = list(models)
        weights = zipf_weights(len(ids), args.zipf)
        plan = rng.choices(ids, weights=weights, k=args.requests)
        rows = [[rng.uniform(-1, 1) for _ in range(4)] for _ in range(16)]
        tally = Tally()
        queue: asyncio.Queue[str] = asyncio.Queue()
        for model_id in plan:
            queue.put_nowait(model_id)

        async def worker(n: int) -> None:
            client = clients[n % len(clients)]
            while True:
                try:
                    model_id = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                row = [rows[tally.sent % len(rows)]]
                tally.sent += 1
                started = time.perf_counter()
                try:
                    resp = await client.v2.ModelInfer(
                        make_infer_request(model_id, row), metadata=(("mm-model-id", model_id),), timeout=60
                    )
                except grpc.aio.AioRpcError as e:
                    tally.errors[e.code().name] = tally.errors.get(e.code().name, 0) + 1
                    continue
                tally.latencies_ms.append((time.perf_counter() - started) * 1000)
                expected = models[model_id].predict(row)
                got = decode_infer_response(resp)
                if all(abs(a - b) < 1e-4 for a, b in zip(got[0], expected[0], strict=True)):
                    tally.ok += 1
                else:
                    tally.wrong += 1

        async def progress() -> None:
            # A live bar on a terminal; a line per quarter in logs (CI).
            width, tty, shown = 30, sys.stdout.isatty(), 0
            while True:
                done = tally.ok + tally.wrong + sum(tally.errors.values())
                if tty:
                    filled = width * done // args.requests
                    sys.stdout.write(f"\r  [{'#' * filled}{'-' * (width - filled)}] {done}/{args.requests} requests")
                    sys.stdout.flush()
                elif done * 4 // args.requests > shown:
                    shown = done * 4 // args.requests
                    print(f"  {done}/{args.requests} requests", flush=True)
                if done >= args.requests:
                    if tty:
                        sys.stdout.write("\n")
                    return
                await asyncio.sleep(0.2)

        started = time.perf_counter()
        reporter = asyncio.create_task(progress())
        await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
        elapsed = time.perf_counter() - started
        await asyncio.wait_for(reporter, 5)

        stats = [await c.stats() for c in clients]
        errors = sum(tally.errors.values())
        print("\nmeshd demo summary")
        print(f"  instances        {len(mesh.nodes)} (each caches {args.cache_models} of the {len(models)} models)")
        print(f"  requests         {args.requests} in {elapsed:.1f}s ({args.requests / elapsed:.0f} req/s)")
        print(f"  correct answers  {tally.ok}")
        print(f"  wrong answers    {tally.wrong}")
        print(f"  errors           {errors}" + (f" {tally.errors}" if errors else ""))
        hops = sum(s.requests for s in stats) - args.requests  # arrivals from peers
        print(f"  peer hops        {hops} ({hops / args.requests:.0%} of requests)")
        # Counted on the instance that served each request: a request sent on to a peer's copy
        # that was still loading is neither (it waited for a load it did not start).
        print(f"  cache hits       {sum(s.hits for s in stats)} (requests that found their model loaded)")
        print(f"  cache misses     {sum(s.misses for s in stats)} (requests that waited for a load here)")
        print("                   the rest joined a load already under way on a peer")
        print(f"  loads            {sum(s.loads for s in stats)}")
        print(f"  evictions        {sum(s.evictions for s in stats)}")
        print(f"  latency p50      {percentile(tally.latencies_ms, 50):.2f} ms")
        print(f"  latency p99      {percentile(tally.latencies_ms, 99):.2f} ms")
        return 0 if errors == 0 and tally.wrong == 0 else 1
    finally:
        for c in clients:
            await c.close()


async def drive_llm(args: argparse.Namespace, mesh: LocalMesh, infos: dict[str, mm.ModelInfo]) -> int:
    """OpenAI completions and chat, a quarter streamed, through each instance's HTTP port; at
    temperature 0 every answer of a model must be the same."""
    clients = [MeshClient.open(node) for node in mesh.nodes]
    try:
        for model_id, info in infos.items():
            await clients[0].mm.registerModel(mm.RegisterModelRequest(modelId=model_id, modelInfo=info), timeout=30)
        print(f"registered {len(infos)} language models", flush=True)
        rng = random.Random(args.seed)
        ids = list(infos)
        queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
        for n, model_id in enumerate(rng.choices(ids, weights=zipf_weights(len(ids), args.zipf), k=args.requests)):
            queue.put_nowait((n, model_id))
        tally = Tally()
        retried = [0]
        answers: dict[tuple[str, bool], str] = {}
        bias = {str(token): -100 for token in (2, *range(131, 259))}  # no </s>, printable bytes only
        async with aiohttp.ClientSession() as session:

            async def one(n: int, model_id: str) -> str:
                node = mesh.nodes[n % len(mesh.nodes)]
                chat, stream = n % 2 == 1, n % 4 == 0
                body: dict[str, object] = {"model": model_id, "max_tokens": 12, "temperature": 0, "logit_bias": bias}
                body["stream"] = stream
                if chat:
                    body["messages"] = [{"role": "user", "content": "what is a mesh?"}]
                else:
                    body["prompt"] = "a mesh is"
                path = "/v1/chat/completions" if chat else "/v1/completions"
                for attempt in range(RETRIES_429 + 1):
                    async with session.post(node.http_url + path, json=body) as r:
                        if r.status == 429 and attempt < RETRIES_429:
                            # No copy could take it in time (an engine serves one request at a
                            # time, and loads queue): wait as Retry-After says, then ask again.
                            retried[0] += 1
                            await asyncio.sleep(float(r.headers.get("Retry-After") or 1))
                            continue
                        if r.status != 200:
                            raise RuntimeError(f"HTTP {r.status}")
                        if not stream:
                            choice = (await r.json())["choices"][0]
                            return str(choice["message"]["content"] if chat else choice["text"])
                        text = []
                        async for line in r.content:
                            if line.startswith(b"data: {"):
                                choice = json.loads(line[6:])["choices"][0]
                                text.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
                        return "".join(text)
                raise AssertionError("unreachable: the last attempt returns or raises")

            async def worker() -> None:
                while True:
                    try:
                        n, model_id = queue.get_nowait()
                    except asyncio.QueueEmpty:
                        return
                    tally.sent += 1
                    started = time.perf_counter()
                    try:
                        text = await one(n, model_id)
                    except (RuntimeError, aiohttp.ClientError) as e:
                        tally.errors[str(e)] = tally.errors.get(str(e), 0) + 1
                        continue
                    tally.latencies_ms.append((time.perf_counter() - started) * 1000)
                    same = answers.setdefault((model_id, n % 2 == 1), text) == text
                    tally.ok += same
                    tally.wrong += not same
                    if n == 0:
                        print(f"  {model_id} says (random weights): {text!r}", flush=True)

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            elapsed = time.perf_counter() - started
        stats = [await c.stats() for c in clients]
        errors = sum(tally.errors.values())
        print("\nmeshd demo summary (language models through meshd's OpenAI-compatible port)")
        print(f"  instances        {len(mesh.nodes)} (each has room for {args.cache_models} llama.cpp engines)")
        print(f"  requests         {args.requests} in {elapsed:.1f}s: completions and chat, a quarter streamed")
        print(f"  same answers     {tally.ok} (temperature 0: each model answers a prompt the same way every time)")
        print(f"  other answers    {tally.wrong}")
        print(f"  errors           {errors}" + (f" {tally.errors}" if errors else ""))
        print(f"  retried          {retried[0]} (HTTP 429: no copy free in time; retried after its Retry-After)")
        print(f"  loads            {sum(s.loads for s in stats)} (each starts an engine process)")
        print(f"  evictions        {sum(s.evictions for s in stats)} (each stops one)")
        print(f"  latency p50      {percentile(tally.latencies_ms, 50):.2f} ms (a whole 12-token answer)")
        print(f"  latency p99      {percentile(tally.latencies_ms, 99):.2f} ms")
        return 0 if errors == 0 and tally.wrong == 0 else 1
    finally:
        for c in clients:
            await c.close()


def start_llm_mesh(args: argparse.Namespace, mesh: LocalMesh) -> dict[str, mm.ModelInfo]:
    from meshd.testing.llm import TINY_ENGINE_BYTES, LlmRuntimeArgs, add_llm_node, llamacpp_python, make_gguf
    from meshd.testing.venvs import DEFAULT_ROOT

    if args.engine_python is not None:
        python = args.engine_python
        print(f"  llama.cpp   engine venv {python.parent.parent} (--engine-python)", flush=True)
    else:
        print(
            f"  llama.cpp   engine venv under {DEFAULT_ROOT} (built on first use: ~9 min on 2 cores; "
            "--engine-python uses one you have)",
            flush=True,
        )
        python = llamacpp_python()
        print(f"  llama.cpp   engine venv {python.parent.parent}", flush=True)
    paths = make_gguf(python, mesh.workdir / "gguf", args.models, seed=args.seed)
    runtime = LlmRuntimeArgs(python, memory_bytes=args.cache_models * TINY_ENGINE_BYTES + (16 << 20))
    for i in range(args.instances):
        node = add_llm_node(mesh, f"demo-{i}", runtime)
        print(
            f"  instance    {node.instance_id}: meshd pid {node.meshd.pid}, OpenAI at {node.http_url}/v1, "
            f"llm-runtime pid {node.runtime.pid} on :{node.runtime_port}"
        )
    return {f"llm-{i:02d}": mm.ModelInfo(type="llamacpp", path=str(p)) for i, p in enumerate(paths)}


def start_triton_mesh(
    args: argparse.Namespace,
    install: TritonInstall,
    mesh: LocalMesh,
    models: dict[str, DemoModel],
    shm_prefixes: list[str],
) -> dict[str, mm.ModelInfo]:
    """One tritonserver (under `meshd adapter`) per instance, each with room for --cache-models;
    the models become Python-backend models answering the same rule."""
    backends = backend_directory(install, mesh.workdir / "triton-backends")
    print(f"  triton      {install.server} (Triton {TRITON_VERSION}, Python backend {install.python_version})")
    key = json.dumps({"meshd": {"size_bytes": MODEL_SIZE_BYTES}})  # what each model is taken to use
    infos = {}
    for model_id, model in models.items():
        folder = write_python_model(mesh.workdir / "triton-models" / model_id, model)
        infos[model_id] = mm.ModelInfo(type="python", path=str(folder), key=key)
    for i in range(args.instances):
        node, prefix = start_triton_node(mesh, f"demo-{i}", install, backends, args.cache_models * MODEL_SIZE_BYTES)
        shm_prefixes.append(prefix)
        print(
            f"  instance    {node.instance_id}: meshd pid {node.meshd.pid} on :{node.grpc_port}, "
            f"adapter pid {node.runtime.pid} on :{node.runtime_port} (tritonserver under it)"
        )
    return infos


def run_demo(args: argparse.Namespace) -> int:
    if args.instances < 1 or args.models < 1 or args.cache_models < 1 or args.requests < 1 or args.concurrency < 1:
        print("meshd demo: --instances, --models, --cache-models, --requests and --concurrency must be >= 1")
        return 2
    install = None
    if args.runtime == "triton":
        try:
            install = find_triton(args.triton_python or sys.executable)
        except TritonMissing as e:
            print(f"meshd demo --runtime triton: {e}", file=sys.stderr)
            print("  (or point --triton-python at a Python whose environment has it)", file=sys.stderr)
            return 2
    if args.runtime == "llamacpp" and args.engine_python is not None:
        from meshd.testing.llm import engine_problem

        problem = engine_problem(args.engine_python)
        if problem is not None:
            print(f"meshd demo --runtime llamacpp: {problem}", file=sys.stderr)
            print("  (or leave out --engine-python: the demo builds its own venv, ~9 min on 2 cores)", file=sys.stderr)
            return 2
    own_dir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="meshd-demo-")) if own_dir else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    mesh = LocalMesh(workdir, service="meshd-demo", die_with_parent=True)
    shm_prefixes: list[str] = []
    try:
        generated = generate_models(workdir / "models", args.models, size_bytes=MODEL_SIZE_BYTES)
        models = {g.id: DemoModel.load(g.path) for g in generated}
        infos = {g.id: mm.ModelInfo(type="demo", path=str(g.path)) for g in generated}
        print(f"meshd demo: workdir {workdir}")
        mesh.start_etcd()
        print(f"  etcd        pid {mesh.etcd.pid if mesh.etcd else '?'} at {mesh.etcd_url}")
        if args.runtime == "triton":
            assert install is not None
            infos = start_triton_mesh(args, install, mesh, models, shm_prefixes)
            return asyncio.run(drive(args, mesh, models, infos))
        if args.runtime == "llamacpp":
            return asyncio.run(drive_llm(args, mesh, start_llm_mesh(args, mesh)))
        for i in range(args.instances):
            node = mesh.add_node(
                f"demo-{i}",
                runtime_args=sized_runtime_args(args.cache_models, MODEL_SIZE_BYTES, args.load_delay_ms),
            )
            print(
                f"  instance    {node.instance_id}: meshd pid {node.meshd.pid} on :{node.grpc_port}, "
                f"runtime pid {node.runtime.pid} on :{node.runtime_port}"
            )
        return asyncio.run(drive(args, mesh, models, infos))
    except StartFailed as e:
        print(f"meshd demo: could not start the mesh: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        mesh.stop()
        for prefix in shm_prefixes:
            remove_shm(prefix)
        print("stopped every process the demo started")
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
