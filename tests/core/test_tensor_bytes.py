"""KServe's raw BYTES layout (pure)."""

from __future__ import annotations

import pytest

from meshd.core.tensor_bytes import join_bytes, split_bytes


def test_raw_bytes_elements_round_trip_and_cut_data_is_refused() -> None:
    elements = [b"", b"a", "é".encode(), b"\x00" * 300]
    assert split_bytes(join_bytes(elements)) == elements
    with pytest.raises(ValueError, match="inside an element's length"):
        split_bytes(b"\x01\x00")
    with pytest.raises(ValueError, match="runs past"):
        split_bytes(b"\x05\x00\x00\x00ab")
