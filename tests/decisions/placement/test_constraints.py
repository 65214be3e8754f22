"""MM_TYPE_CONSTRAINTS parsing and per-type lookup; MM_LABELS parsing."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshd.decisions.placement.constraints import NO_CONSTRAINTS, TypeConstraints, parse_labels

EXAMPLE = json.dumps(
    {
        "tensorflow": {"required": ["mt:tensorflow"], "preferred": ["gpu"]},
        "sklearn": {"required": ["mt:sklearn", "rt:mlserver"]},
        "_default": {"preferred": ["cpu"]},
    }
)


def test_type_entry_and_default() -> None:
    tc = TypeConstraints.parse(EXAMPLE)
    assert tc.for_type("tensorflow") == (frozenset({"mt:tensorflow"}), frozenset({"gpu"}))
    assert tc.for_type("sklearn") == (frozenset({"mt:sklearn", "rt:mlserver"}), frozenset())
    assert tc.for_type("onnx") == (frozenset(), frozenset({"cpu"}))  # falls back to _default


def test_type_entry_replaces_default_rather_than_merging() -> None:
    tc = TypeConstraints.parse('{"a": {}, "_default": {"required": ["x"]}}')
    assert tc.for_type("a") == (frozenset(), frozenset())
    assert tc.for_type("b") == (frozenset({"x"}), frozenset())


def test_no_default_means_unconstrained() -> None:
    tc = TypeConstraints.parse('{"a": {"required": ["x"]}}')
    assert tc.for_type("b") == (frozenset(), frozenset())
    assert NO_CONSTRAINTS.for_type("a") == (frozenset(), frozenset())
    assert TypeConstraints.parse("{}").for_type("a") == (frozenset(), frozenset())


def test_normalised_like_upstream() -> None:
    tc = TypeConstraints.parse('{"a": {"required": ["x", "x", " y "], "preferred": ["x", "z"]}}')
    assert tc.for_type("a") == (frozenset({"x", "y"}), frozenset({"z"}))  # required wins over preferred


def test_nulls_and_unknown_keys_are_tolerated() -> None:
    tc = TypeConstraints.parse('{"a": {"required": null, "preferred": ["p"], "comment": "ignored"}}')
    assert tc.for_type("a") == (frozenset(), frozenset({"p"}))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ("", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('"x"', "must be a JSON object"),
        ('{"a": ["x"]}', "type constraints for 'a' must be an object"),
        ('{"a": {"required": "x"}}', "'required' must be a list"),
        ('{"a": {"preferred": {"x": 1}}}', "'preferred' must be a list"),
        ('{"a": {"required": ["x", 3]}}', "'required'[1] must be a string"),
        ('{"a": {"required": [""]}}', "empty label"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
    ],
)
def test_bad_config_is_a_clear_value_error(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        TypeConstraints.parse(text)


def test_labels_env_parsing() -> None:
    assert parse_labels("mt:sklearn, rt:mlserver ,,gpu") == frozenset({"mt:sklearn", "rt:mlserver", "gpu"})
    assert parse_labels("") == frozenset()
    assert parse_labels(" , ") == frozenset()


@given(st.text(max_size=200))
def test_parse_either_succeeds_or_raises_value_error(text: str) -> None:
    try:
        tc = TypeConstraints.parse(text)
    except ValueError:
        return
    required, preferred = tc.for_type("anything")
    assert not required & preferred


def test_no_home_message_is_upstreams_text_the_controller_decodes() -> None:
    from meshd.decisions.placement.constraints import NO_HOME_PREFIX, no_home_message

    running = [frozenset({"mt:sklearn", "rt:mlserver"}), frozenset()]
    assert no_home_message("mt:sklearn", frozenset({"mt:sklearn"}), running) is None
    assert no_home_message("anything", frozenset(), running) is None
    # The three states modelmesh-serving tells apart (controllers/predictor_controller.go):
    unhealthy = no_home_message("mt:onnx", frozenset({"mt:onnx"}), running)
    assert unhealthy == NO_HOME_PREFIX + "mt:onnx: [mt:onnx]"
    assert no_home_message("rt:nope", frozenset({"_no_runtime"}), running) == NO_HOME_PREFIX + "rt:nope: [_no_runtime]"
    assert no_home_message("mt:x", frozenset({"_no_runtime"}), []) == NO_HOME_PREFIX + "mt:x: [_no_runtime]"
    # Several labels: all required; listed sorted, as a Java set prints them.
    two = no_home_message("mt:a|pv:v2", frozenset({"pv:v2", "mt:a"}), [frozenset({"mt:a"})])
    assert two == NO_HOME_PREFIX + "mt:a|pv:v2: [mt:a, pv:v2]"
