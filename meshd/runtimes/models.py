"""The demo runtime's model file format, its math, and KServe V2 request/response helpers.

This module owns everything about "what a demo model is" and nothing about serving it,
so tests, the demo and benchmarks can build requests and check answers without a server.

Model file format (one JSON file per model, UTF-8)::

    {
      "format": "meshd-demo/1",          # required, exactly this string
      "kind": "linear" | "echo",         # required
      "inputs": n,                       # linear: int >= 1 (echo: optional, informational)
      "outputs": m,                      # linear: int >= 1 (echo: optional, informational)
      "weights": [[n floats] * m rows],  # linear: required; echo: absent or []
      "bias": [m floats],                # linear: required; echo: absent or []
      "size_bytes": N,                   # optional int >= 0: the memory size the runtime
                                         # reports for the loaded model (fakes big models)
      "load_ms": t,                      # optional number >= 0: a load takes this long
      "service_ms": t,                   # optional number >= 0: each request takes this long
      "hold_memory": true                # optional: loading allocates and writes size_bytes,
    }                                    # held while loaded (meshd.runtimes.model_work)

Unknown keys are ignored so the format can grow. A `linear` model computes
`y = W x + b` for every row `x` of its input; an `echo` model returns its inputs
unchanged (cheap, for benchmarks that measure the mesh rather than the model).

On the wire (KServe V2 `ModelInferRequest`) a linear model takes one FP32 input tensor
"x" of shape [batch, n] and answers one FP32 output tensor "y" of shape [batch, m];
tensor data travels as little-endian float32 in `raw_input_contents` /
`raw_output_contents` (`contents.fp32_contents` is accepted too).

`python -m meshd.runtimes.models DIR --count N` writes N generated models to DIR and
prints their ids, one a line.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from meshd._proto.inference import grpc_predict_v2_pb2 as pb
from meshd.runtimes.model_work import Work, linear

FORMAT = "meshd-demo/1"
INPUT_NAME = "x"
OUTPUT_NAME = "y"
FP32 = "FP32"
ECHO_DATATYPE = "UINT8"

ModelKind = Literal["linear", "echo"]
_KINDS: tuple[ModelKind, ...] = ("linear", "echo")

# array("f") is C float; the wire format is IEEE float32 little-endian, so swap on big-endian hosts.
_SWAP = sys.byteorder != "little"
assert array("f").itemsize == 4, "array('f') must be 32-bit"


def pack_f32(values: Iterable[float]) -> bytes:
    """Little-endian float32 bytes of `values`."""
    arr = array("f", values)
    if _SWAP:
        arr.byteswap()
    return arr.tobytes()


def unpack_f32(data: bytes) -> list[float]:
    """Floats from little-endian float32 bytes; ValueError if the length is not a multiple of 4."""
    if len(data) % 4:
        raise ValueError(f"FP32 data is {len(data)} bytes, not a multiple of 4")
    arr = array("f")
    arr.frombytes(data)
    if _SWAP:
        arr.byteswap()
    return arr.tolist()


# ---------------------------------------------------------------------------------------------
# The model


@dataclass(frozen=True)
class DemoModel:
    """A loaded demo model: validated contents of one model file."""

    kind: ModelKind
    inputs: int
    outputs: int
    weights: tuple[tuple[float, ...], ...] = ()
    bias: tuple[float, ...] = ()
    # None: the file did not say; the runtime then reports its default model size.
    size_bytes: int | None = None
    load_ms: float = 0.0
    service_ms: float = 0.0
    hold_memory: bool = False

    @property
    def work(self) -> Work:
        """What loading and serving this model costs (meshd.runtimes.model_work)."""
        hold = (self.size_bytes or 0) if self.hold_memory else 0
        return Work(self.load_ms, self.service_ms, hold)

    @classmethod
    def load(cls, path: Path | str) -> DemoModel:
        """Read and validate a model file. OSError if unreadable, ValueError if invalid."""
        path = Path(path)
        text = path.read_text(encoding="utf-8")
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: object, source: str = "model") -> DemoModel:
        """Validate a parsed model file; every error names `source` and the offending key."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: a model file must hold a JSON object, not {type(data).__name__}")
        fmt = data.get("format")
        if fmt != FORMAT:
            raise ValueError(f"{source}: 'format' must be {FORMAT!r}, got {fmt!r}")
        kind = data.get("kind")
        if kind not in _KINDS:
            raise ValueError(f"{source}: 'kind' must be one of {list(_KINDS)}, got {kind!r}")
        size = data.get("size_bytes")
        if size is not None and not _is_int(size, minimum=0):
            raise ValueError(f"{source}: 'size_bytes' must be an integer >= 0, got {size!r}")
        timing: dict[str, float] = {}
        for key in ("load_ms", "service_ms"):
            t = data.get(key, 0.0)
            if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
                raise ValueError(f"{source}: {key!r} must be a number >= 0, got {t!r}")
            timing[key] = float(t)
        hold = data.get("hold_memory", False)
        if not isinstance(hold, bool):
            raise ValueError(f"{source}: 'hold_memory' must be true or false, got {hold!r}")
        load_ms, service_ms = timing["load_ms"], timing["service_ms"]

        if kind == "echo":
            # Echo takes whatever it is given; shapes are informational only.
            for key in ("inputs", "outputs"):
                if key in data and not _is_int(data[key], minimum=0):
                    raise ValueError(f"{source}: {key!r} must be an integer >= 0, got {data[key]!r}")
            for key in ("weights", "bias"):
                if data.get(key):
                    raise ValueError(f"{source}: an echo model has no {key!r}")
            return cls(
                "echo",
                int(data.get("inputs", 0)),
                int(data.get("outputs", 0)),
                size_bytes=size,
                load_ms=load_ms,
                service_ms=service_ms,
                hold_memory=hold,
            )

        n, m = data.get("inputs"), data.get("outputs")
        if not _is_int(n, minimum=1):
            raise ValueError(f"{source}: 'inputs' must be an integer >= 1, got {n!r}")
        if not _is_int(m, minimum=1):
            raise ValueError(f"{source}: 'outputs' must be an integer >= 1, got {m!r}")
        assert isinstance(n, int) and isinstance(m, int)
        weights = data.get("weights")
        if not isinstance(weights, list) or len(weights) != m:
            raise ValueError(f"{source}: 'weights' must be a list of {m} rows (one per output)")
        rows: list[tuple[float, ...]] = []
        for j, row in enumerate(weights):
            if not isinstance(row, list) or len(row) != n:
                raise ValueError(f"{source}: 'weights'[{j}] must be a list of {n} numbers (one per input)")
            rows.append(_floats(row, f"{source}: 'weights'[{j}]"))
        bias = data.get("bias")
        if not isinstance(bias, list) or len(bias) != m:
            raise ValueError(f"{source}: 'bias' must be a list of {m} numbers (one per output)")
        return cls("linear", n, m, tuple(rows), _floats(bias, f"{source}: 'bias'"), size, load_ms, service_ms, hold)

    def to_dict(self) -> dict[str, Any]:
        """The model file contents (JSON-serialisable)."""
        out: dict[str, Any] = {"format": FORMAT, "kind": self.kind, "inputs": self.inputs, "outputs": self.outputs}
        if self.kind == "linear":
            out["weights"] = [list(r) for r in self.weights]
            out["bias"] = list(self.bias)
        if self.size_bytes is not None:
            out["size_bytes"] = self.size_bytes
        if self.load_ms:
            out["load_ms"] = self.load_ms
        if self.service_ms:
            out["service_ms"] = self.service_ms
        if self.hold_memory:
            out["hold_memory"] = True
        return out

    def save(self, path: Path | str) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict()) + "\n", encoding="utf-8")
        return path

    def predict(self, rows: Sequence[Sequence[float]]) -> list[list[float]]:
        """y = W x + b for each row (linear); the rows themselves (echo). ValueError on a bad row width."""
        if self.kind == "echo":
            return [list(r) for r in rows]
        out: list[list[float]] = []
        for i, x in enumerate(rows):
            if len(x) != self.inputs:
                raise ValueError(f"row {i} has {len(x)} values, the model takes {self.inputs}")
            out.append(linear(self.weights, self.bias, x))
        return out


