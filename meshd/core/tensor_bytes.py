"""KServe V2's raw BYTES layout (pure): each element a 4-byte little-endian length, then its
bytes. Shared by the HTTP port's tensor decoding and the LLM runtime's `text_input`."""

from __future__ import annotations

import struct


def split_bytes(raw: bytes) -> list[bytes]:
    """The elements of raw BYTES contents; ValueError saying where the data is cut short."""
    out: list[bytes] = []
    at = 0
    while at < len(raw):
        if at + 4 > len(raw):
            raise ValueError("BYTES data ends inside an element's length")
        (n,) = struct.unpack_from("<I", raw, at)
        at += 4
        if at + n > len(raw):
            raise ValueError(f"a BYTES element of {n} bytes runs past the data")
        out.append(raw[at : at + n])
        at += n
    return out


def join_bytes(elements: list[bytes]) -> bytes:
    """Raw BYTES contents of `elements`."""
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)
