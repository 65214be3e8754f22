"""KServe V2 inference over HTTP: its JSON (and the binary-data extension) to gRPC's
`ModelInferRequest` and a `ModelInferResponse` back (pure: bytes and messages in and out).

The REST endpoint (api/kserve_http.py) turns `POST /v2/models/{name}/infer` into one
ModelInfer routed like any gRPC call, so a pod needs no separate REST proxy.

Request: `{"id", "parameters", "inputs": [{"name", "shape", "datatype", "parameters", "data"}],
"outputs": [{"name", "parameters": {"binary_data": bool}}]}`. `data` is flat or nested in
row-major order (BOOL as true/false, BYTES as strings). With the binary-data extension the
body is the JSON header (`Inference-Header-Content-Length` bytes) followed by each input
that has `parameters.binary_data_size`, in input order, raw little-endian (BYTES: each
element a 4-byte little-endian length and its bytes, as in `raw_input_contents`).
Every input goes to the runtime in `raw_input_contents` (one form for all, as Triton asks).

Response: outputs with `data`, or, when asked for (`binary_data` on the output or
`binary_data_output` in the request's parameters), raw after the JSON header with
`parameters.binary_data_size`; the header's length is returned for
`Inference-Header-Content-Length`. The HTTP-only parameters (`binary_data*`) never reach
the runtime. Anything malformed is BadTensor (HTTP 400), naming the field.

Model metadata (`GET /v2/models/{name}`) is one ModelMetadata call; its answer is rendered
as the REST protocol has it: `{"name", "versions", "platform", "inputs"/"outputs": [{"name",
"datatype", "shape"}]}` (shapes as numbers, not proto3 JSON's int64 strings).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from meshd._proto.inference import grpc_predict_v2_pb2 as pb
from meshd.core import tensor_bytes

# datatype -> struct code of one element (little-endian); BYTES and BF16 are handled apart.
FIXED: dict[str, str] = {
    "BOOL": "?",
    "UINT8": "B",
    "UINT16": "H",
    "UINT32": "I",
    "UINT64": "Q",
    "INT8": "b",
    "INT16": "h",
    "INT32": "i",
    "INT64": "q",
    "FP16": "e",
    "FP32": "f",
    "FP64": "d",
}
DATATYPES = frozenset({*FIXED, "BF16", "BYTES"})
# Typed `contents` field of each datatype (FP16 and BF16 have none: raw only).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
BINARY_DATA = "binary_data"  # on a requested output
BINARY_DATA_SIZE = "binary_data_size"  # on an input or output sent as binary
BINARY_DATA_OUTPUT = "binary_data_output"  # on the request: every output as binary
HTTP_ONLY = frozenset({BINARY_DATA, BINARY_DATA_SIZE, BINARY_DATA_OUTPUT})
INT64_MAX = (1 << 63) - 1


class BadTensor(ValueError):
    """A request the KServe V2 HTTP protocol does not allow (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class OutputChoice:
    """Which outputs the client wants as binary data after the JSON header."""

    binary: frozenset[str] = frozenset()
    all_binary: bool = False

    def wants_binary(self, name: str) -> bool:
        return self.all_binary or name in self.binary


# ---- request ---------------------------------------------------------------------------------
def parse_infer_request(
    body: bytes, header_length: int | None, model_name: str, model_version: str = ""
) -> tuple[pb.ModelInferRequest, OutputChoice]:
    """The ModelInferRequest a KServe V2 HTTP request asks for, and its output choice."""
    if header_length is None:
        header, binary = body, b""
    else:
        if not 0 <= header_length <= len(body):
            raise BadTensor(f"Inference-Header-Content-Length {header_length} is outside the body ({len(body)} bytes)")
        header, binary = body[:header_length], body[header_length:]
    try:
        doc = json.loads(header) if header.strip() else None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadTensor(f"malformed JSON: {e}") from None
    if not isinstance(doc, dict):
        raise BadTensor("the request must be a JSON object with 'inputs'")
    req = pb.ModelInferRequest(model_name=model_name, model_version=model_version)
    rid = doc.get("id", "")
    if not isinstance(rid, str):
        raise BadTensor("'id' must be a string")
    req.id = rid
    params = _object(doc.get("parameters"), "parameters")
    all_binary = params.get(BINARY_DATA_OUTPUT, False)
    if not isinstance(all_binary, bool):
        raise BadTensor(f"parameters.{BINARY_DATA_OUTPUT} must be true or false")
    _set_parameters(req.parameters, params, "parameters")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BadTensor("'inputs' must be a non-empty list")
    offset = 0
    for i, item in enumerate(inputs):
        raw, offset = _input(req, item, i, binary, offset)
        req.raw_input_contents.append(raw)
    if offset != len(binary):
        raise BadTensor(f"{len(binary) - offset} bytes after the JSON header belong to no input (binary_data_size)")
    wanted: set[str] = set()
    outputs = doc.get("outputs", [])
    if not isinstance(outputs, list):
        raise BadTensor("'outputs' must be a list")
    for i, item in enumerate(outputs):
        out = _object(item, f"outputs[{i}]")
        name = out.get("name")
        if not isinstance(name, str) or not name:
            raise BadTensor(f"outputs[{i}].name must be a non-empty string")
        oparams = _object(out.get("parameters"), f"outputs[{i}].parameters")
        binary_wanted = oparams.get(BINARY_DATA, False)
        if not isinstance(binary_wanted, bool):
            raise BadTensor(f"outputs[{i}].parameters.{BINARY_DATA} must be true or false")
        if binary_wanted:
            wanted.add(name)
        requested = req.outputs.add(name=name)
        _set_parameters(requested.parameters, oparams, f"outputs[{i}].parameters")
    return req, OutputChoice(frozenset(wanted), all_binary)


def _input(req: pb.ModelInferRequest, item: object, i: int, binary: bytes, offset: int) -> tuple[bytes, int]:
    """One input tensor added to `req`; its raw bytes and the next binary offset."""
    doc = _object(item, f"inputs[{i}]")
    name = doc.get("name")
    if not isinstance(name, str) or not name:
        raise BadTensor(f"inputs[{i}].name must be a non-empty string")
    what = f"input {name!r}"
    datatype = doc.get("datatype")
    if datatype not in DATATYPES:
        raise BadTensor(f"{what}: datatype must be one of {', '.join(sorted(DATATYPES))} (got {datatype!r})")
    shape = doc.get("shape")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= INT64_MAX for d in shape
    ):
        raise BadTensor(f"{what}: shape must be a list of non-negative integers (got {shape!r})")
    count = math.prod(shape)
    params = _object(doc.get("parameters"), f"{what} parameters")
    tensor = req.inputs.add(name=name, datatype=datatype, shape=shape)
    _set_parameters(tensor.parameters, params, f"{what} parameters")
    size = params.get(BINARY_DATA_SIZE)
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BadTensor(f"{what}: {BINARY_DATA_SIZE} must be a non-negative integer")
        if "data" in doc:
            raise BadTensor(f"{what} has both 'data' and {BINARY_DATA_SIZE}: send one")
        if offset + size > len(binary):
            raise BadTensor(f"{what}: {BINARY_DATA_SIZE} {size} runs past the binary data ({len(binary)} bytes)")
        raw = binary[offset : offset + size]
        found = raw_count(datatype, raw, what)
        if found != count:
            raise BadTensor(f"{what}: shape {shape} needs {count} elements, the binary data holds {found}")
        return raw, offset + size
    if "data" not in doc:
        raise BadTensor(f"{what} has no 'data' (nor parameters.{BINARY_DATA_SIZE})")
    values = flatten(doc["data"])
    if len(values) != count:
        raise BadTensor(f"{what}: shape {shape} needs {count} elements, 'data' holds {len(values)}")
    return encode(datatype, values, what), offset