def _is_int(value: object, minimum: int) -> bool:
    # bool is an int subclass in Python, but `true` is not a size.
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _floats(values: list[object], what: str) -> tuple[float, ...]:
    out: list[float] = []
    for k, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"{what}[{k}] must be a finite number, got {v!r}")
        out.append(float(v))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Generating model files


@dataclass(frozen=True)
class GeneratedModel:
    id: str
    path: Path


def generate_models(
    directory: Path,
    count: int,
    *,
    prefix: str = "model-",
    inputs: int = 4,
    outputs: int = 2,
    size_bytes: int = 1 << 20,
    seed: int = 0,
) -> list[GeneratedModel]:
    """Write `count` linear models `<prefix>NNNN.json` to `directory` (created if missing).

    Weights depend only on (seed, index), so reruns produce identical files. bias[0] is the
    model's index, so a request of all zeros answers which model served it (routing tests).
    """
    if count < 0 or inputs < 1 or outputs < 1 or size_bytes < 0:
        raise ValueError("count and size_bytes must be >= 0, inputs and outputs >= 1")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    generated: list[GeneratedModel] = []
    for index in range(count):
        rng = random.Random(f"meshd-demo:{seed}:{index}")
        weights = tuple(tuple(round(rng.uniform(-1.0, 1.0), 4) for _ in range(inputs)) for _ in range(outputs))
        bias = (float(index), *(round(rng.uniform(-1.0, 1.0), 4) for _ in range(outputs - 1)))
        model = DemoModel("linear", inputs, outputs, weights, bias, size_bytes)
        model_id = f"{prefix}{index:04d}"
        generated.append(GeneratedModel(model_id, model.save(directory / f"{model_id}.json")))
    return generated


