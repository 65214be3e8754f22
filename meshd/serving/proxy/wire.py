"""Read or write a model id at a field path in a serialized protobuf request, without parsing it.

meshd forwards inference requests as raw bytes. A runtime may declare an `idInjectionPath`
for a method (field numbers: embedded messages, then a string field) where the concrete
model id must be written; "id extraction" reads a string at such a path to learn which model
a request is for (KServe V2 `ModelInferRequest.model_name` is path `[1]`). Both walk only the
top-level message and the messages on the path, skipping every other field by its length,
so a 1 MiB tensor payload costs a few tag reads. `inject_id` copies every byte it does not
have to change, fixes the length prefixes of the enclosing messages, and returns the input
object itself when the id is already there (the usual KServe case).

The results match what protobuf parsing gives: a singular embedded message that occurs
several times is merged, and the last occurrence of a string field wins. Malformed input
raises `InvalidArgument`, never anything else.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshd.core.errors import InvalidArgument

__all__ = ["MAX_FIELD_NUMBER", "check_path", "extract_id", "inject_id"]

MAX_FIELD_NUMBER = (1 << 29) - 1
MAX_GROUP_DEPTH = 100  # upb's default recursion limit; bounds the group stack, not the call stack

_LEN = 2
_SMALL_VARINTS = tuple(bytes((n,)) for n in range(0x80))

# (length prefix offset, value start, value end) of one length-delimited field occurrence.
_Occurrence = tuple[int, int, int]
# Replace data[start:end] with the bytes.
_Edit = tuple[int, int, bytes]


def _bad(what: str) -> InvalidArgument:
    return InvalidArgument(f"request body is not valid protobuf: {what}")


def check_path(path: Sequence[int]) -> tuple[int, ...]:
    """The path as a tuple, or ValueError: non-empty, every element an int in 1..2**29-1."""
    try:
        fields = tuple(path)
    except TypeError:
        raise ValueError(f"id path must be a sequence of field numbers, not {path!r}") from None
    if not fields:
        raise ValueError("id path is empty")
    for f in fields:
        # bool is an int subclass, but True as a field number is surely a config mistake.
        if not isinstance(f, int) or isinstance(f, bool) or not 1 <= f <= MAX_FIELD_NUMBER:
            raise ValueError(f"id path {list(fields)!r}: {f!r} is not a field number (1..{MAX_FIELD_NUMBER})")
    return fields


def _varint_bytes(n: int) -> bytes:
    if n < 0x80:
        return _SMALL_VARINTS[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value, position after it); the caller inlines the one-byte case."""
    start = pos
    result = 0
    shift = 0
    while pos < end:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift == 70:
            raise _bad(f"varint longer than 10 bytes at byte {start}")
    raise _bad(f"truncated varint at byte {start}")


