"""Just enough of protobuf text format (Triton's config.pbtxt) to edit top-level fields (pure).

Upstream parses the config into Triton's ModelConfig message and writes it back; meshd does
not ship Triton's proto, so it finds the top-level fields with a small scanner instead:
strings in either quote with escapes, `#` comments, and nesting in `{}`, `<>` and `[]` are
understood, so a `name` inside an `input { ... }` block or a comment is never taken for the
model's. Everything else in the text is kept byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

_OPEN = {"{": "}", "<": ">", "[": "]"}
_CLOSE = frozenset(_OPEN.values())
_PUNCT = frozenset("{}<>[]:,;")


class PbtxtError(ValueError):
    """The text is not protobuf text format this scanner can follow."""


@dataclass(frozen=True, slots=True)
class Token:
    text: str
    start: int
    end: int

    @property
    def is_string(self) -> bool:
        return self.text[:1] in ("'", '"')


@dataclass(frozen=True, slots=True)
class Field:
    """A top-level field: `name` at `start`, its value in [value_start, value_end), and the
    whole field with its separator in [start, end)."""

    name: str
    start: int
    value_start: int
    value_end: int
    end: int


def tokens(text: str) -> list[Token]:
    out: list[Token] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif c == "#":
            nl = text.find("\n", i)
            i = n if nl < 0 else nl + 1
        elif c in ("'", '"'):
            j = i + 1
            while j < n and text[j] != c:
                if text[j] == "\n":
                    break
                j += 2 if text[j] == "\\" else 1
            if j >= n or text[j] != c:
                raise PbtxtError(f"unterminated string at line {text.count(chr(10), 0, i) + 1}")
            out.append(Token(text[i : j + 1], i, j + 1))
            i = j + 1
        elif c in _PUNCT:
            out.append(Token(c, i, i + 1))
            i += 1
        else:
            j = i
            while j < n and not text[j].isspace() and text[j] not in _PUNCT and text[j] not in "#'\"":
                j += 1
            out.append(Token(text[i:j], i, j))
            i = j
    return out


def _skip_nested(toks: list[Token], i: int) -> int:
    """Index after the bracket opened at toks[i], matched with its kind."""
    stack = [_OPEN[toks[i].text]]
    i += 1
    while i < len(toks):
        t = toks[i].text
        if not toks[i].is_string:
            if t in _OPEN:
                stack.append(_OPEN[t])
            elif t in _CLOSE:
                if t != stack.pop():
                    raise PbtxtError(f"unbalanced {t!r} at offset {toks[i].start}")
                if not stack:
                    return i + 1
        i += 1
    raise PbtxtError(f"unclosed {toks[-1].text!r}" if toks else "unclosed bracket")


def top_level_fields(text: str) -> list[Field]:
    toks = tokens(text)
    fields: list[Field] = []
    i = 0
    while i < len(toks):
        tok = toks[i]
        if tok.is_string or tok.text in _PUNCT - {"["}:
            raise PbtxtError(f"expected a field name at offset {tok.start}, found {tok.text!r}")
        start = tok.start
        if tok.text == "[":  # an extension's name, [pkg.ext]
            i = _skip_nested(toks, i)
            name = text[start : toks[i - 1].end]
        else:
            name, i = tok.text, i + 1
        if i < len(toks) and toks[i].text == ":" and not toks[i].is_string:
            i += 1
        if i >= len(toks):
            raise PbtxtError(f"field {name!r} has no value")
        value_start = toks[i].start
        if not toks[i].is_string and toks[i].text in _OPEN:
            i = _skip_nested(toks, i)
        elif toks[i].is_string:
            while i < len(toks) and toks[i].is_string:  # adjacent strings concatenate
                i += 1
        elif toks[i].text in _PUNCT:
            raise PbtxtError(f"field {name!r} has no value")
        else:
            i += 1
        value_end = toks[i - 1].end
        end = value_end
        if i < len(toks) and toks[i].text in (",", ";") and not toks[i].is_string:
            end = toks[i].end
            i += 1
        fields.append(Field(name, start, value_start, value_end, end))
    return fields


def quote(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def scalar(text: str, name: str) -> str | None:
    """The first top-level `name` field's value as written (None: no such field)."""
    for f in top_level_fields(text):
        if f.name == name:
            return text[f.value_start : f.value_end]
    return None


def set_field(text: str, name: str, value: str) -> str:
    """`text` with the first top-level `name` field's value replaced by `value` (as written,
    e.g. a quoted string), or the field put first when there is none."""
    for f in top_level_fields(text):
        if f.name == name:
            return text[: f.value_start] + value + text[f.value_end :]
    return f"{name}: {value}\n{text}"


def remove_fields(text: str, names: frozenset[str]) -> str:
    """`text` without its top-level fields of those names (every occurrence)."""
    out, at = [], 0
    for f in top_level_fields(text):
        if f.name in names:
            out.append(text[at : f.start])
            at = f.end
    out.append(text[at:])
    return "".join(out)
