"""Model selection and header forwarding rules (SPEC §3)."""

from __future__ import annotations

import pytest

from meshd.core.errors import InvalidArgument
from meshd.serving.proxy.headers import parse_request_headers, runtime_metadata


def test_model_id_and_forwarded_headers() -> None:
    ids, fwd = parse_request_headers(
        [
            ("mm-model-id", "m1"),
            ("user-agent", "grpc-python"),
            ("x-trace", "abc"),
            ("grpc-accept-encoding", "gzip"),
            ("meshd-internal", "forged"),
            ("mm-balanced", "true"),
            ("auth-bin", b"\x00\x01"),
        ]
    )
    assert (ids.model_id, ids.vmodel_id, ids.balanced) == ("m1", None, True)
    assert fwd == (("x-trace", "abc"), ("auth-bin", b"\x00\x01"))


def test_bin_header_is_utf8() -> None:
    ids, _ = parse_request_headers([("mm-model-id-bin", "modèle".encode())])
    assert ids.model_id == "modèle"
    ids, _ = parse_request_headers([("mm-vmodel-id-bin", b"v1")])
    assert (ids.model_id, ids.vmodel_id) == (None, "v1")


def test_both_forms_of_the_same_id_agree() -> None:
    ids, _ = parse_request_headers([("mm-model-id", "m1"), ("mm-model-id-bin", b"m1")])
    assert ids.model_id == "m1"


@pytest.mark.parametrize(
    "metadata",
    [
        [],
        [("x-other", "1")],
        [("mm-model-id", "m1"), ("mm-vmodel-id", "v1")],
        [("mm-model-id", "m1"), ("mm-model-id", "m2")],
        [("mm-model-id", "m1"), ("mm-model-id-bin", b"m2")],
        [("mm-model-id-bin", b"\xff\xfe")],
        [("mm-model-id", "")],
        [("mm-model-id-bin", b"a\x00b")],
        [("mm-model-id", "x" * 2000)],
    ],
)
def test_bad_selections_are_invalid_argument(metadata: list[tuple[str, str | bytes]]) -> None:
    with pytest.raises(InvalidArgument) as e:
        parse_request_headers(metadata)
    assert e.value.message


def test_runtime_metadata_carries_the_concrete_id() -> None:
    assert runtime_metadata((("x", "1"),), "m1") == (("x", "1"), ("mm-model-id-bin", b"m1"), ("mm-model-id", "m1"))
    # Non-ASCII ids travel only in the -bin header.
    assert runtime_metadata((), "modèle") == (("mm-model-id-bin", "modèle".encode()),)


def test_ids_from_the_body_win_and_headers_are_the_fallback() -> None:
    from meshd.serving.proxy.headers import RequestIds, ids_from_body

    none, _ = parse_request_headers([], required=False)
    assert none == RequestIds(None, None)
    headers, _ = parse_request_headers([("mm-model-id", "h"), ("mm-balanced", "true")], required=False)
    assert ids_from_body("b", False, headers) == RequestIds("b", None, True)
    assert ids_from_body("v", True, headers) == RequestIds(None, "v", True)
    assert ids_from_body(None, False, headers) is headers
    assert ids_from_body("", False, headers) is headers
    with pytest.raises(InvalidArgument, match="no model named"):
        ids_from_body(None, False, none)
    with pytest.raises(InvalidArgument, match="control"):
        ids_from_body("bad\nid", False, none)
