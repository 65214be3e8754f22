"""What id injection and extraction (meshd/serving/proxy/wire.py) cost per request.

    python bench/splice.py [--seconds S]

KServe V2 ModelInferRequests of ~100 B and 1 MiB (the tensor in raw_input_contents),
path [1] (model_name), and for depth 3 a request whose id lives in a nested message:

    fast      inject_id when the id is already there (returns the input object, no copy)
    replace   inject_id over a different model_name (one splice, one copy of the rest)
    append    inject_id when model_name is absent (appended at the end)
    extract   extract_id

Prints microseconds per call (best of 5 rounds). Timings only; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable

from meshd._proto.inference import grpc_predict_v2_pb2 as pb
from meshd.serving.proxy.wire import extract_id, inject_id


def _request(model: str, raw_bytes: int) -> bytes:
    req = pb.ModelInferRequest(model_name=model, id="req-1")
    req.inputs.add(name="input-0", datatype="FP32", shape=[1, max(1, raw_bytes // 4)])
    req.raw_input_contents.append(b"\x00" * raw_bytes)
    data: bytes = req.SerializeToString()
    return data


def _per_call_us(fn: Callable[[], object], seconds: float) -> float:
    timer = timeit.Timer(fn)
    n, t = timer.autorange()
    number = max(1, int(n * seconds / max(t, 1e-9) / 5))
    return min(timer.repeat(repeat=5, number=number)) / number * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=1.0, help="time per case, roughly")
    a = ap.parse_args()

    model = "model-a"
    nested = inject_id(b"\x12\x04\x08\x01\x10\x02" * 3, [5, 3, 1], model)
    cases: list[tuple[str, bytes, list[int]]] = [
        ("100B", _request(model, 48), [1]),
        ("1MiB", _request(model, 1 << 20), [1]),
        ("nested", nested, [5, 3, 1]),
    ]
    print(f"{'payload':>8} {'bytes':>8} {'fast':>8} {'replace':>8} {'append':>8} {'extract':>8}   (us/call)")
    for name, data, path in cases:
        absent = _request("", 1 << 20 if name == "1MiB" else 48) if path == [1] else b"\x12\x04\x08\x01\x10\x02" * 3
        _row(name, data, absent, path, model, a.seconds)


def _row(name: str, data: bytes, absent: bytes, path: list[int], model: str, seconds: float) -> None:
    assert inject_id(data, path, model) is data
    other = inject_id(data, path, "model-b")
    fast = _per_call_us(lambda: inject_id(data, path, model), seconds)
    replace = _per_call_us(lambda: inject_id(other, path, model), seconds)
    append = _per_call_us(lambda: inject_id(absent, path, model), seconds)
    extract = _per_call_us(lambda: extract_id(data, path), seconds)
    print(f"{name:>8} {len(data):>8} {fast:>8.2f} {replace:>8.2f} {append:>8.2f} {extract:>8.2f}")


if __name__ == "__main__":
    main()
