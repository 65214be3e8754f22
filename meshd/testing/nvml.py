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
    reserved: int = 0  # nvmlMemory_v2 only: what the driver keeps (on an H200, 615 MiB)


@dataclass
class ProcessInfo:
    pid: int
    usedGpuMemory: int | None  # pynvml's name


NVML_MEMORY_V2 = 0x02000028  # pynvml.nvmlMemory_v2 (a struct version: sizeof | 2 << 24)


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
    reserved: int = 0  # per GPU, what the driver keeps; reported only by memory info v2
    processes: dict[int, list[tuple[int, int | None]]] = field(default_factory=dict)  # GPU -> (pid, bytes)
    memory_v2: bool = True  # False: a binding older than nvmlMemory_v2 (no `version` argument)

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

    def nvmlDeviceGetMemoryInfo(self, handle: int | tuple[int, int], version: int | None = None) -> MemoryInfo:
        total = self._device(handle)[1]  # a GPU in MIG mode: its whole memory, as the real NVML says
        if version is None:  # v1, as a real driver answers it: the reservation counted as used
            return MemoryInfo(total=total, free=total - self.reserved, used=self.reserved)
        if not self.memory_v2:
            raise TypeError("nvmlDeviceGetMemoryInfo() got an unexpected keyword argument 'version'")
        assert version == NVML_MEMORY_V2
        return MemoryInfo(total=total, free=total - self.reserved, reserved=self.reserved)

    @property
    def nvmlMemory_v2(self) -> int:
        if not self.memory_v2:
            raise AttributeError("nvmlMemory_v2")
        return NVML_MEMORY_V2

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[ProcessInfo]:
        return [ProcessInfo(pid, used) for pid, used in self.processes.get(handle, [])]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> list[ProcessInfo]:
        return []

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
