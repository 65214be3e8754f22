"""GPU capacity for the Triton adapter: NVML through a fake (no GPU here), the capacity rule,
and the whole process reading a fake `pynvml` module through its lazy import."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from meshd._proto.mmesh import model_runtime_pb2 as rt
from meshd._proto.mmesh import model_runtime_pb2_grpc as rt_grpc
from meshd.adapter import gpu, main, sizing
from meshd.testing.nvml import FakeNVML, NVMLError
from meshd.testing.procs import free_port

GIB = 1 << 30
H100, A10 = ("GPU-aaaa-1111", 80 * GIB), ("GPU-bbbb-2222", 24 * GIB)


def test_the_smallest_visible_device_sizes_the_cache() -> None:
    nvml = FakeNVML([H100, A10])
    assert gpu.memory_per_model_bytes({}, nvml) == 24 * GIB
    assert nvml.inits == nvml.shutdowns == 1


PCI = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # CUDA's indices are then NVML's (PCI bus order)


def test_the_drivers_reservation_is_not_counted() -> None:
    """NVML's memory info v2 reports what the driver keeps (an H200 with driver 580: 644,939,776
    of 150,754,820,096 bytes, which cudaMemGetInfo's total leaves out); v1's total includes it."""
    reserved = 644_939_776
    nvml = FakeNVML([("GPU-9c413394", 150_754_820_096)], reserved=reserved)
    assert gpu.memory_per_model_bytes({}, nvml) == 150_754_820_096 - reserved == 150_109_880_320
    older = FakeNVML([("GPU-9c413394", 150_754_820_096)], reserved=reserved, memory_v2=False)
    assert gpu.memory_per_model_bytes({}, older) == 150_754_820_096  # a binding without v2: total, as before


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        ("0", 80 * GIB),
        ("1", 24 * GIB),
        ("1,0", 24 * GIB),
        ("GPU-aaaa", 80 * GIB),  # a UUID prefix, as CUDA takes it
        ("GPU-aaaa-1111", 80 * GIB),
        ("0,7,1", 80 * GIB),  # CUDA stops at the first entry it cannot match
        ("", None),
        ("-1", None),
        ("MIG-abc", None),  # no such MIG device: host memory (with a warning, below)
    ],
)
def test_cuda_visible_devices_narrows_the_devices(visible: str, expected: int | None) -> None:
    env = {"CUDA_VISIBLE_DEVICES": visible, **PCI}
    assert gpu.memory_per_model_bytes(env, FakeNVML([H100, A10])) == expected


def test_indices_without_pci_bus_order_use_the_smallest_of_all(caplog: pytest.LogCaptureFixture) -> None:
    """CUDA numbers devices fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID: its 0 may be
    NVML's 1. Unknown mapping and different sizes: the smallest of all, with a warning."""
    with caplog.at_level(logging.WARNING, logger="meshd.adapter.gpu"):
        assert gpu.memory_per_model_bytes({"CUDA_VISIBLE_DEVICES": "0"}, FakeNVML([H100, A10])) == 24 * GIB
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in caplog.text
    env = {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    assert gpu.memory_per_model_bytes(env, FakeNVML([H100, A10])) == 24 * GIB
    # UUIDs name a card whatever the numbering; same-size cards make the numbering moot.
    assert gpu.memory_per_model_bytes({"CUDA_VISIBLE_DEVICES": "GPU-aaaa-1111"}, FakeNVML([H100, A10])) == 80 * GIB
    twins = FakeNVML([H100, ("GPU-cccc-3333", 80 * GIB)])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="meshd.adapter.gpu"):
        assert gpu.memory_per_model_bytes({"CUDA_VISIBLE_DEVICES": "1"}, twins) == 80 * GIB
    assert not caplog.records


def test_an_ambiguous_uuid_prefix_matches_nothing() -> None:
    nvml = FakeNVML([("GPU-aaaa-1111", 80 * GIB), ("GPU-aaaa-2222", 24 * GIB)])
    assert gpu.memory_per_model_bytes({"CUDA_VISIBLE_DEVICES": "GPU-aaaa"}, nvml) is None
    assert gpu.memory_per_model_bytes({"CUDA_VISIBLE_DEVICES": "GPU-aaaa-2"}, nvml) == 24 * GIB


