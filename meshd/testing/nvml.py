"""A fake NVML (the part of `pynvml` that `meshd.adapter.gpu` uses), for tests without a GPU."""

from __future__ import annotations

from dataclasses import dataclass, field


class NVMLError(Exception):
    """What pynvml raises (its subclasses name the NVML return code)."""


@dataclass
class MemoryInfo:
    total: int
    free: int
    used: int = 0


@dataclass
class FakeNVML:
    """Devices as (uuid, total bytes). `init_error`: nvmlInit raises it (no driver).
    Counts init and shutdown calls, so tests can check every init is shut down."""

    gpus: list[tuple[str, int]] = field(default_factory=list)
    init_error: Exception | None = None
    inits: int = 0
    shutdowns: int = 0
    uuid_as_bytes: bool = False  # older pynvml releases return bytes

    NVMLError = NVMLError

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self.gpus):
            raise NVMLError(f"invalid index {index}")
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str | bytes:
        uuid = self.gpus[handle][0]
        return uuid.encode() if self.uuid_as_bytes else uuid

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> MemoryInfo:
        total = self.gpus[handle][1]
        return MemoryInfo(total=total, free=total)
