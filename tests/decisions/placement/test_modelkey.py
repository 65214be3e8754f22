"""meshd's per-model policy inside ModelInfo.key."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshd.decisions.placement.modelkey import at_max_copies, policy_from_key
from meshd.decisions.placement.scaling import DEFAULT_POLICY, ModelPolicy


def key(**obj: Any) -> str:
    return json.dumps(obj)


def test_full_example() -> None:
    k = key(
        model_type={"name": "sklearn"},
        disk_size_bytes=10,
        meshd={"min_copies": 2, "max_copies": 3, "size_bytes": 123456},
    )
    assert policy_from_key(k) == ModelPolicy(2, 3, 123456, 10)
    assert policy_from_key(k).size_hint_bytes == 123456  # meshd.size_bytes wins


@pytest.mark.parametrize("k", ["", "opaque-key", "12", "[1,2]", '"str"', "{broken", "null", "{" * 10_000])
def test_keys_that_are_not_json_objects_give_defaults(k: str) -> None:
    assert policy_from_key(k) == DEFAULT_POLICY


def test_keys_without_meshd_give_defaults_with_disk_size_hint() -> None:
    assert policy_from_key(key(storage_key="s3")) == DEFAULT_POLICY
    p = policy_from_key(key(disk_size_bytes=4096, model_type={"name": "onnx"}))
    assert p == ModelPolicy(disk_size_bytes=4096)
    assert p.size_hint_bytes == 4096


@pytest.mark.parametrize("disk", [-1, 0, "10", 1.5, True, None, [1]])
def test_unusable_disk_size_is_ignored(disk: Any) -> None:
    assert policy_from_key(key(disk_size_bytes=disk)) == DEFAULT_POLICY
    assert policy_from_key(key(disk_size_bytes=disk, meshd={"min_copies": 2})) == ModelPolicy(min_copies=2)


def test_partial_meshd_objects_keep_defaults_for_the_rest() -> None:
    assert policy_from_key(key(meshd={})) == DEFAULT_POLICY
    assert policy_from_key(key(meshd={"max_copies": 4})) == ModelPolicy(max_copies=4)
    assert policy_from_key(key(meshd={"min_copies": 0})) == ModelPolicy(min_copies=0)
    assert policy_from_key(key(meshd={"size_bytes": None})) == DEFAULT_POLICY
    assert policy_from_key(key(meshd={"min_copies": 5, "max_copies": 0})) == ModelPolicy(min_copies=5)


def test_other_keys_are_left_alone() -> None:
    k = key(meshd={"min_copies": 2}, anything={"deep": [1, 2, {"x": None}]}, min_copies=-5)
    assert policy_from_key(k) == ModelPolicy(min_copies=2)


@pytest.mark.parametrize(
    ("meshd", "message"),
    [
        ([1], "must be an object"),
        ("x", "must be an object"),
        (None, "must be an object"),
        ({"min_copies": -1}, "min_copies must be >= 0"),
        ({"max_copies": -1}, "max_copies must be >= 0"),
        ({"min_copies": 3, "max_copies": 2}, r"min_copies \(3\) exceeds max_copies \(2\)"),
        ({"size_bytes": 0}, "size_bytes must be > 0"),
        ({"size_bytes": -10}, "size_bytes must be > 0"),
        ({"min_copies": "2"}, "min_copies must be a whole number"),
        ({"min_copies": 2.0}, "min_copies must be a whole number"),
        ({"max_copies": True}, "max_copies must be a whole number"),
        ({"size_bytes": "1Gi"}, "size_bytes must be a whole number"),
        ({"min_copy": 2}, "unknown field"),
    ],
)
def test_invalid_meshd_policy_is_a_clear_value_error(meshd: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        policy_from_key(key(meshd=meshd))


@given(st.text(max_size=300))
def test_any_text_gives_a_policy_or_a_value_error(text: str) -> None:
    try:
        p = policy_from_key(text)
    except ValueError:
        assert '"meshd"' in text or "meshd" in text
        return
    assert p.min_copies >= 0 and p.max_copies >= 0


@given(
    st.fixed_dictionaries(
        {},
        optional={
            "min_copies": st.integers(-3, 10),
            "max_copies": st.integers(-3, 10),
            "size_bytes": st.integers(-3, 1 << 40),
        },
    )
)
def test_valid_iff_policy_constructs(meshd: dict[str, int]) -> None:
    try:
        expected: ModelPolicy | None = ModelPolicy(
            meshd.get("min_copies", 1), meshd.get("max_copies", 0), meshd.get("size_bytes")
        )
    except ValueError:
        expected = None
    if expected is None:
        with pytest.raises(ValueError):
            policy_from_key(key(meshd=meshd))
    else:
        assert policy_from_key(key(meshd=meshd)) == expected


def test_at_max_copies_only_for_a_cap_that_the_holders_reach() -> None:
    capped = '{"meshd": {"max_copies": 2}}'
    assert at_max_copies(capped, 2) and at_max_copies(capped, 3) and not at_max_copies(capped, 1)
    assert not at_max_copies("", 5) and not at_max_copies('{"meshd": {"min_copies": 2}}', 5)
    assert not at_max_copies('{"meshd": {"max_copies": -1}}', 5)  # refused at registration; caps nothing
