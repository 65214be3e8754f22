"""The work a model does, as one rule any serving system can run: load, hold memory, serve.

Standard library only, so a process of another serving system (bench/peers.py runs it in Ray
Serve replicas) imports exactly this code and does exactly what the reference runtime does:

- loading takes the model's `load_ms` (an asyncio sleep: the process stays responsive, as a
  model read from disk or a store would leave it) and then allocates `size_bytes` and writes
  every page, so the memory is really resident in the process that serves the model, and is
  given back when the model is dropped (`Held` goes away);
- each request waits the model's `service_ms` (an asyncio sleep: the model's own time, which
  costs the serving process no CPU) and computes `y = W x + b` for each input row.

The model file (meshd.runtimes.models) says `load_ms`, `service_ms` and `hold_memory`; a file
without them loads and serves at once and holds no memory, as before.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass

PAGE_BYTES = 4096


@dataclass(frozen=True)
class Work:
    """What loading and serving one model costs."""

    load_ms: float = 0.0
    service_ms: float = 0.0
    hold_bytes: int = 0  # memory allocated, written and kept while the model is loaded


class Held:
    """The memory a loaded model holds; dropping the object frees it."""

    __slots__ = ("memory",)

    def __init__(self, size_bytes: int) -> None:
        self.memory = hold_memory(size_bytes)

    @property
    def size_bytes(self) -> int:
        return len(self.memory)


def hold_memory(size_bytes: int) -> bytearray:
    """`size_bytes` of memory with every page written (resident, not just reserved)."""
    memory = bytearray(size_bytes)
    pages = range(0, size_bytes, PAGE_BYTES)
    memory[::PAGE_BYTES] = b"\x01" * len(pages)
    return memory


async def load(work: Work) -> Held:
    """Take the load time, then allocate and write the model's memory."""
    if work.load_ms > 0:
        await asyncio.sleep(work.load_ms / 1000)
    return Held(work.hold_bytes)


async def serve(work: Work) -> None:
    """The model's per-request service time."""
    if work.service_ms > 0:
        await asyncio.sleep(work.service_ms / 1000)


def linear(weights: Sequence[Sequence[float]], bias: Sequence[float], row: Sequence[float]) -> list[float]:
    """y = W x + b for one input row (math.fsum, so every system computes the same floats)."""
    return [math.fsum(w * v for w, v in zip(wr, row, strict=True)) + b for wr, b in zip(weights, bias, strict=True)]
