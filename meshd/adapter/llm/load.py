"""Each engine's load, as the runtime reports it to meshd (`meshd-engine-load` on every
answer; decisions.placement.llm decides with it).

The runtime counts its calls in flight per engine. Where the engine publishes its own
Prometheus metrics (vLLM's `/metrics`: requests waiting and running, KV-cache use; SGLang and
meshd.testing.fake_llm the same names), they are read too, at most every `READ_EVERY_S` and
only while calls come, so a reading is never older than that plus one read when it is sent.
An engine without them (llama-cpp-python has no `/metrics`) is asked once, then only counted.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from meshd.decisions.placement.llm import EngineLoad

READ_EVERY_S = 0.25
READING_KEPT_S = 1.0  # an older reading is not sent (calls stopped for a while): counts only
READ_TIMEOUT = aiohttp.ClientTimeout(total=0.5)
# vLLM's names (v0.6 to v1); kv_cache_usage_perc replaced gpu_cache_usage_perc. A fraction 0..1.
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
KV_USE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")


def parse_engine_metrics(text: str) -> tuple[int, int, float] | None:
    """(waiting, running, KV use) from an engine's Prometheus text, summed over its label sets
    (one per served model name); None when it has neither count."""
    waiting = running = 0
    kv = -1.0
    seen = False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        name = line[:name_end]
        if name not in WAITING and name not in RUNNING and name not in KV_USE:
            continue
        try:
            value = float(line.rsplit(" ", 1)[-1])
        except ValueError:
            continue
        if name in WAITING:
            waiting += int(value)
            seen = True
        elif name in RUNNING:
            running += int(value)
            seen = True
        else:
            kv = max(kv, value)
    return (waiting, running, kv) if seen else None


class LoadWatch:
    """One engine's load: its calls in flight here and its latest metrics reading."""

    def __init__(self) -> None:
        self.inflight = 0
        self.reading: tuple[int, int, float] | None = None
        self.read_at = 0.0  # time.monotonic() of the last read started
        self.reading_at = 0.0  # time.monotonic() the reading came
        self.has_metrics = True  # until the engine answers /metrics with anything but 200
        self._task: asyncio.Task[None] | None = None

    def load(self) -> EngineLoad:
        if self.reading is None or time.monotonic() - self.reading_at > READING_KEPT_S:
            return EngineLoad(self.inflight)
        waiting, running, kv = self.reading
        return EngineLoad(self.inflight, waiting, running, kv)

    def refresh(self, session: aiohttp.ClientSession, base_url: str) -> None:
        """Read the engine's metrics in the background when the reading is older than
        READ_EVERY_S (never waited for: the call goes on with the reading it has)."""
        now = time.monotonic()
        if not self.has_metrics or now - self.read_at < READ_EVERY_S or self._task is not None:
            return
        self.read_at = now
        self._task = asyncio.create_task(self._read(session, base_url))

    async def _read(self, session: aiohttp.ClientSession, base_url: str) -> None:
        try:
            async with session.get(base_url + "/metrics", timeout=READ_TIMEOUT) as r:
                if r.status != 200:
                    self.has_metrics = False  # e.g. llama-cpp-python: calls in flight only
                    self.reading = None
                    return
                self.reading = parse_engine_metrics(await r.text())
                self.reading_at = time.monotonic()
                if self.reading is None:
                    self.has_metrics = False
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            self.reading = None  # the engine is down or slow: no reading rather than an old one
        finally:
            self._task = None

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
