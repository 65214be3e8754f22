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


MIG_SLOTS = 7  # what an A100/H100 reports as its maximum number of MIG devices


@dataclass
class FakeNVML:
    """Devices as (uuid, total bytes), in NVML's (PCI bus) order. `migs`: GPU index -> its MIG
    devices as (uuid, total bytes), None for an empty slot (or one this container cannot see);
    a GPU named there is in MIG mode (an empty list: MIG on, no MIG device listed).
    `init_error`: nvmlInit raises it (no driver). Counts init and shutdown calls, so tests can
    check every init is shut down."""

    gpus: list[tuple[str, int]] = field(default_factory=list)
    migs: dict[int, list[tuple[str, int] | None]] = field(default_factory=dict)
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

    def _device(self, handle: int | tuple[int, int]) -> tuple[str, int]:
        if isinstance(handle, tuple):  # a MIG device: (GPU index, slot)
            mig = self.migs[handle[0]][handle[1]]
            assert mig is not None
            return mig
        return self.gpus[handle]

    def nvmlDeviceGetUUID(self, handle: int | tuple[int, int]) -> str | bytes:
        uuid = self._device(handle)[0]
        return uuid.encode() if self.uuid_as_bytes else uuid

    def nvmlDeviceGetMemoryInfo(self, handle: int | tuple[int, int]) -> MemoryInfo:
        total = self._device(handle)[1]  # a GPU in MIG mode: its whole memory, as the real NVML says
        return MemoryInfo(total=total, free=total)

    def nvmlDeviceGetMigMode(self, handle: int) -> list[int]:
        """[current, pending]: 1 is NVML_DEVICE_MIG_ENABLE."""
        on = int(handle in self.migs)
        return [on, on]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: int) -> int:
        return MIG_SLOTS if handle in self.migs else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: int, index: int) -> tuple[int, int]:
        slots = self.migs.get(handle, [])
        if not 0 <= index < MIG_SLOTS:
            raise NVMLError(f"invalid MIG index {index}")
        if index >= len(slots) or slots[index] is None:
            raise NVMLError("Not Found")  # pynvml.NVMLError_NotFound: an empty slot
        return (handle, index)
