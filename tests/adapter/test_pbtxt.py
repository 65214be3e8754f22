"""The config.pbtxt scanner: only top-level fields are found and edited."""

from __future__ import annotations

import pytest

from meshd.adapter import pbtxt

NESTED = 'platform: "onnxruntime_onnx"\ninput [\n{\nname: "x"\ndata_type: TYPE_FP32\ndims: [ 4 ]\n}\n]\n'


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ('name: "old"\nbackend: "python"\n', 'name: "new"\nbackend: "python"\n'),
        ('name: "old"  # exported name\nbackend: "python"\n', 'name: "new"  # exported name\nbackend: "python"\n'),
        ("name:'old'\nbackend: 'python'\n", "name:\"new\"\nbackend: 'python'\n"),
        ('name : "o\\"l#d" # c\n', 'name : "new" # c\n'),
        ('name: "old" platform: "onnxruntime_onnx"', 'name: "new" platform: "onnxruntime_onnx"'),
        ('backend: "python" name: "old", max_batch_size: 0', 'backend: "python" name: "new", max_batch_size: 0'),
        ('# name: "comment"\nbackend: "python"\n', 'name: "new"\n# name: "comment"\nbackend: "python"\n'),
        (NESTED, 'name: "new"\n' + NESTED),  # the input's name is not the model's
        ('input { name: "x" }\nname: "old"\n', 'input { name: "x" }\nname: "new"\n'),
        (
            'parameters < key: "name" value: { string_value: "]" } >\n',
            'name: "new"\nparameters < key: "name" value: { string_value: "]" } >\n',
        ),
    ],
)
def test_only_the_top_level_name_is_set(config: str, expected: str) -> None:
    assert pbtxt.set_field(config, "name", pbtxt.quote("new")) == expected


def test_fields_scalars_and_removal() -> None:
    text = 'max_batch_size: 8\ninput [ { name: "a" dims: [ -1 ] } ]\ninput { name: "b" }\noutput [ ]\n'
    assert [f.name for f in pbtxt.top_level_fields(text)] == ["max_batch_size", "input", "input", "output"]
    assert pbtxt.scalar(text, "max_batch_size") == "8" and pbtxt.scalar(text, "name") is None
    assert pbtxt.remove_fields(text, frozenset({"input"})) == "max_batch_size: 8\n\n\noutput [ ]\n"


@pytest.mark.parametrize("bad", ['name: "open', "input [ { name: 'x' ]", "input { ", 'name: "a\nb"', ": 3"])
def test_text_it_cannot_follow_is_refused(bad: str) -> None:
    with pytest.raises(pbtxt.PbtxtError):
        pbtxt.set_field(bad, "name", '"x"')