A100 = ("GPU-a100-0000", 80 * GIB)
SLICE_10, SLICE_20 = ("MIG-1111-aaaa", 10 * GIB), ("MIG-2222-bbbb", 20 * GIB)


def test_mig_devices_size_the_cache_not_their_gpu() -> None:
    """MIG on, CUDA_VISIBLE_DEVICES unset (k8s: the device plugin sets NVIDIA_VISIBLE_DEVICES):
    NVML lists the parent with its full 80 GiB; the MIG devices are what CUDA uses."""
    nvml = FakeNVML([A100], migs={0: [SLICE_20, None, SLICE_10]})
    assert gpu.memory_per_model_bytes({}, nvml) == 10 * GIB
    assert nvml.inits == nvml.shutdowns == 1
    assert gpu.memory_per_model_bytes({"NVIDIA_VISIBLE_DEVICES": "MIG-2222-bbbb"}, nvml) == 20 * GIB
    assert gpu.memory_per_model_bytes({"NVIDIA_VISIBLE_DEVICES": "all"}, nvml) == 10 * GIB
    assert gpu.memory_per_model_bytes({"NVIDIA_VISIBLE_DEVICES": "0"}, nvml) == 10 * GIB  # host indices: no narrowing
    assert gpu.memory_per_model_bytes({"NVIDIA_VISIBLE_DEVICES": "none"}, nvml) is None
    assert gpu.memory_per_model_bytes({"CUDA_VISIBLE_DEVICES": "MIG-2222"}, nvml) == 20 * GIB
    # CUDA_VISIBLE_DEVICES wins over NVIDIA_VISIBLE_DEVICES, as in CUDA.
    env = {"CUDA_VISIBLE_DEVICES": "MIG-1111-aaaa", "NVIDIA_VISIBLE_DEVICES": "MIG-2222-bbbb"}
    assert gpu.memory_per_model_bytes(env, nvml) == 10 * GIB
    # The parent's UUID stands for its MIG devices, never for its whole memory.
    assert gpu.memory_per_model_bytes({"CUDA_VISIBLE_DEVICES": "GPU-a100-0000"}, nvml) == 10 * GIB


def test_mig_beside_a_whole_gpu() -> None:
    nvml = FakeNVML([A10, A100], migs={1: [SLICE_20]})
    assert gpu.memory_per_model_bytes({}, nvml) == 20 * GIB
    assert gpu.memory_per_model_bytes({"CUDA_VISIBLE_DEVICES": "GPU-bbbb-2222"}, nvml) == 24 * GIB
    assert gpu.memory_per_model_bytes({"CUDA_VISIBLE_DEVICES": "MIG-2222-bbbb"}, nvml) == 20 * GIB


def test_mig_that_cannot_be_listed_falls_back_to_host_memory_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="meshd.adapter.gpu"):
        assert gpu.memory_per_model_bytes({}, FakeNVML([A100], migs={0: []})) is None
    assert "MIG mode" in caplog.text and "host memory" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="meshd.adapter.gpu"):
        env = {"CUDA_VISIBLE_DEVICES": "MIG-9999", **PCI}
        assert gpu.memory_per_model_bytes(env, FakeNVML([A100], migs={0: [SLICE_10]})) is None
    assert "MIG-9999" in caplog.text and "host memory" in caplog.text


def test_a_gpu_without_mig_support_is_a_whole_gpu() -> None:
    class NoMig(FakeNVML):
        def nvmlDeviceGetMigMode(self, handle: int) -> list[int]:
            raise NVMLError("Not Supported")

    assert gpu.memory_per_model_bytes({}, NoMig([A10])) == 24 * GIB


def test_no_gpu_no_driver_no_binding() -> None:
    assert gpu.memory_per_model_bytes({}, FakeNVML([])) is None
    assert gpu.memory_per_model_bytes({}, FakeNVML([H100], init_error=NVMLError("Driver Not Loaded"))) is None