def write_echo_model(path: Path | str, size_bytes: int = 1 << 20) -> Path:
    """Write an echo model file (parent directory created if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return DemoModel("echo", 0, 0, size_bytes=size_bytes).save(path)


# ---------------------------------------------------------------------------------------------
# KServe V2 requests and responses


def _check_rows(rows: Sequence[Sequence[float]]) -> int:
    if not rows:
        raise ValueError("rows must hold at least one row")
    width = len(rows[0])
    for i, r in enumerate(rows):
        if len(r) != width:
            raise ValueError(f"row {i} has {len(r)} values, row 0 has {width}")
    return width


def make_infer_request(model_name: str, rows: Sequence[Sequence[float]]) -> pb.ModelInferRequest:
    """A ModelInferRequest with FP32 input "x" of shape [batch, n] in raw_input_contents."""
    width = _check_rows(rows)
    req = pb.ModelInferRequest(model_name=model_name)
    req.inputs.add(name=INPUT_NAME, datatype=FP32, shape=[len(rows), width])
    req.raw_input_contents.append(pack_f32(v for r in rows for v in r))
    return req


def make_infer_response(model_name: str, rows: Sequence[Sequence[float]], width: int) -> pb.ModelInferResponse:
    """A ModelInferResponse with FP32 output "y" of shape [batch, width] in raw_output_contents."""
    resp = pb.ModelInferResponse(model_name=model_name)
    resp.outputs.add(name=OUTPUT_NAME, datatype=FP32, shape=[len(rows), width])
    resp.raw_output_contents.append(pack_f32(v for r in rows for v in r))
    return resp


def _tensor_rows(
    name: str, datatype: str, shape: Sequence[int], raw: bytes | None, fp32: Sequence[float], what: str
) -> list[list[float]]:
    """Rows of a [batch, n] FP32 tensor from raw bytes (if given) or typed contents."""
    if datatype != FP32:
        raise ValueError(f"{what} {name!r} has datatype {datatype!r}, expected {FP32}")
    if len(shape) != 2 or shape[0] < 0 or shape[1] < 0:
        raise ValueError(f"{what} {name!r} has shape {list(shape)}, expected [batch, n]")
    batch, width = shape
    values = unpack_f32(raw) if raw is not None else list(fp32)
    if len(values) != batch * width:
        raise ValueError(f"{what} {name!r} has {len(values)} values, shape {list(shape)} needs {batch * width}")
    return [values[i * width : (i + 1) * width] for i in range(batch)]


def decode_infer_request(req: pb.ModelInferRequest, inputs: int | None = None) -> list[list[float]]:
    """Rows of input "x" (or the only input); ValueError if missing, not FP32, or not [batch, inputs]."""
    if not req.inputs:
        raise ValueError("the request has no input tensors")
    index = _pick(req.inputs, INPUT_NAME, "input")
    tensor = req.inputs[index]
    raw: bytes | None = None
    if req.raw_input_contents:
        # KServe V2: raw contents, when used, are given for every input in order.
        if len(req.raw_input_contents) != len(req.inputs):
            raise ValueError(f"{len(req.raw_input_contents)} raw_input_contents for {len(req.inputs)} inputs")
        raw = req.raw_input_contents[index]
    rows = _tensor_rows(tensor.name, tensor.datatype, tensor.shape, raw, tensor.contents.fp32_contents, "input")
    if inputs is not None and tensor.shape[1] != inputs:
        raise ValueError(f"input {tensor.name!r} has shape {list(tensor.shape)}, the model takes [batch, {inputs}]")
    return rows


def decode_infer_response(resp: pb.ModelInferResponse) -> list[list[float]]:
    """Rows of output "y" (or the only output), from raw_output_contents or contents.fp32_contents."""
    if not resp.outputs:
        raise ValueError("the response has no output tensors")
    index = _pick(resp.outputs, OUTPUT_NAME, "output")
    tensor = resp.outputs[index]
    raw = resp.raw_output_contents[index] if len(resp.raw_output_contents) > index else None
    return _tensor_rows(tensor.name, tensor.datatype, tensor.shape, raw, tensor.contents.fp32_contents, "output")


def _pick(tensors: Sequence[Any], name: str, what: str) -> int:
    for i, t in enumerate(tensors):
        if t.name == name:
            return i
    if len(tensors) == 1:
        return 0
    raise ValueError(f"no {what} tensor named {name!r} among {[t.name for t in tensors]}")


_PATTERN = bytes(range(256))


def make_echo_request(model_name: str, payload_bytes: int) -> pb.ModelInferRequest:
    """A ModelInferRequest with one UINT8 tensor "x" of `payload_bytes` raw bytes (for echo models)."""
    if payload_bytes < 0:
        raise ValueError("payload_bytes must be >= 0")
    payload = (_PATTERN * (payload_bytes // len(_PATTERN) + 1))[:payload_bytes]
    req = pb.ModelInferRequest(model_name=model_name)
    req.inputs.add(name=INPUT_NAME, datatype=ECHO_DATATYPE, shape=[payload_bytes])
    req.raw_input_contents.append(payload)
    return req


# ---------------------------------------------------------------------------------------------
# gen-models command


@dataclass
class _Args:
    directory: Path = field(default_factory=Path)
    count: int = 0
    size_bytes: int = 1 << 20
    prefix: str = "model-"
    inputs: int = 4
    outputs: int = 2
    seed: int = 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshd gen-models", description="Write generated demo model files and print their ids."
    )
    parser.add_argument("directory", type=Path, help="directory for the model files (created if missing)")
    parser.add_argument("--count", type=int, required=True, help="number of models")
    parser.add_argument("--size-bytes", type=int, default=1 << 20, help="size each model reports when loaded")
    parser.add_argument("--prefix", default="model-", help="model id prefix (ids are PREFIX0000, PREFIX0001, ...)")
    parser.add_argument("--inputs", type=int, default=4)
    parser.add_argument("--outputs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv, namespace=_Args())
    try:
        generated = generate_models(
            args.directory,
            args.count,
            prefix=args.prefix,
            inputs=args.inputs,
            outputs=args.outputs,
            size_bytes=args.size_bytes,
            seed=args.seed,
        )
    except (ValueError, OSError) as e:
        parser.error(str(e))
    for model in generated:
        print(model.id)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
