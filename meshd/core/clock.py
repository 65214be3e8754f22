"""Wall-clock milliseconds (records carry epoch ms, like upstream's)."""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], int]


def wall_ms() -> int:
    return time.time_ns() // 1_000_000
