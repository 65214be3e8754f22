"""The model schema (`schema_path`) as Triton config entries and MLServer settings."""

from __future__ import annotations

import json

import pytest

from meshd.adapter import schema

SCHEMA = json.dumps(
    {
        "inputs": [{"name": "in0", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "out0", "datatype": "BYTES", "shape": [-1]}],
    }
)


def test_triton_entries_replace_the_configs_own() -> None:
    config = 'backend: "onnxruntime"\ninput [ { name: "x" data_type: TYPE_FP64 dims: [ -1, 4 ] } ]\n'
    out = schema.triton_config(config, schema.parse(SCHEMA))
    assert out == (
        'backend: "onnxruntime"\n\n'
        'input [\n  { name: "in0" data_type: TYPE_FP32 dims: [ -1, 4 ] }\n]\n'
        'output [\n  { name: "out0" data_type: TYPE_STRING dims: [ -1 ] }\n]\n'
    )


def test_a_batching_config_drops_the_schemas_batch_dimension() -> None:
    out = schema.triton_config("max_batch_size: 8\n", schema.parse(SCHEMA))
    assert "dims: [ 4 ]" in out and "dims: [  ]" in out and "-1" not in out
    fixed = json.dumps({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1, 4]}]})
    with pytest.raises(schema.SchemaError, match="must be -1"):
        schema.triton_config("max_batch_size: 8\n", schema.parse(fixed))


def test_only_what_the_schema_names_is_replaced() -> None:
    config = 'input [ { name: "x" } ]\noutput [ { name: "y" } ]\n'
    out = schema.triton_config(config, schema.parse('{"outputs": [{"name": "z", "datatype": "INT64", "shape": [1]}]}'))
    assert 'name: "x"' in out and 'name: "y"' not in out and 'name: "z" data_type: TYPE_INT64' in out


def test_mlserver_settings_take_the_tensors_as_they_are() -> None:
    settings = schema.mlserver_settings({"name": "m", "inputs": [{"name": "old"}]}, schema.parse(SCHEMA))
    assert settings["inputs"] == [{"name": "in0", "datatype": "FP32", "shape": [-1, 4]}]
    assert settings["outputs"] == [{"name": "out0", "datatype": "BYTES", "shape": [-1]}]


@pytest.mark.parametrize(
    "bad",
    [
        "[]",
        "not json",
        '{"inputs": {}}',
        '{"inputs": [{"datatype": "FP32"}]}',
        '{"inputs": [{"name": "a", "datatype": "FP32", "shape": [1.5]}]}',
    ],
)
def test_bad_schemas_are_refused(bad: str) -> None:
    with pytest.raises(schema.SchemaError):
        schema.parse(bad)


def test_unknown_datatypes_are_refused_for_triton() -> None:
    with pytest.raises(schema.SchemaError, match="datatype 'COMPLEX'"):
        schema.triton_config("", schema.parse('{"inputs": [{"name": "a", "datatype": "COMPLEX", "shape": [1]}]}'))
