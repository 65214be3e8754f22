"""A MemoryStore whose watches can be held back: a mirror that lags the store on demand."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from meshd.kv.memory import MemoryStore
from meshd.kv.store import Event


class LaggingStore(MemoryStore):
    """Watches deliver only while `flowing` is set; `puts` counts plain puts."""

    def __init__(self, clock: Callable[[], float] = lambda: 0.0) -> None:
        super().__init__(clock=clock)
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.puts = 0

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        self.puts += 1
        return await super().put(key, value, lease)

    def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[list[Event]]:
        return self._held(super().watch_prefix(prefix, start_revision))

    async def _held(self, inner: AsyncIterator[list[Event]]) -> AsyncIterator[list[Event]]:
        async for batch in inner:
            await self.flowing.wait()
            yield batch
