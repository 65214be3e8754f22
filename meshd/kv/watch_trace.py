"""An optional record of when each registry change became visible in this instance's mirror.

With MESHD_WATCH_TRACE set, the model table appends one line per applied watch batch:
`<revision> <wall-clock ns>`. A benchmark that wrote revision R at time T on the same host
reads the propagation delay as (line time - T) without polling the instance (which would add
its own error). Off by default; the cost when on is one buffered line write per batch. The
file grows without limit (about 30 bytes a batch): for benchmarks, not production. A failed
write (disk full) turns tracing off with one warning; the mirror carries on.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import TextIO

log = logging.getLogger(__name__)


class WatchTrace:
    def __init__(self, path: Path) -> None:
        self.path = path
        # Line-buffered: a reader sees each line as soon as it is written, even mid-run.
        self._file: TextIO | None = open(path, "a", buffering=1)  # closed in close()

    def __call__(self, revision: int) -> None:
        if self._file is None:
            return
        try:
            self._file.write(f"{revision} {time.time_ns()}\n")
        except OSError as e:
            # Raised into the mirror's watch loop, it would re-list after every batch.
            log.warning("MESHD_WATCH_TRACE: cannot write %s (%s); tracing is off", self.path, e)
            self.close()

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):  # the unwritten rest of a failed line
                file.close()


def read_trace(path: Path) -> list[tuple[int, int]]:
    """(revision, wall ns) pairs of a trace file, in file order; a torn last line is skipped."""
    out: list[tuple[int, int]] = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            out.append((int(parts[0]), int(parts[1])))
    return out