def test_no_binding_installed_means_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "load_nvml", lambda: None)
    assert gpu.memory_per_model_bytes({}) is None


def test_a_failing_device_query_still_shuts_nvml_down() -> None:
    class Broken(FakeNVML):
        def nvmlDeviceGetMemoryInfo(self, handle: int) -> object:
            raise NVMLError("GPU is lost")

    nvml = Broken([H100])
    assert gpu.memory_per_model_bytes({}, nvml) is None
    assert nvml.inits == nvml.shutdowns == 1


def test_uuids_as_bytes_from_older_bindings() -> None:
    nvml = FakeNVML([H100, A10], uuid_as_bytes=True)
    assert gpu.memory_per_model_bytes({"CUDA_VISIBLE_DEVICES": "GPU-bbbb"}, nvml) == 24 * GIB


def test_capacity_rule() -> None:
    overhead, on_gpu = 256 << 20, 2 * GIB
    assert sizing.capacity_with_gpu(None, None, overhead, GIB, on_gpu) == GIB - overhead  # as before: host default
    assert sizing.capacity_with_gpu(4 * GIB, None, overhead, GIB, on_gpu) == 4 * GIB - overhead
    # On the GPU its own overhead comes off, not the host's.
    assert sizing.capacity_with_gpu(None, 24 * GIB, overhead, GIB, on_gpu) == 22 * GIB  # the GPU alone
    assert sizing.capacity_with_gpu(16 * GIB, 24 * GIB, overhead, GIB, on_gpu) == 16 * GIB - overhead  # the tighter
    assert sizing.capacity_with_gpu(64 * GIB, 24 * GIB, overhead, GIB, on_gpu) == 22 * GIB
    assert sizing.capacity_with_gpu(23 * GIB, 24 * GIB, overhead, GIB, on_gpu) == 22 * GIB  # host leaves more
    assert sizing.capacity_with_gpu(None, 24 * GIB, overhead, GIB) == 23 * GIB  # default: 1 GiB off the GPU
    assert sizing.DEFAULT_GPU_OVERHEAD_BYTES == GIB


def args(*argv: str) -> argparse.Namespace:
    return main.build_parser().parse_args(["--server-grpc", "x:1", "--repository", "/r", "--port", "1", *argv])


def test_only_triton_and_only_unless_turned_off() -> None:
    nvml = FakeNVML([A10])
    assert main.gpu_memory(args("--server", "triton"), {}, nvml) == 24 * GIB
    assert main.gpu_memory(args("--server", "mlserver"), {}, nvml) is None
    assert main.gpu_memory(args("--server", "triton", "--gpu-capacity", "off"), {}, nvml) is None
    assert main.gpu_memory(args("--server", "triton"), {"MESHD_ADAPTER_GPU_CAPACITY": "off"}, nvml) is None
    with pytest.raises(SystemExit, match="auto or off"):
        main.gpu_memory(args("--server", "triton"), {"MESHD_ADAPTER_GPU_CAPACITY": "yes"}, nvml)
    a = args("--server", "triton", "--memory-overhead-bytes", str(GIB))
    assert main.config_from(a, {}, 24 * GIB).capacity_bytes == 23 * GIB
    assert main.config_from(a, {"CONTAINER_MEM_REQ_BYTES": str(8 * GIB)}, 24 * GIB).capacity_bytes == 7 * GIB
    assert main.config_from(a, {}, None).capacity_bytes == sizing.MIN_CAPACITY_BYTES  # 1 GiB default - 1 GiB


