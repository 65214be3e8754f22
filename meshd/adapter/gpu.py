"""GPU memory, for sizing the adapter's capacity when the model server runs on GPUs.

Read through NVML with `nvidia-ml-py` (module `pynvml`, the binding NVIDIA maintains), imported
only when asked for and optional: without it, without a driver, or without a device, there is
no GPU and the adapter sizes from host memory as before. Upstream's adapters do not look at
GPUs at all (capacity is always the container's memory request minus `MEM_BUFFER_BYTES`);
this is meshd's own rule, written in the README.

Triton places one instance of a GPU model on *each* GPU it sees (instance_group KIND_GPU with
no `gpus` list), so every loaded model takes memory on every device: the cache holds what fits
on the smallest visible device, not the sum.

Which devices the server sees, as far as NVML can tell (NVML itself ignores the variables):
- a GPU in MIG mode is not a CUDA device; its MIG devices are, each with its own (small) memory.
  NVML lists the parent GPU with its full memory, so the MIG devices are listed through it
  (`nvmlDeviceGetMigMode`, `nvmlDeviceGetMigDeviceHandleByIndex`). MIG on and none listed: no
  sizing from the GPU (host memory, with a warning), never the parent's memory;
- `CUDA_VISIBLE_DEVICES`, else `NVIDIA_VISIBLE_DEVICES` (what the k8s device plugin sets, MIG
  slices included; the container runtime reads it, CUDA does not): `GPU-`/`MIG-` UUIDs (or a
  unique prefix) match that device whatever the numbering. Indices in `CUDA_VISIBLE_DEVICES`
  count CUDA's devices, fastest first unless `CUDA_DEVICE_ORDER=PCI_BUS_ID`, while NVML counts
  by PCI bus: they are mapped only under PCI_BUS_ID or when every device has the same memory;
  otherwise the smallest of all devices sizes the cache (with a warning). Indices in
  `NVIDIA_VISIBLE_DEVICES` are the host's, not the container's: that variable then narrows
  nothing (the container runtime already did). CUDA stops at the first entry it cannot match,
  and so does this (with a warning).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
NVIDIA_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
DEVICE_ORDER = "CUDA_DEVICE_ORDER"
MIG_ENABLE = 1  # pynvml.NVML_DEVICE_MIG_ENABLE


@dataclass(frozen=True, slots=True)
class Device:
    """One device CUDA could use: a GPU, or a MIG device (`parent`: its GPU's UUID)."""

    index: int  # position among the devices NVML lists (PCI bus order, MIG devices in their GPU's place)
    uuid: str
    total_bytes: int  # less the driver's reservation, where NVML reports it
    parent: str | None = None


@dataclass(frozen=True, slots=True)
class Inventory:
    devices: list[Device]
    mig_unlisted: list[int]  # GPUs in MIG mode whose MIG devices NVML did not list


def load_nvml() -> Any | None:
    """The `pynvml` module, or None when nvidia-ml-py is not installed."""
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


def _uuid(nvml: Any, handle: Any) -> str:
    uuid = nvml.nvmlDeviceGetUUID(handle)
    return uuid.decode() if isinstance(uuid, bytes) else str(uuid)


def _mig_on(nvml: Any, handle: Any) -> bool:
    try:
        current = nvml.nvmlDeviceGetMigMode(handle)[0]
    except AttributeError:
        return False  # a binding older than MIG
    except Exception:
        return False  # NVMLError_NotSupported: a GPU without MIG
    return bool(current == MIG_ENABLE)


def _usable_bytes(nvml: Any, handle: Any) -> int:
    """The device's memory less what its driver keeps for itself: NVML's memory info v2 reports
    that reservation (an H200: 615 MiB of 140.4 GiB, seen 2026-11-30 with driver 580), which v1's
    `total` includes and no CUDA process can allocate (cudaMemGetInfo's total leaves it out).
    A binding or driver without v2: `total`, as before."""
    try:
        info = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
        return int(info.total) - int(info.reserved)
    except Exception:  # AttributeError/TypeError: an older binding; NVMLError: not supported here
        return int(nvml.nvmlDeviceGetMemoryInfo(handle).total)


def _mig_devices(nvml: Any, handle: Any, parent: str, first_index: int) -> list[Device]:
    found: list[Device] = []
    for slot in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except Exception:
            continue  # NVMLError_NotFound: an empty slot (or one this container may not see)
        found.append(Device(first_index + len(found), _uuid(nvml, mig), _usable_bytes(nvml, mig), parent))
    return found


def inventory(nvml: Any) -> Inventory:
    """Every device NVML sees, MIG devices in place of their GPU; empty when NVML cannot start."""
    try:
        nvml.nvmlInit()
    except Exception as e:  # pynvml.NVMLError and its many subclasses; no driver at all
        log.debug("no NVML: %s", e)
        return Inventory([], [])
    try:
        found: list[Device] = []
        unlisted: list[int] = []
        for gpu_index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(gpu_index)
            if _mig_on(nvml, handle):
                migs = _mig_devices(nvml, handle, _uuid(nvml, handle), len(found))
                if not migs:
                    unlisted.append(gpu_index)
                found.extend(migs)
                continue
            found.append(Device(len(found), _uuid(nvml, handle), _usable_bytes(nvml, handle)))
        return Inventory(found, unlisted)
    except Exception as e:
        log.warning("NVML could not list the GPUs (%s); sizing from host memory", e)
        return Inventory([], [])
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def devices(nvml: Any) -> list[Device]:
    return inventory(nvml).devices


def _by_uuid(found: list[Device], entry: str) -> list[Device]:
    """A GPU- or MIG- UUID (or a prefix of exactly one): that device. The UUID of a GPU in MIG
    mode stands for all of its MIG devices (the smallest then counts)."""
    for exact in (True, False):
        own = [d for d in found if (d.uuid == entry if exact else d.uuid.startswith(entry))]
        if len(own) == 1:
            return own
        parents = {d.parent for d in found if d.parent and (d.parent == entry if exact else d.parent.startswith(entry))}
        if len(parents) == 1 and not own:
            return [d for d in found if d.parent in parents]
    return []  # none, or a prefix of several (CUDA takes it as invalid)


def visible(found: list[Device], env: Mapping[str, str]) -> list[Device]:
    """The devices the server may use, smallest-memory rule in mind (see the module docstring).
    [] means "size from host memory" (with a warning when NVML did list devices)."""
    spec, source = env.get(VISIBLE_DEVICES), VISIBLE_DEVICES
    if spec is None:
        spec, source = env.get(NVIDIA_VISIBLE_DEVICES), NVIDIA_VISIBLE_DEVICES
        if spec is None or spec.strip().lower() in ("all", ""):
            return list(found)
        if spec.strip().lower() in ("none", "void"):
            return []
    entries = [e.strip() for e in spec.split(",")]
    if source == NVIDIA_VISIBLE_DEVICES and not all(e.startswith(("GPU-", "MIG-")) for e in entries):
        log.debug("%s=%r holds host indices; the container sees only its own devices", source, spec)
        return list(found)
    pci_order = env.get(DEVICE_ORDER, "").strip().upper() == "PCI_BUS_ID"
    same_size = len({d.total_bytes for d in found}) <= 1
    chosen: list[Device] = []
    for entry in entries:
        if entry.isdigit() and not (pci_order or same_size):
            smallest = min(found, key=lambda d: d.total_bytes) if found else None
            log.warning(
                "%s=%r names devices by index, which CUDA numbers fastest first (no "
                "CUDA_DEVICE_ORDER=PCI_BUS_ID) and NVML by PCI bus; the devices differ in memory, so "
                "sizing from the smallest of all%s",
                source,
                spec,
                f" ({smallest.uuid})" if smallest else "",
            )
            return [smallest] if smallest else []
        if entry.isdigit():
            match = [d for d in found if d.index == int(entry)]
        elif entry.startswith(("GPU-", "MIG-")):
            match = _by_uuid(found, entry)
        else:
            match = []
        if not match:
            if found:
                log.warning(
                    "%s=%r: no device NVML lists matches %r (CUDA stops there)%s",
                    source,
                    spec,
                    entry,
                    "" if chosen else "; sizing from host memory",
                )
            break
        chosen.extend(d for d in match if d not in chosen)
    return chosen


def memory_per_model_bytes(env: Mapping[str, str], nvml: Any | None = None) -> int | None:
    """Total memory of the smallest visible GPU; None when there is none (or no NVML)."""
    module = nvml if nvml is not None else load_nvml()
    if module is None:
        return None
    listed = inventory(module)
    if listed.mig_unlisted:
        log.warning(
            "GPU(s) %s are in MIG mode but NVML lists none of their MIG devices; not sizing from "
            "the whole GPU's memory: sizing from host memory",
            ", ".join(map(str, listed.mig_unlisted)),
        )
        return None
    seen = visible(listed.devices, env)
    if not seen:
        return None
    smallest = min(seen, key=lambda d: d.total_bytes)
    log.info(
        "GPUs %s; sizing the cache from the smallest, %d bytes",
        ", ".join(f"{d.index} {d.uuid} ({d.total_bytes} bytes)" for d in seen),
        smallest.total_bytes,
    )
    return smallest.total_bytes


def processes_gpu_bytes(nvml: Any, pids: Collection[int]) -> int | None:
    """GPU memory NVML lists for these processes (compute and graphics contexts, every device),
    or None when NVML cannot answer or lists none of them: an engine on the CPU, or a container
    that sees other PIDs than NVML reports (without the host's PID namespace, NVML may report
    the host's). Checked on an H200 (2026-11-30): a process holding a 4 GiB tensor was listed
    under its own PID with 4,838,129,664 bytes, its CUDA context included."""
    wanted = set(pids)
    try:
        nvml.nvmlInit()
    except Exception:
        return None
    try:
        total, seen = 0, False
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            for listing in (nvml.nvmlDeviceGetComputeRunningProcesses, nvml.nvmlDeviceGetGraphicsRunningProcesses):
                for proc in listing(handle):
                    if proc.pid in wanted:
                        seen = True
                        total += int(proc.usedGpuMemory or 0)  # None where the driver cannot tell
        return total if seen else None
    except Exception as e:
        log.warning("NVML could not list the GPU processes (%s)", e)
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
