"""A model's schema (the key's `schema_path`) and what it becomes for each server (pure).

The schema is upstream's internal/modelschema format, a subset of KServe V2 model metadata:
`{"inputs": [{"name", "datatype", "shape"}], "outputs": [...]}`. For Triton (upstream's
schema.go) its tensors become config.pbtxt `input` / `output` entries with `TYPE_*` data
types, replacing the config's own; when the config batches (`max_batch_size` > 0) the
schema's explicit batch dimension, which must be -1, is dropped. For MLServer (upstream's
processSchema) they become `inputs` / `outputs` in model-settings.json as they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from meshd.adapter import pbtxt

# The schema file upstream's puller used to put beside the model; skipped as a model file.
SCHEMA_FILE = "_schema.json"

# KServe V2 datatype -> Triton DataType (upstream schema.go's TensorType). BYTES, which
# upstream leaves out (so it became TYPE_INVALID), is Triton's TYPE_STRING.
TRITON_DATATYPES = {
    "BOOL": "TYPE_BOOL",
    "UINT8": "TYPE_UINT8",
    "UINT16": "TYPE_UINT16",
    "UINT32": "TYPE_UINT32",
    "UINT64": "TYPE_UINT64",
    "INT8": "TYPE_INT8",
    "INT16": "TYPE_INT16",
    "INT32": "TYPE_INT32",
    "INT64": "TYPE_INT64",
    "FP16": "TYPE_FP16",
    "FP32": "TYPE_FP32",
    "FP64": "TYPE_FP64",
    "STRING": "TYPE_STRING",
    "BYTES": "TYPE_STRING",
}


class SchemaError(ValueError):
    """The schema cannot be read or applied."""


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Schema:
    inputs: tuple[Tensor, ...] | None  # None: the schema does not say (the model's own stay)
    outputs: tuple[Tensor, ...] | None


def parse(text: str) -> Schema:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise SchemaError(f"not JSON ({e})") from None
    if not isinstance(data, dict):
        raise SchemaError("not a JSON object")
    return Schema(_tensors(data, "inputs"), _tensors(data, "outputs"))


def _tensors(data: dict[str, Any], field: str) -> tuple[Tensor, ...] | None:
    raw = data.get(field)
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise SchemaError(f"{field!r} must be a list")
    out = []
    for i, t in enumerate(raw):
        where = f"{field}[{i}]"
        if not isinstance(t, dict):
            raise SchemaError(f"{where} must be an object")
        name, datatype, shape = t.get("name"), t.get("datatype"), t.get("shape", [])
        if not isinstance(name, str) or not name:
            raise SchemaError(f"{where}.name must be a non-empty string")
        if not isinstance(datatype, str):
            raise SchemaError(f"{where}.datatype must be a string")
        if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) for d in shape):
            raise SchemaError(f"{where}.shape must be a list of whole numbers")
        out.append(Tensor(name, datatype, tuple(shape)))
    return tuple(out)


def mlserver_settings(settings: dict[str, Any], schema: Schema) -> dict[str, Any]:
    """model-settings.json with the schema's tensors as its `inputs` / `outputs`."""
    out = dict(settings)
    for field, tensors in (("inputs", schema.inputs), ("outputs", schema.outputs)):
        if tensors is not None:
            out[field] = [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in tensors]
    return out


def triton_config(config: str, schema: Schema) -> str:
    """config.pbtxt with the schema's tensors in place of its `input` / `output` entries."""
    batched = _max_batch_size(config) > 0
    for field, tensors in (("input", schema.inputs), ("output", schema.outputs)):
        if tensors is None:
            continue
        if batched and any(not t.shape or t.shape[0] != -1 for t in tensors):
            raise SchemaError(
                "the config has max_batch_size > 0, so the first dimension of every schema input "
                "and output must be -1 (the batch)"
            )
        config = pbtxt.remove_fields(config, frozenset({field}))
        if not config.endswith("\n"):
            config += "\n"
        config += _entries(field, tensors, drop_batch=batched)
    return config


def _max_batch_size(config: str) -> int:
    raw = pbtxt.scalar(config, "max_batch_size")
    if raw is None:
        return 0
    try:
        return int(raw, 0)
    except ValueError:
        raise SchemaError(f"max_batch_size {raw!r} is not a whole number") from None


def _entries(field: str, tensors: tuple[Tensor, ...], drop_batch: bool) -> str:
    lines = []
    for t in tensors:
        data_type = TRITON_DATATYPES.get(t.datatype.upper())
        if data_type is None:
            known = ", ".join(sorted(TRITON_DATATYPES))
            raise SchemaError(f"{field} {t.name!r}: datatype {t.datatype!r} is not one of {known}")
        dims = ", ".join(map(str, t.shape[1:] if drop_batch else t.shape))
        lines.append(f"  {{ name: {pbtxt.quote(t.name)} data_type: {data_type} dims: [ {dims} ] }}")
    return f"{field} [\n" + ",\n".join(lines) + "\n]\n"