def test_the_gpu_overhead_is_its_own_setting() -> None:
    plain = args("--server", "triton")
    assert main.config_from(plain, {}, 24 * GIB).capacity_bytes == 23 * GIB  # 1 GiB by default
    assert main.config_from(plain, {"MEM_BUFFER_BYTES": str(4 * GIB)}, 24 * GIB).capacity_bytes == 23 * GIB
    env = {"MESHD_ADAPTER_GPU_OVERHEAD_BYTES": str(4 * GIB)}
    assert main.config_from(plain, env, 24 * GIB).capacity_bytes == 20 * GIB
    flag = args("--server", "triton", "--gpu-memory-overhead-bytes", str(2 * GIB))
    assert main.config_from(flag, env, 24 * GIB).capacity_bytes == 22 * GIB  # the flag wins
    with pytest.raises(SystemExit, match="MESHD_ADAPTER_GPU_OVERHEAD_BYTES"):
        main.config_from(plain, {"MESHD_ADAPTER_GPU_OVERHEAD_BYTES": "1G"}, 24 * GIB)


FAKE_PYNVML = """
from meshd.testing.nvml import FakeNVML, NVMLError
_fake = FakeNVML([("GPU-aaaa-1111", 80 << 30), ("GPU-bbbb-2222", 24 << 30)])
nvmlInit, nvmlShutdown = _fake.nvmlInit, _fake.nvmlShutdown
nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex = _fake.nvmlDeviceGetCount, _fake.nvmlDeviceGetHandleByIndex
nvmlDeviceGetUUID, nvmlDeviceGetMemoryInfo = _fake.nvmlDeviceGetUUID, _fake.nvmlDeviceGetMemoryInfo
nvmlDeviceGetMigMode, nvmlDeviceGetMaxMigDeviceCount = _fake.nvmlDeviceGetMigMode, _fake.nvmlDeviceGetMaxMigDeviceCount
nvmlDeviceGetMigDeviceHandleByIndex = _fake.nvmlDeviceGetMigDeviceHandleByIndex
"""


@pytest.mark.parametrize(
    ("server", "visible", "expected"),
    [("triton", None, 23), ("triton", "0", 79), ("triton", "GPU-bbbb", 23), ("mlserver", None, 1)],
)
def test_the_adapter_process_reports_gpu_capacity(
    tmp_path: Path, server: str, visible: str | None, expected: int
) -> None:
    """`meshd adapter` imports `pynvml` lazily (here a fake on PYTHONPATH): runtimeStatus
    carries the capacity even while the server is not up."""
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "pynvml.py").write_text(FAKE_PYNVML)
    gone = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CONTAINER_MEM_REQ_BYTES")
    env = {k: v for k, v in os.environ.items() if k not in gone}
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "fake"), str(Path(__file__).resolve().parents[2])])
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    port = free_port()
    argv = [sys.executable, "-m", "meshd", "adapter", "--server", server, "--server-grpc", "127.0.0.1:1"]
    argv += ["--repository", str(tmp_path / "repo"), "--port", str(port), "--memory-overhead-bytes", "0"]
    env["MESHD_ADAPTER_GPU_OVERHEAD_BYTES"] = str(GIB)  # on the GPU, this comes off instead
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=30)
            stub = rt_grpc.ModelRuntimeStub(ch)
            resp = stub.runtimeStatus(rt.RuntimeStatusRequest(), timeout=max(1.0, deadline - time.monotonic()))
        assert resp.capacityInBytes == expected * GIB
    finally:
        proc.kill()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()


def test_the_gpu_memory_of_a_process_group() -> None:
    """What an LLM engine holds with --gpu-capacity on: NVML's per-process figures for its PIDs,
    summed over devices; None where NVML lists none of them (an engine on the CPU, or PIDs from
    another namespace) or cannot start."""
    nvml = FakeNVML([H100, A10], processes={0: [(100, 5 * GIB), (101, 2 * GIB), (300, GIB)], 1: [(100, GIB)]})
    assert gpu.processes_gpu_bytes(nvml, [100, 101]) == 8 * GIB
    assert gpu.processes_gpu_bytes(nvml, [999]) is None
    assert nvml.inits == nvml.shutdowns == 2
    unknown = FakeNVML([H100], processes={0: [(100, None)]})  # listed, its memory not reported
    assert gpu.processes_gpu_bytes(unknown, [100]) == 0
    assert gpu.processes_gpu_bytes(FakeNVML([H100], init_error=NVMLError("no driver")), [100]) is None