def flatten(data: object) -> list[Any]:
    """Row-major elements of flat or nested lists (a lone value is one element)."""
    if not isinstance(data, list):
        return [data]
    out: list[Any] = []
    stack: list[Iterable[Any]] = [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            out.append(value)
        else:
            stack.pop()
    return out


def encode(datatype: str, values: list[Any], what: str) -> bytes:
    """Raw little-endian bytes of JSON elements (BYTES: length-prefixed UTF-8 strings)."""
    if datatype == "BYTES":
        for v in values:
            if not isinstance(v, str):
                raise BadTensor(f"{what}: BYTES elements must be strings (got {type(v).__name__})")
        return tensor_bytes.join_bytes([v.encode("utf-8") for v in values])
    if datatype == "BOOL":
        if not all(isinstance(v, bool) for v in values):
            raise BadTensor(f"{what}: BOOL elements must be true or false")
    elif any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        raise BadTensor(f"{what}: {datatype} elements must be numbers")
    try:
        if datatype == "BF16":
            return b"".join(struct.pack("<f", v)[2:] for v in values)  # the float32's upper half
        return struct.pack(f"<{len(values)}{FIXED[datatype]}", *values)
    except (struct.error, OverflowError) as e:
        raise BadTensor(f"{what}: a value does not fit {datatype} ({e})") from None


def raw_count(datatype: str, raw: bytes, what: str) -> int:
    """Elements in raw tensor bytes; BadTensor when the bytes cannot be that datatype."""
    if datatype == "BYTES":
        return len(split_bytes(raw, what))
    size = 2 if datatype == "BF16" else struct.calcsize(FIXED[datatype])
    if len(raw) % size:
        raise BadTensor(f"{what}: {len(raw)} bytes are not a whole number of {datatype} elements")
    return len(raw) // size


def split_bytes(raw: bytes, what: str) -> list[bytes]:
    """BYTES elements of raw tensor bytes (each a 4-byte little-endian length and its bytes)."""
    try:
        return tensor_bytes.split_bytes(raw)
    except ValueError as e:
        raise BadTensor(f"{what}: {e}") from None


def decode(datatype: str, raw: bytes, what: str) -> list[Any]:
    """JSON elements of raw tensor bytes."""
    if datatype == "BYTES":
        try:
            return [b.decode("utf-8") for b in split_bytes(raw, what)]
        except UnicodeDecodeError:
            raise BadTensor(
                f"{what} holds bytes that are not UTF-8 text: ask for it as binary data "
                f'(outputs: [{{"name": ..., "parameters": {{"{BINARY_DATA}": true}}}}])'
            ) from None
    n = raw_count(datatype, raw, what)
    if datatype == "BF16":
        return [struct.unpack("<f", b"\0\0" + raw[2 * i : 2 * i + 2])[0] for i in range(n)]
    return list(struct.unpack(f"<{n}{FIXED[datatype]}", raw))


# ---- parameters ------------------------------------------------------------------------------
def _object(value: object, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadTensor(f"{what} must be a JSON object")
    return value


def _set_parameters(target: Any, params: Mapping[str, Any], what: str) -> None:
    """JSON parameters into an InferParameter map, leaving out the HTTP-only ones."""
    for key, value in params.items():
        if key in HTTP_ONLY:
            continue
        p = target[key]
        if isinstance(value, bool):
            p.bool_param = value
        elif isinstance(value, int):
            if not -(1 << 63) <= value <= INT64_MAX:
                raise BadTensor(f"{what}.{key} is out of the int64 range")
            p.int64_param = value
        elif isinstance(value, float):
            p.double_param = value
        elif isinstance(value, str):
            p.string_param = value
        else:
            raise BadTensor(f"{what}.{key} must be a boolean, number or string")


def parameters_json(params: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, p in params.items():
        which = p.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(p, which)
    return out


# ---- response --------------------------------------------------------------------------------
def render_infer_response(resp: pb.ModelInferResponse, choice: OutputChoice) -> tuple[bytes, int | None]:
    """The HTTP body of a ModelInferResponse, and the JSON header's length when binary
    outputs follow it (None: the body is all JSON)."""
    doc: dict[str, Any] = {"model_name": resp.model_name}
    if resp.model_version:
        doc["model_version"] = resp.model_version
    if resp.id:
        doc["id"] = resp.id
    if resp.parameters:
        doc["parameters"] = parameters_json(resp.parameters)
    raws = resp.raw_output_contents
    if raws and len(raws) != len(resp.outputs):
        raise ValueError(f"the runtime answered {len(resp.outputs)} outputs with {len(raws)} raw_output_contents")
    outputs = []
    chunks: list[bytes] = []
    for i, tensor in enumerate(resp.outputs):
        what = f"output {tensor.name!r}"
        out: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        params = parameters_json(tensor.parameters)
        if raws:
            raw = raws[i]
            if choice.wants_binary(tensor.name):
                chunks.append(raw)
                params[BINARY_DATA_SIZE] = len(raw)
            else:
                out["data"] = decode(tensor.datatype, raw, what)
        else:
            values = _contents(tensor, what)
            if choice.wants_binary(tensor.name):
                raw = encode(tensor.datatype, values, what) if tensor.datatype != "BYTES" else _pack_bytes(values)
                chunks.append(raw)
                params[BINARY_DATA_SIZE] = len(raw)
            else:
                out["data"] = values if tensor.datatype != "BYTES" else _texts(values, what)
        if params:
            out["parameters"] = params
        outputs.append(out)
    doc["outputs"] = outputs
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not chunks:
        return header, None
    return header + b"".join(chunks), len(header)


def _contents(tensor: pb.ModelInferResponse.InferOutputTensor, what: str) -> list[Any]:
    field = CONTENTS_FIELD.get(tensor.datatype)
    if field is None:
        raise ValueError(f"{what}: datatype {tensor.datatype!r} has no typed contents and no raw_output_contents")
    return list(getattr(tensor.contents, field))


def _pack_bytes(values: list[bytes]) -> bytes:
    return tensor_bytes.join_bytes(list(values))


def _texts(values: list[bytes], what: str) -> list[str]:
    return decode("BYTES", _pack_bytes(values), what)


def render_metadata_response(resp: pb.ModelMetadataResponse) -> dict[str, Any]:
    """A runtime's ModelMetadataResponse as KServe V2 REST's model metadata object."""

    def tensors(items: Iterable[pb.ModelMetadataResponse.TensorMetadata]) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype, "shape": [int(d) for d in t.shape]} for t in items]

    return {
        "name": resp.name,
        "versions": list(resp.versions),
        "platform": resp.platform,
        "inputs": tensors(resp.inputs),
        "outputs": tensors(resp.outputs),
    }
