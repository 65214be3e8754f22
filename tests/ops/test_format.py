"""Text layout of the operator CLI."""

from __future__ import annotations

import pytest

from meshd.decisions.publishing import numeric_version
from meshd.ops.format import ago, block, duration, indent, percent, size, table, timestamp, version


def test_table_aligns_columns_and_leaves_no_trailing_space() -> None:
    out = table(["A", "LONGER", "C"], [["xx", "y", ""], ["x", "yyyyyyy", "zz"]])
    assert out.splitlines() == [
        "A   LONGER   C",
        "xx  y",
        "x   yyyyyyy  zz",
    ]


def test_table_without_rows_is_its_header() -> None:
    assert table(["MODEL", "STATUS"], []) == "MODEL  STATUS"


def test_table_refuses_a_row_of_the_wrong_width() -> None:
    with pytest.raises(ValueError, match="2 cells"):
        table(["A", "B", "C"], [["1", "2"]])


def test_block_aligns_values() -> None:
    assert block([("model", "m1"), ("last used", "-")]) == "model:      m1\nlast used:  -"


def test_indent_leaves_empty_lines_empty() -> None:
    assert indent("a\n\nb") == "  a\n\n  b"


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (None, "-"),
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1 << 20, "1.0 MiB"),
        (3 << 29, "1.5 GiB"),
        (1 << 50, "1024.0 TiB"),
    ],
)
def test_size(nbytes: int | None, text: str) -> None:
    assert size(nbytes) == text


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (-5, "0ms"),
        (850, "850ms"),
        (12_999, "12s"),
        (5 * 60_000, "5m"),
        (3 * 3_600_000 + 1, "3h"),
        (2 * 86_400_000, "2d"),
    ],
)
def test_duration(ms: int, text: str) -> None:
    assert duration(ms) == text


def test_ago_and_timestamp() -> None:
    now = 1_700_000_000_000
    assert ago(0, now) == "-"
    assert ago(now - 12_000, now) == "12s ago"
    assert timestamp(now - 60_000, now) == "2023-11-14 22:12:20Z (1m ago)"
    assert timestamp(0, now) == "-"


def test_percent_and_version() -> None:
    assert percent(1, 4) == "25%" and percent(1, 0) == "-"
    assert version(10203) == "1.2.3" and version(100) == "0.1.0" and version(0) == "-"
    assert version(numeric_version("modelmesh-20230512-7")) == "20230512-0000-7"  # upstream's form
    assert version(2**64 - 1) == str(2**64 - 1)


@pytest.mark.parametrize("ms", [9223372036854775807, 2**64 - 1])
def test_a_last_use_no_date_holds_is_shown_not_a_traceback(ms: int) -> None:
    # issue 15: `models get` died with "year 292278994 is out of range", `list` said "0ms ago"
    now = 1_700_000_000_000
    assert timestamp(ms, now).startswith(f"{ms} ms since the epoch (in ")
    assert ago(ms, now).startswith("in ")
    assert ago(now + 5000, now) == "in 5s"
