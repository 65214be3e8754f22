"""An optional record of when each registry change became visible in this instance's mirror.

With MESHD_WATCH_TRACE set, the model table appends one line per applied watch batch:
`<revision> <wall-clock ns>`. A benchmark that wrote revision R at time T on the same host
reads the propagation delay as (line time - T) without polling the instance (which would add
its own error). Off by default; the cost when on is one buffered line write per batch.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TextIO


class WatchTrace:
    def __init__(self, path: Path) -> None:
        # Line-buffered: a reader sees each line as soon as it is written, even mid-run.
        self._file: TextIO = open(path, "a", buffering=1)  # closed in close()

    def __call__(self, revision: int) -> None:
        self._file.write(f"{revision} {time.time_ns()}\n")

    def close(self) -> None:
        self._file.close()


def read_trace(path: Path) -> list[tuple[int, int]]:
    """(revision, wall ns) pairs of a trace file, in file order; a torn last line is skipped."""
    out: list[tuple[int, int]] = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            out.append((int(parts[0]), int(parts[1])))
    return out
