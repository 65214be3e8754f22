"""An engine's load as the LLM runtime reads it (vLLM's metric names), and the engine of our own
that publishes them under a real queue (meshd.testing.fake_llm, served here over real HTTP)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp.test_utils import TestServer

from meshd.adapter.llm.load import LoadWatch, parse_engine_metrics
from meshd.decisions.placement.llm import EngineLoad
from meshd.testing.fake_llm import BLOCK_TOKENS, Engine, app

VLLM_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
"""


def test_vllm_metrics_give_waiting_running_and_kv_use() -> None:
    assert parse_engine_metrics(VLLM_TEXT) == (2, 3, 0.5)  # the older name's value, the larger
    two = VLLM_TEXT + 'vllm:num_requests_waiting{engine="1",model_name="m"} 1.0\n'
    assert parse_engine_metrics(two) == (3, 3, 0.5), "summed over the engine's label sets"
    assert parse_engine_metrics("vllm:num_requests_running 1\n") == (0, 1, -1.0)
    assert parse_engine_metrics("process_cpu_seconds_total 3.0\n") is None  # not an engine's
    assert parse_engine_metrics("vllm:num_requests_running{x} nan?\n") is None


def test_a_watch_without_a_reading_counts_calls_in_flight() -> None:
    watch = LoadWatch()
    watch.inflight = 2
    assert watch.load() == EngineLoad(2)


async def test_the_engine_of_our_own_queues_past_max_running_and_says_so() -> None:
    engine = Engine(max_running=1, cache_tokens=10 * BLOCK_TOKENS)
    server = TestServer(app("m", interval_s=0.1, engine=engine))
    await server.start_server()
    url = f"http://127.0.0.1:{server.port}"
    prompt = " ".join(f"w{i}" for i in range(2 * BLOCK_TOKENS))
    try:
        async with aiohttp.ClientSession() as s:

            async def complete() -> bytes:
                body = {"prompt": prompt, "max_tokens": 10, "stream": True}
                async with s.post(url + "/v1/completions", json=body) as r:
                    return await r.read()

            calls = [asyncio.create_task(complete()) for _ in range(3)]

            async def reading() -> tuple[int, int, float] | None:
                async with s.get(url + "/metrics") as r:
                    return parse_engine_metrics(await r.text())

            seen = set()
            async with asyncio.timeout(30):  # each call runs 1 s: the first for 1 s, two wait
                while (2, 1) not in seen:
                    got = await reading()
                    assert got is not None
                    seen.add(got[:2])
                    await asyncio.sleep(0.02)
            answers = await asyncio.gather(*calls)
            assert all(a.count(b"data: {") == 10 for a in answers)
            assert await reading() == (0, 0, 0.0)
            async with s.get(url + "/metrics") as r:
                text = await r.text()
            # The same prompt three times: the first missed the prefix cache, the others hit it.
            hits = next(line for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total"))
            assert float(hits.rsplit(" ", 1)[1]) == 2 * 2 * BLOCK_TOKENS
            whole = await (await s.post(url + "/v1/completions", json={"prompt": "a b c", "max_tokens": 2})).read()
            assert json.loads(whole)["usage"] == {"prompt_tokens": 3, "completion_tokens": 2}
    finally:
        await server.close()
