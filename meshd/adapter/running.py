"""What `meshd adapter` and `meshd llm-runtime` share as processes: their log format from the
flag or the environment, and running their server on uvloop (when installed) with a start-up
failure said in one line."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine, Mapping
from typing import Any

from meshd.observability.logs import parse_log_format


def log_format(prog: str, flag: str | None, env: Mapping[str, str]) -> str | None:
    """The log format, `text` or `json` (None, with the reason on stderr, when it is neither)."""
    try:
        return parse_log_format(flag or env.get("MESHD_LOG_FORMAT") or "text")
    except ValueError as e:
        print(f"{prog}: MESHD_LOG_FORMAT (--log-format) {e}", file=sys.stderr)
        return None


def run(prog: str, serve: Coroutine[Any, Any, int]) -> int:
    """Run `serve` to its exit status; an unusable port or folder is one line and exit 1."""
    try:
        try:
            import uvloop
        except ImportError:
            return asyncio.run(serve)
        code: int = uvloop.run(serve)
        return code
    except (OSError, RuntimeError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
