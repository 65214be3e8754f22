"""LLM serving through meshd against the same engine called directly.

    python bench/llm.py [--runs 3] [--requests 24] [--max-tokens 64] [--smoke]

Starts etcd and, in a temporary directory, one meshd beside `meshd llm-runtime --engine
llamacpp` with two random-weight GGUF models (tiny: 64 wide, 2 layers, a whole 64-token answer
in milliseconds; wide: 512 wide, 4 layers, ~5 ms a token) and one beside `--engine vllm` (its
CPU build) with a tiny random-weight Llama; each engine's venv is built on first use. Measures:

    cold   the first streamed request through meshd, which loads the model (starts its
           engine): time to first token, next to the engine's own start-up time
    warm   streamed completions at concurrency 1 and 8, through meshd's OpenAI port and
           straight to the engine meshd started (the same process, found by its command
           line): time to first token (p50, p99) and tokens/s (all tokens / wall time)
    relay  how long each streamed piece takes to reach the client after the engine sent it,
           through meshd and direct: an engine of our own (meshd.testing.fake_llm) stamps
           each piece with its send time, 2 ms apart (llama.cpp's pieces carry no stamp)

Direct and meshd alternate order from run to run; medians over --runs are printed, with
the meshd/direct ratios computed within each run. Every child is stopped by PID on exit.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from _shared import asyncio_run, command_line, sigterm_as_interrupt, stop_uninterrupted  # noqa: E402 - bench/ is on sys.path

from meshd._proto.mmesh import model_mesh_pb2 as mm  # noqa: E402
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc  # noqa: E402
from meshd.testing.cluster import LocalMesh, Node  # noqa: E402
from meshd.testing.llm import (  # noqa: E402
    ASCII_ONLY,
    WIDE_SHAPE,
    LlmRuntimeArgs,
    add_llm_node,
    llamacpp_python,
    make_gguf,
    make_hf_llama,
    vllm_args,
    vllm_python,
)

SCRIPT = "bench/llm.py"
RELAY_INTERVAL_MS = 2.0


@dataclass
class Shot:
    ttft_ms: float
    tokens: int
    relay_ms: list[float]


async def stream_once(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Shot:
    """One streamed completion: time to the first piece of the answer, pieces, and each piece's
    delay from the engine's stamp (when it carries one)."""
    started = time.perf_counter()
    first = None
    tokens = 0
    relay = []
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status} {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            arrived = time.time_ns()
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error']}")
            if event.get("choices"):
                tokens += 1
                if first is None:  # the first piece of the answer, whatever bytes it holds
                    first = time.perf_counter()
            if "sent_ns" in event:
                relay.append((arrived - event["sent_ns"]) / 1e6)
    return Shot(((first or time.perf_counter()) - started) * 1000, tokens, relay)


async def drive(url: str, body: dict[str, Any], requests: int, concurrency: int) -> tuple[list[Shot], float]:
    """`requests` streamed completions, `concurrency` at a time: every shot and the wall time."""
    shots: list[Shot] = []
    queue = list(range(requests))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            while queue:
                queue.pop()
                shots.append(await stream_once(session, url, body))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return shots, time.perf_counter() - started


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def engine_port(model_id: str) -> int:
    """The port of the engine meshd's runtime started for `model_id` (llama.cpp's alias, vLLM's
    served name, or our own engine's name), found by its command line."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for flag in (b"--model_alias", b"--served-model-name", b"--name"):
            if flag in argv and argv[argv.index(flag) + 1] == model_id.encode() and b"--port" in argv:
                return int(argv[argv.index(b"--port") + 1])
    raise RuntimeError(f"no engine found for {model_id}")


def engine_start_s(mesh: LocalMesh, node: Node, model_id: str) -> float:
    log_text = (mesh.workdir / "logs" / f"{node.instance_id}-llm-runtime.log").read_text()
    for line in reversed(log_text.splitlines()):
        if f"loaded {model_id}:" in line and "ready in" in line:
            return float(line.rsplit("ready in ", 1)[1].split()[0])
    return float("nan")


def register(node: Node, model_id: str, path: Path, model_type: str = "llamacpp") -> None:
    with grpc.insecure_channel(node.target) as ch:
        info = mm.ModelInfo(type=model_type, path=str(path))
        mm_grpc.ModelMeshStub(ch).registerModel(mm.RegisterModelRequest(modelId=model_id, modelInfo=info), timeout=30)


async def warm_rows(a: argparse.Namespace, node: Node, model_id: str) -> list[str]:
    body = {"model": model_id, "prompt": "the mesh", "max_tokens": a.max_tokens, "temperature": 0, "stream": True}
    body["logit_bias"] = ASCII_ONLY
    meshd_url = f"{node.http_url}/v1/completions"
    direct_url = f"http://127.0.0.1:{engine_port(model_id)}/v1/completions"
    await drive(meshd_url, body, 4, 2)  # warm both paths
    await drive(direct_url, body, 4, 2)
    rows = []
    for concurrency in a.concurrency:
        per: dict[str, list[tuple[float, float, float]]] = {"direct": [], "meshd": []}
        for run in range(a.runs):
            order = [("direct", direct_url), ("meshd", meshd_url)]
            for name, url in order if run % 2 == 0 else order[::-1]:
                shots, wall = await drive(url, body, a.requests, concurrency)
                ttfts = [s.ttft_ms for s in shots]
                per[name].append((pct(ttfts, 0.5), pct(ttfts, 0.99), sum(s.tokens for s in shots) / wall))
        med = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in per.items()}
        added = statistics.median(m[0] - d[0] for m, d in zip(per["meshd"], per["direct"], strict=True))
        ratio = statistics.median(m[2] / d[2] for m, d in zip(per["meshd"], per["direct"], strict=True))
        for name in ("direct", "meshd"):
            p50, p99, tps = med[name]
            rows.append(f"{model_id:10} {concurrency:>4} {name:7} {p50:9.2f} {p99:9.2f} {tps:9.0f}")
        rows.append(f"{model_id:10} {concurrency:>4} {'ratio':7} {added:>+9.2f} {'':9} {ratio:9.3f}")
    return rows


async def relay_rows(a: argparse.Namespace, node: Node, model_id: str) -> list[str]:
    words = " ".join(f"w{i}" for i in range(50))
    body = {"model": model_id, "prompt": words, "stream": True}
    meshd_url = f"{node.http_url}/v1/completions"
    await drive(meshd_url, body, 2, 1)  # loads it
    direct_url = f"http://127.0.0.1:{engine_port(model_id)}/v1/completions"
    out = {}
    for name, url in (("direct", direct_url), ("meshd", meshd_url)):
        shots, _ = await drive(url, body, max(4, a.requests // 4), 1)
        out[name] = [d for s in shots for d in s.relay_ms]
    rows = []
    for name, delays in out.items():
        rows.append(
            f"relay {name:7} pieces {len(delays):5}  p50 {pct(delays, 0.5):6.3f} ms  p99 {pct(delays, 0.99):6.3f} ms"
        )
    added50 = pct(out["meshd"], 0.5) - pct(out["direct"], 0.5)
    added99 = pct(out["meshd"], 0.99) - pct(out["direct"], 0.99)
    rows.append(f"relay added  p50 {added50:+.3f} ms  p99 {added99:+.3f} ms (each piece, engine -> client)")
    return rows


async def cold_row(node: Node, mesh: LocalMesh, model_id: str, max_tokens: int) -> str:
    body = {"model": model_id, "prompt": "the mesh", "max_tokens": max_tokens, "stream": True, "logit_bias": ASCII_ONLY}
    shots, _ = await drive(f"{node.http_url}/v1/completions", body, 1, 1)
    start = engine_start_s(mesh, node, model_id)
    took = shots[0].ttft_ms
    return f"cold {model_id:10} first token after {took:7.1f} ms (the engine's own start-up: {start * 1000:.0f} ms)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--requests", type=int, default=24, help="streamed completions per case and run")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--engines", default="llamacpp,vllm", help="which engines (vllm: its venv is built on first use)")
    p.add_argument("--smoke", action="store_true", help="one short run of each case (the test suite's)")
    a = p.parse_args(argv)
    if a.smoke:
        a.runs, a.requests, a.max_tokens = 1, 4, 8
    engines = a.engines.split(",")
    sigterm_as_interrupt()
    lines = [f"# {command_line(SCRIPT, argv)}", f"# {os.cpu_count()} cores; ms; ratio rows: added ms, meshd/direct"]
    lines.append(f"{'model':10} {'conc':>4} {'path':7} {'ttft p50':>9} {'ttft p99':>9} {'tokens/s':>9}")
    with tempfile.TemporaryDirectory(prefix="meshd-bench-llm-") as tmp:
        work = Path(tmp)
        mesh = LocalMesh(work / "mesh", service="bench-llm")
        try:
            mesh.start_etcd()
            cases: list[tuple[Node, str]] = []
            if "llamacpp" in engines:
                python = llamacpp_python()
                (tiny,) = make_gguf(python, work / "models", 1, seed=1)
                (wide,) = make_gguf(python, work / "models", 1, seed=2, prefix="wide", shape=WIDE_SHAPE)
                node = add_llm_node(mesh, "llm", LlmRuntimeArgs(python, memory_bytes=2 << 30))
                register(node, "tiny", tiny)
                register(node, "wide", wide)
                cases += [(node, "tiny"), (node, "wide")]
            if "vllm" in engines:
                vpython = vllm_python()
                base, _ = make_hf_llama(vpython, work / "hf", 0, seed=1)
                vnode = add_llm_node(mesh, "vllm", vllm_args(vpython, 2), {"service_name": "bench-llm-vllm"})
                register(vnode, "vllm-tiny", base, "vllm")
                cases.append((vnode, "vllm-tiny"))
            fake = f"{sys.executable} -m meshd.testing.fake_llm --port {{port}} --name {{name}}"
            fake += f" --token-interval-ms {RELAY_INTERVAL_MS}"
            relay_args = LlmRuntimeArgs(Path(sys.executable), engine_command=fake, engine_args=())
            relay_node = add_llm_node(mesh, "relay", relay_args, {"service_name": "bench-llm-relay"})
            register(relay_node, "stamped", work, "llm")
            lines += [asyncio_run(cold_row(node, mesh, m, a.max_tokens)) for node, m in cases]
            for node, model_id in cases:
                lines += asyncio_run(warm_rows(a, node, model_id))
            lines += asyncio_run(relay_rows(a, relay_node, "stamped"))
        finally:
            stop_uninterrupted(mesh)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
