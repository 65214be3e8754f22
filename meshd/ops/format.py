"""Text layout for the operator CLI (pure): aligned tables, key/value blocks, sizes, ages."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

NONE = "-"  # what an unknown or empty value prints as

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart; the last column is not padded."""
    widths = [len(h) for h in headers]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells, the table {len(headers)} columns")
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = []
    for cells in (headers, *rows):
        padded = [cell.ljust(w) for cell, w in zip(cells[:-1], widths, strict=False)]
        lines.append("  ".join([*padded, cells[-1]]).rstrip())
    return "\n".join(lines)


def block(pairs: Sequence[tuple[str, str]]) -> str:
    """`key:  value` lines with the values aligned."""
    width = max((len(k) for k, _ in pairs), default=0) + 1
    return "\n".join(f"{(k + ':').ljust(width)}  {v}".rstrip() for k, v in pairs)


def indent(text: str, by: str = "  ") -> str:
    return "\n".join(by + line if line else line for line in text.splitlines())


def size(nbytes: int | None) -> str:
    """`1.5 MiB`; bytes below 1 KiB as they are; None (unknown) as `-`."""
    if nbytes is None:
        return NONE
    value = float(nbytes)
    for unit in _UNITS:
        if value < 1024 or unit == _UNITS[-1]:
            return f"{nbytes} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def duration(ms: int) -> str:
    """A short, coarse duration: `850ms`, `12s`, `5m`, `3h`, `2d`."""
    ms = max(ms, 0)
    if ms < 1000:
        return f"{ms}ms"
    s = ms // 1000
    for limit, div, unit in ((60, 1, "s"), (3600, 60, "m"), (86400, 3600, "h")):
        if s < limit:
            return f"{s // div}{unit}"
    return f"{s // 86400}d"


def ago(ms: int, now_ms: int) -> str:
    """`12s ago`, or `in 3h` for a time in the future (0, i.e. never or unknown, as `-`)."""
    if ms <= 0:
        return NONE
    return f"in {duration(ms - now_ms)}" if ms > now_ms else f"{duration(now_ms - ms)} ago"


def last_used(ms: int, now_ms: int) -> str:
    """A model's last use: `12s ago`, or `never` (0: not used since it was registered)."""
    return "never" if ms <= 0 else ago(ms, now_ms)


def timestamp(ms: int, now_ms: int) -> str:
    """UTC time and how long ago: `2025-01-02 03:04:05Z (12s ago)`. A time no calendar date
    holds (a client may store up to 2^64-1 ms) is shown as its milliseconds."""
    if ms <= 0:
        return NONE
    try:
        when = dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    except (OverflowError, OSError, ValueError):
        when = f"{ms} ms since the epoch"
    return f"{when} ({ago(ms, now_ms)})"


def percent(part: int, whole: int) -> str:
    return NONE if whole <= 0 else f"{100 * part / whole:.0f}%"


UPSTREAM_VERSION_FLOOR = 1_000_000_000_000  # epoch ms of 2001: no dotted version reaches it


def version(numeric: int) -> str:
    """10203 -> `1.2.3` (how instance records carry meshd's version); upstream's form, a date's
    epoch milliseconds plus a build number, -> `YYYYMMDD-HHMM-N`."""
    if numeric <= 0:
        return NONE
    if numeric >= UPSTREAM_VERSION_FLOOR:
        build = numeric % 60_000
        try:
            when = dt.datetime.fromtimestamp((numeric - build) / 1000, tz=dt.UTC)
        except (OverflowError, ValueError, OSError):
            return str(numeric)
        return f"{when:%Y%m%d-%H%M}-{build}"
    return f"{numeric // 10_000}.{numeric // 100 % 100}.{numeric % 100}"
