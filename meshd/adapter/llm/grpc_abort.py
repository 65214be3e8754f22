"""Ending a gRPC call with a status, typed as the raise it is."""

from __future__ import annotations

from typing import Any, NoReturn

import grpc


async def abort(context: Any, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("context.abort returned")  # it raises
