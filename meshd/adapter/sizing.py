"""Model and capacity sizes for the adapter (pure), upstream's adapters' rules.

A model's size is what the user declared (`{"meshd": {"size_bytes": N}}` in the model key),
else its size on disk (upstream's `disk_size_bytes` in the key, else measured) times a
multiplier (upstream `MODELSIZE_MULTIPLIER`, 1.25): loaded models take more memory than their
files. Capacity is the model server's memory (upstream `CONTAINER_MEM_REQ_BYTES`) minus what
the server itself needs (upstream `MEM_BUFFER_BYTES`, 256 MiB); on a GPU, its memory minus
meshd's own GPU overhead (1 GiB by default, see DEFAULT_GPU_OVERHEAD_BYTES).
"""

from __future__ import annotations

import os
from pathlib import Path

from meshd.core.model_types import key_object
from meshd.decisions.placement.modelkey import DISK_SIZE_KEY, policy_from_key

DEFAULT_MULTIPLIER = 1.25
DEFAULT_OVERHEAD_BYTES = 256 << 20
# What comes off a GPU's memory before models (after the driver's own reservation, which
# gpu.py takes off where NVML reports it): a CUDA context per process and device (~300-600 MiB
# with CUDA 12; 527 MiB measured on an H200, CUDA 13, PyTorch 2.11), Triton's CUDA memory pool
# (64 MiB per device by default, --cuda-memory-pool-byte-size), and framework workspaces
# (cuBLAS/cuDNN) that models allocate beside their weights. 256 MiB, the host default, is below
# the context alone.
DEFAULT_GPU_OVERHEAD_BYTES = 1 << 30
MIN_CAPACITY_BYTES = 16 << 20


def model_size(key: str, disk_bytes: int | None, multiplier: float, default_bytes: int) -> int:
    """Bytes a loaded model is taken to use. `disk_bytes`: measured, None if unknown."""
    try:
        policy = policy_from_key(key)
    except ValueError:
        policy = None  # validated by meshd at registration; other writers may differ
    if policy is not None and policy.declared_size_bytes is not None:
        return policy.declared_size_bytes
    on_disk = policy.disk_size_bytes if policy is not None and policy.disk_size_bytes else None
    on_disk = on_disk or _whole_float_disk_size(key) or disk_bytes
    if not on_disk:
        return default_bytes
    return max(1, int(on_disk * multiplier))


def _whole_float_disk_size(key: str) -> int | None:
    """`disk_size_bytes` written as a whole float (1000.0): upstream's adapters decode JSON
    numbers as floats, so writers may send one; meshd's key policy reads only integers."""
    obj = key_object(key)
    raw = obj.get(DISK_SIZE_KEY) if obj is not None else None
    if isinstance(raw, float) and raw.is_integer() and raw > 0:
        return int(raw)
    return None


def capacity(memory_bytes: int, overhead_bytes: int) -> int:
    """What models may use: the server's memory minus its own needs (never below a floor)."""
    return max(MIN_CAPACITY_BYTES, memory_bytes - overhead_bytes)


def capacity_with_gpu(
    host_bytes: int | None,
    gpu_bytes: int | None,
    overhead_bytes: int,
    default_host: int,
    gpu_overhead_bytes: int = DEFAULT_GPU_OVERHEAD_BYTES,
) -> int:
    """Capacity when the server may run models on a GPU (`gpu_bytes`: the smallest visible
    device's total memory, None without one). Without a GPU: host memory (`host_bytes` as
    configured, else `default_host`) minus `overhead_bytes`. With one: the GPU's memory minus
    `gpu_overhead_bytes` (CUDA's context, the server's pools on the device, and whatever else
    uses the device: `total` does not know about other processes), or, when host memory was
    configured too, whichever of the two leaves less room (a model must fit in both)."""
    if gpu_bytes is None:
        return capacity(default_host if host_bytes is None else host_bytes, overhead_bytes)
    on_gpu = capacity(gpu_bytes, gpu_overhead_bytes)
    return on_gpu if host_bytes is None else min(on_gpu, capacity(host_bytes, overhead_bytes))


def disk_usage(path: Path) -> int:
    """Bytes under `path` (a file or a directory tree), following no symlinked directories."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:
                continue  # a dangling link: contributes nothing
    return total