def _read_tag(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """A multi-byte tag, checked for a field number in range."""
    tag, after = _read_varint(buf, pos, end)
    if tag >> 3 > MAX_FIELD_NUMBER:  # a tag is a uint32
        raise _bad(f"field number {tag >> 3} out of range at byte {pos}")
    return tag, after


def _skip(buf: bytes, pos: int, end: int, tag: int, tag_at: int) -> int:
    """Skip the value of a field that is not length-delimited; the position after it."""
    wire = tag & 7
    if wire == 0:
        if pos < end and buf[pos] < 0x80:
            return pos + 1
        return _read_varint(buf, pos, end)[1]
    if wire == 1:
        pos += 8
    elif wire == 5:
        pos += 4
    elif wire == 3:
        return _skip_group(buf, pos, end, tag >> 3, tag_at)
    elif wire == 4:
        raise _bad(f"end-group for field {tag >> 3} at byte {tag_at} without a start-group")
    else:
        raise _bad(f"invalid wire type {wire} at byte {tag_at}")
    if pos > end:
        raise _bad(f"truncated fixed-width field at byte {tag_at}")
    return pos


def _skip_group(buf: bytes, pos: int, end: int, field: int, at: int) -> int:
    """Skip a group's contents and its end-group tag, iteratively: nesting costs no stack."""
    open_groups = [field]
    while pos < end:
        tag_at = pos
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _read_tag(buf, pos, end)
        if tag < 8:
            raise _bad(f"field number 0 at byte {tag_at}")
        wire = tag & 7
        if wire == _LEN:
            n, pos = _read_varint(buf, pos, end)
            pos += n
            if pos > end:
                raise _bad(f"length-delimited field at byte {tag_at} runs past the end of its message")
        elif wire == 3:
            open_groups.append(tag >> 3)
            if len(open_groups) > MAX_GROUP_DEPTH:
                raise _bad(f"groups nested deeper than {MAX_GROUP_DEPTH} at byte {tag_at}")
        elif wire == 4:
            if tag >> 3 != open_groups[-1]:
                raise _bad(
                    f"end-group for field {tag >> 3} at byte {tag_at} inside a group for field {open_groups[-1]}"
                )
            open_groups.pop()
            if not open_groups:
                return pos
        else:
            pos = _skip(buf, pos, end, tag, tag_at)
    raise _bad(f"start-group for field {field} at byte {at} is never closed")


def _scan(buf: bytes, pos: int, end: int, field: int) -> list[_Occurrence]:
    """Every occurrence of `field` in the message buf[pos:end], in order.

    The whole message is checked on the way (its other fields are skipped, never parsed);
    `field` in any wire type but length-delimited is an error, since it cannot hold a
    string or an embedded message.
    """
    found: list[_Occurrence] = []
    wanted = field << 3 | _LEN
    # `pos` stays on the tag until the field is done: error messages point at it.
    while pos < end:
        tag = buf[pos]
        if tag < 0x80:
            at = pos + 1
        else:
            tag, at = _read_tag(buf, pos, end)
        if tag & 7 == _LEN and tag > 7:
            if at < end and buf[at] < 0x80:
                start = at + 1
                stop = start + buf[at]
            else:
                n, start = _read_varint(buf, at, end)
                stop = start + n
            if stop > end:
                raise _bad(f"length-delimited field at byte {pos} runs past the end of its message")
            if tag == wanted:
                found.append((at, start, stop))
            pos = stop
        elif tag < 8:
            raise _bad(f"field number 0 at byte {pos}")
        elif tag >> 3 == field:
            raise _bad(f"field {field} at byte {pos} has wire type {tag & 7}, not length-delimited")
        else:
            pos = _skip(buf, at, end, tag, pos)
    return found


def _assemble(data: bytes, chain: list[_Occurrence], edits: list[_Edit]) -> bytes:
    """`data` with `edits` (ordered, all inside the innermost message of `chain`) applied and
    the length prefixes along `chain` (outermost first) re-encoded where the length changed."""
    delta = 0
    for start, end, new in edits:
        delta += len(new) - (end - start)
    prefixes: list[_Edit] = []
    for len_at, start, end in reversed(chain):
        if delta == 0:
            # Lengths unchanged from here outwards: their prefixes are copied as they are.
            break
        prefix = _varint_bytes(end - start + delta)
        delta += len(prefix) - (start - len_at)
        prefixes.append((len_at, start, prefix))
    prefixes.reverse()
    # Slices of a memoryview: the big untouched runs are copied once, by join.
    view = memoryview(data)
    parts: list[bytes | memoryview] = []
    pos = 0
    for start, end, new in prefixes + edits:
        if start > pos:
            parts.append(view[pos:start])
        parts.append(new)
        pos = end
    if pos < len(data):
        parts.append(view[pos:])
    return b"".join(parts)


def inject_id(data: bytes, path: Sequence[int], value: str) -> bytes:
    """`data` with `value` as the string at `path`, as protobuf parsing of the result sees it.

    Intermediate fields: the last occurrence is written into (protobuf merges them all, so
    a string set there wins); an absent one is appended to its enclosing message. The final
    field: every occurrence in that message is overwritten in place, or one is appended.
    Returns `data` itself when every occurrence there already holds `value`.
    Raises ValueError for a bad path, InvalidArgument for malformed `data`, a path field
    that is not length-delimited, or a `value` that cannot be encoded as UTF-8.
    """
    fields = check_path(path)
    try:
        encoded = value.encode()
    except UnicodeEncodeError:
        raise InvalidArgument(f"model id {value!r} cannot be encoded as UTF-8") from None
    start = 0
    end = len(data)
    chain: list[_Occurrence] = []
    last = len(fields) - 1
    for depth in range(last):
        found = _scan(data, start, end, fields[depth])
        if not found:
            # Build the missing messages inside out and append them to the enclosing one.
            body = _varint_bytes(fields[last] << 3 | _LEN) + _varint_bytes(len(encoded)) + encoded
            for f in reversed(fields[depth:last]):
                body = _varint_bytes(f << 3 | _LEN) + _varint_bytes(len(body)) + body
            return _assemble(data, chain, [(end, end, body)])
        occurrence = found[-1]
        chain.append(occurrence)
        start, end = occurrence[1], occurrence[2]
    found = _scan(data, start, end, fields[last])
    if found:
        n = len(encoded)
        for _, s, e in found:
            if e - s != n or data[s:e] != encoded:
                break
        else:
            return data
        replacement = _varint_bytes(n) + encoded
        return _assemble(data, chain, [(len_at, e, replacement) for len_at, _, e in found])
    tail = _varint_bytes(fields[last] << 3 | _LEN) + _varint_bytes(len(encoded)) + encoded
    return _assemble(data, chain, [(end, end, tail)])


def extract_id(data: bytes, path: Sequence[int]) -> str | None:
    """The string protobuf parsing would give at `path`, or None when it is absent there.

    Every occurrence of each intermediate message counts (they are merged), and the last
    occurrence of the final field wins; an explicit empty string is returned as "".
    Raises ValueError for a bad path, InvalidArgument for malformed `data`, a path field
    that is not length-delimited, or a value that is not UTF-8.
    """
    fields = check_path(path)
    ranges = [(0, len(data))]
    for f in fields[:-1]:
        inner = [(s, e) for start, end in ranges for _, s, e in _scan(data, start, end, f)]
        if not inner:
            return None
        ranges = inner
    value: _Occurrence | None = None
    for start, end in ranges:
        found = _scan(data, start, end, fields[-1])
        if found:
            value = found[-1]
    if value is None:
        return None
    try:
        return str(data[value[1] : value[2]], "utf-8")
    except UnicodeDecodeError:
        raise _bad(f"the string at field path {list(fields)} (byte {value[1]}) is not valid UTF-8") from None
