"""Mounted configuration files followed as they change (MM_TYPE_CONSTRAINTS_PATH,
MM_DATAPLANE_CONFIG_PATH), as upstream reloads them.

Kubernetes updates a mounted ConfigMap by writing the new files into a fresh directory and
swapping a `..data` symlink to it, so the path's inode, mtime and even the file's own
symlink may stay put while what it resolves to changes. The watch therefore reads the
file's content on each tick and compares it with what was applied last (the files are
small): any change of content counts, however it was made. A new content that does not
parse is logged and the previous configuration stays in force; a missing file (mid-swap)
is skipped until it is back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 2.0


class FileWatch:
    def __init__(
        self, what: str, path: Path, apply: Callable[[str], None], interval_s: float = DEFAULT_INTERVAL_S
    ) -> None:
        """`apply(text)`: parse and put in force (ValueError: not applied); `what`: the
        setting's name, for the log."""
        self.what = what
        self.path = path
        self.apply = apply
        self.interval_s = interval_s
        self.applied = self._read()  # the content start-up already used
        self.changes = 0  # contents applied since start-up

    def _read(self) -> str | None:
        try:
            return self.path.read_text()
        except OSError:
            return None

    def check(self) -> bool:
        """One look at the file: applies a changed content; True when one was applied."""
        text = self._read()
        if text is None or text == self.applied:
            return False
        try:
            self.apply(text)
        except ValueError as e:
            log.warning("%s: %s changed but cannot be used, keeping the previous one: %s", self.what, self.path, e)
            self.applied = text  # reported once; the next change is tried again
            return False
        self.applied = text
        self.changes += 1
        log.info("%s: reloaded %s", self.what, self.path)
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.check()
            except Exception:
                log.exception("%s: checking %s failed", self.what, self.path)
