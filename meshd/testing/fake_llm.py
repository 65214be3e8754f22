"""A small OpenAI-compatible engine of our own, for unit tests of the LLM runtime's process
handling (start-up failures, crash loops) where a real engine cannot be made to misbehave
on cue. Never the only test of a feature: tests/llm runs real llama.cpp engines.

    python -m meshd.testing.fake_llm --port P --name NAME [--exit-at-start CODE] [--die-after S]

It answers /v1/models, and /v1/completions with the prompt's words echoed back (`"repeat": N`
times; streamed as Server-Sent Events with `"stream": true`, `--token-interval-ms` apart, each
stamped with the time it was sent, for bench/llm.py's relay delay). A word is a token: the
answer says how many in its `usage`, as does a stream's last event when asked
(`"stream_options": {"include_usage": true}`, as vLLM does).

As an engine under load (the LLM routing tests and bench/llm_routing.py): `--max-running N`
serves N requests at a time and queues the rest; `--prefill-ms-per-token F` spends F ms per
prompt token (a word) not found in its prefix cache, one prefill at a time (a GPU's prefill is
compute-bound); `--cache-tokens C` keeps the prompt prefixes it served, in blocks of
`BLOCK_TOKENS`, least recently used dropped past C tokens; `max_tokens` caps the answer. It
publishes vLLM's metrics at `/metrics`: requests waiting and running, KV-cache use (the tokens
of the requests running over C), prefix-cache queries and hits (tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

BLOCK_TOKENS = 16  # vLLM's default block size: prefixes are cached in whole blocks
MAX_BODY = 64 << 20  # a long prompt (aiohttp refuses over 1 MiB by default; vLLM takes it)


@dataclass
class Engine:
    """The load an engine of ours simulates (all zero: none, as before)."""

    max_running: int = 0  # 0: any number at once
    prefill_s_per_token: float = 0.0
    cache_tokens: int = 0
    running: int = 0
    waiting: int = 0
    running_tokens: int = 0
    queries: int = 0  # prompt tokens looked up in the prefix cache
    hits: int = 0  # of those, found
    done: int = 0  # requests answered
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)
    slots: asyncio.Semaphore | None = None
    prefill: asyncio.Lock = field(default_factory=asyncio.Lock)

    def cached(self, words: list[str]) -> int:
        """The prompt's tokens found in the prefix cache (leading whole blocks); its blocks are
        cached from now on (the least recently used dropped)."""
        if not self.cache_tokens:
            return 0
        hit, found = 0, True
        keys = [hash(tuple(words[: BLOCK_TOKENS * (i + 1)])) for i in range(len(words) // BLOCK_TOKENS)]
        for key in keys:
            if found and key in self.blocks:
                hit += BLOCK_TOKENS
            else:
                found = False
            self.blocks[key] = None
            self.blocks.move_to_end(key)
        while len(self.blocks) * BLOCK_TOKENS > self.cache_tokens:
            self.blocks.popitem(last=False)
        self.queries += len(words)
        self.hits += hit
        return hit

    def metrics(self, name: str) -> str:
        kv = min(1.0, self.running_tokens / self.cache_tokens) if self.cache_tokens else 0.0
        label = f'{{model_name="{name}"}}'
        return (
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{label} {float(self.running)}\n"
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{label} {float(self.waiting)}\n"
            f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{label} {kv}\n"
            f"# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{label} {float(self.queries)}\n"
            f"# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{label} {float(self.hits)}\n"
            f"# TYPE vllm:request_success counter\nvllm:request_success_total{label} {float(self.done)}\n"
        )


def app(name: str, interval_s: float = 0.0, engine: Engine | None = None) -> web.Application:
    sim = engine or Engine()
    if sim.max_running and sim.slots is None:
        sim.slots = asyncio.Semaphore(sim.max_running)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=sim.metrics(name), content_type="text/plain")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": name, "object": "model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        words = str(body.get("prompt", "")).split()
        pieces = words * max(1, int(body.get("repeat", 1)))
        if isinstance(body.get("max_tokens"), int):
            pieces = pieces[: max(1, body["max_tokens"])]
        if sim.slots is None and not sim.prefill_s_per_token and not sim.cache_tokens:
            return await answer(request, body, words, pieces)
        sim.waiting += 1
        try:
            if sim.slots is not None:
                await sim.slots.acquire()
        finally:
            sim.waiting -= 1
        sim.running += 1
        held = len(words) + len(pieces)
        sim.running_tokens += held
        try:
            async with sim.prefill:
                uncached = len(words) - sim.cached(words)
                if sim.prefill_s_per_token and uncached:
                    await asyncio.sleep(uncached * sim.prefill_s_per_token)
            response = await answer(request, body, words, pieces)
            sim.done += 1
            return response
        finally:
            sim.running -= 1
            sim.running_tokens -= held
            if sim.slots is not None:
                sim.slots.release()

    async def answer(
        request: web.Request, body: dict[str, object], words: list[str], pieces: list[str]
    ) -> web.StreamResponse:
        usage = {"prompt_tokens": len(words), "completion_tokens": len(pieces)}
        if not body.get("stream"):
            choice = {"text": " ".join(pieces), "index": 0, "finish_reason": "stop"}
            whole = {"object": "text_completion", "model": body.get("model"), "choices": [choice], "usage": usage}
            return web.json_response(whole)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, word in enumerate(pieces):
            if interval_s and i:
                await asyncio.sleep(interval_s)
            done = "stop" if i == len(pieces) - 1 else None
            chunk: dict[str, object] = {"object": "text_completion", "sent_ns": time.time_ns()}
            chunk["choices"] = [
                {"text": word, "index": 0, "finish_reason": done}
            ]  # when it left the engine: bench/llm.py's relay delay
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):  # as vLLM: one last event
            last = {"object": "text_completion", "choices": [], "usage": usage}
            await response.write(f"data: {json.dumps(last)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    application = web.Application(client_max_size=MAX_BODY)
    application.router.add_get("/v1/models", models)
    application.router.add_post("/v1/completions", completions)
    application.router.add_get("/metrics", metrics)
    return application


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", default="fake")
    p.add_argument("--exit-at-start", type=int, help="print a line and exit with this status at once")
    p.add_argument("--die-after", type=float, help="exit (status 1) this many seconds after start")
    p.add_argument("--token-interval-ms", type=float, default=0.0, help="between streamed pieces")
    p.add_argument("--max-running", type=int, default=0, help="requests served at once (0: any), the rest wait")
    p.add_argument("--prefill-ms-per-token", type=float, default=0.0, help="per prompt token not in the prefix cache")
    p.add_argument("--cache-tokens", type=int, default=0, help="prefix cache (and KV) capacity in tokens")
    p.add_argument("--gpu-bytes", type=int, default=0, help="hold this much GPU memory, as an engine's weights (torch)")
    p.add_argument("--gpu-bytes-file", type=Path, help="... the number written in this file (the model's {path})")
    a = p.parse_args()
    if a.exit_at_start is not None:
        print("fake engine: told to fail at start", flush=True)
        sys.exit(a.exit_at_start)
    if a.die_after is not None:
        threading.Timer(a.die_after, os._exit, args=(1,)).start()
    held = None
    if a.gpu_bytes_file is not None:
        a.gpu_bytes = int(a.gpu_bytes_file.read_text())
    if a.gpu_bytes:  # a GPU engine's footprint (--gpu-capacity on): needs torch and a GPU
        import torch

        held = torch.empty(a.gpu_bytes, dtype=torch.uint8, device="cuda")
    engine = Engine(a.max_running, a.prefill_ms_per_token / 1000, a.cache_tokens)
    web.run_app(app(a.name, a.token_interval_ms / 1000, engine), host="127.0.0.1", port=a.port, print=None)
    del held  # held until the engine stops


if __name__ == "__main__":
    main()
