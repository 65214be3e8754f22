"""The model work the reference runtime and bench/peers.py's Ray replicas share."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from meshd._proto.mmesh import model_runtime_pb2 as rt
from meshd.runtimes import model_work
from meshd.runtimes.models import FORMAT, DemoModel, make_infer_request

from .conftest import StartRuntime


def linear(**extra: Any) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "kind": "linear",
        "inputs": 2,
        "outputs": 1,
        "weights": [[1.0, 2.0]],
        "bias": [0.5],
    } | extra


def test_hold_memory_writes_every_page() -> None:
    memory = model_work.hold_memory(5 * model_work.PAGE_BYTES + 7)
    assert len(memory) == 5 * model_work.PAGE_BYTES + 7
    assert memory[:: model_work.PAGE_BYTES] == b"\x01" * 6
    assert model_work.hold_memory(0) == bytearray()


def test_load_takes_its_time_and_holds_its_size() -> None:
    t0 = time.monotonic()
    held = asyncio.run(model_work.load(model_work.Work(load_ms=50, hold_bytes=1 << 20)))
    assert time.monotonic() - t0 >= 0.045
    assert held.size_bytes == 1 << 20


def test_linear_is_w_x_plus_b() -> None:
    assert model_work.linear([[1.0, 2.0], [0.0, -1.0]], [0.5, 3.0], [2.0, 1.0]) == [4.5, 2.0]


def test_model_file_timing_and_memory_round_trip() -> None:
    model = DemoModel.from_dict(linear(size_bytes=4096, load_ms=12.5, service_ms=3, hold_memory=True))
    assert model.work == model_work.Work(12.5, 3.0, 4096)
    assert DemoModel.from_dict(model.to_dict()) == model
    plain = DemoModel.from_dict(linear(size_bytes=4096))
    assert plain.work == model_work.Work(0.0, 0.0, 0)  # no hold_memory: size is only reported
    assert "load_ms" not in plain.to_dict()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"load_ms": -1}, "'load_ms'"),
        ({"service_ms": "5"}, "'service_ms'"),
        ({"load_ms": True}, "'load_ms'"),
        ({"service_ms": float("inf")}, "'service_ms'"),
        ({"hold_memory": 1}, "'hold_memory'"),
    ],
)
def test_bad_timing_keys_are_rejected(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DemoModel.from_dict(linear(**extra))


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_runtime_loads_with_the_files_time_holds_its_memory_and_serves_with_its_time(
    start_runtime: StartRuntime, tmp_path: Path
) -> None:
    size = 64 << 20
    path = DemoModel.from_dict(linear(size_bytes=size, load_ms=300, service_ms=200, hold_memory=True)).save(
        tmp_path / "m.json"
    )
    runtime = start_runtime()
    before = _rss(runtime.child.pid)
    t0 = time.monotonic()
    assert runtime.load("m", path).sizeInBytes == size
    assert time.monotonic() - t0 >= 0.28
    assert _rss(runtime.child.pid) - before >= size * 0.9  # really resident
    infer = runtime.raw_unary("ModelInfer")
    t0 = time.monotonic()
    infer(make_infer_request("m", [[1.0, 1.0]]).SerializeToString(), metadata=(("mm-model-id", "m"),), timeout=10)
    assert time.monotonic() - t0 >= 0.19
    runtime.runtime.unloadModel(rt.UnloadModelRequest(modelId="m"))
    assert _rss(runtime.child.pid) - before < size * 0.5  # given back with the model
