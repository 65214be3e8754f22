"""GPU memory, for sizing the adapter's capacity when the model server runs on GPUs.

Read through NVML with `nvidia-ml-py` (module `pynvml`, the binding NVIDIA maintains), imported
only when asked for and optional: without it, without a driver, or without a device, there is
no GPU and the adapter sizes from host memory as before. Upstream's adapters do not look at
GPUs at all (capacity is always the container's memory request minus `MEM_BUFFER_BYTES`);
this is meshd's own rule, written in the README.

Triton places one instance of a GPU model on *each* GPU it sees (instance_group KIND_GPU with
no `gpus` list), so every loaded model takes memory on every device: the cache holds what fits
on the smallest visible device, not the sum. `CUDA_VISIBLE_DEVICES` (indices or `GPU-` UUIDs)
narrows the devices as CUDA would; NVML itself ignores it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True, slots=True)
class Device:
    index: int
    uuid: str
    total_bytes: int


def load_nvml() -> Any | None:
    """The `pynvml` module, or None when nvidia-ml-py is not installed."""
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


def devices(nvml: Any) -> list[Device]:
    """Every device NVML sees; [] when NVML cannot start (no driver, no device)."""
    try:
        nvml.nvmlInit()
    except Exception as e:  # pynvml.NVMLError and its many subclasses; no driver at all
        log.debug("no NVML: %s", e)
        return []
    try:
        found = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = nvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            found.append(Device(index, uuid, int(nvml.nvmlDeviceGetMemoryInfo(handle).total)))
        return found
    except Exception as e:
        log.warning("NVML could not list the GPUs (%s); sizing from host memory", e)
        return []
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def visible(found: list[Device], env: Mapping[str, str]) -> list[Device]:
    """The devices CUDA_VISIBLE_DEVICES leaves (all when unset). Entries are indices or UUID
    prefixes; CUDA stops at the first entry it cannot match, and so does this."""
    spec = env.get(VISIBLE_DEVICES)
    if spec is None:
        return list(found)
    chosen: list[Device] = []
    for entry in (e.strip() for e in spec.split(",")):
        match = None
        if entry.isdigit():
            match = next((d for d in found if d.index == int(entry)), None)
        elif entry.startswith("GPU-"):
            match = next((d for d in found if d.uuid.startswith(entry)), None)
        if match is None:
            break
        if match not in chosen:
            chosen.append(match)
    return chosen


def memory_per_model_bytes(env: Mapping[str, str], nvml: Any | None = None) -> int | None:
    """Total memory of the smallest visible GPU; None when there is none (or no NVML)."""
    module = nvml if nvml is not None else load_nvml()
    if module is None:
        return None
    seen = visible(devices(module), env)
    if not seen:
        return None
    smallest = min(seen, key=lambda d: d.total_bytes)
    log.info(
        "GPUs %s; sizing the cache from the smallest, %d bytes",
        ", ".join(f"{d.index} ({d.total_bytes} bytes)" for d in seen),
        smallest.total_bytes,
    )
    return smallest.total_bytes
