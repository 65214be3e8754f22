"""An engine's size with --gpu-capacity on: the GPU memory NVML lists for its process group,
else its resident memory (NVML through a fake; the real path was run on an H200, docs/llm.md)."""

from __future__ import annotations

from typing import Any

from meshd.adapter.llm.runtime import Engines, LlmConfig
from meshd.testing.nvml import FakeNVML

GIB = 1 << 30


class Group:
    """The two things Engines asks of an engine's processes."""

    def __init__(self, pids: list[int], rss: int) -> None:
        self._pids, self._rss = pids, rss

    def pids(self) -> list[int]:
        return self._pids

    def rss_bytes(self) -> int:
        return self._rss


async def test_on_a_gpu_an_engine_weighs_its_gpu_memory() -> None:
    nvml = FakeNVML([("GPU-h200", 140 * GIB)], processes={0: [(41, 30 * GIB), (42, 90 * GIB), (7, GIB)]})
    engines = Engines(LlmConfig(engine="custom", template="x {port}", python="python", gpu=nvml))
    engine: Any = Group([41, 42], 3 * GIB)  # vLLM: the API server and its worker both on the GPU
    assert await engines.held_bytes(engine) == 120 * GIB
    on_cpu: Any = Group([55], 3 * GIB)  # NVML lists none of its processes
    assert await engines.held_bytes(on_cpu) == 3 * GIB
    host = Engines(LlmConfig(engine="custom", template="x {port}", python="python"))  # --gpu-capacity off
    assert await host.held_bytes(engine) == 3 * GIB
