"""One place that turns core errors into gRPC statuses for the servicers."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from meshd.core.errors import MeshError

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def statuses(method: F) -> F:
    """Map MeshError to its status; anything else becomes INTERNAL with the reason logged."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: Any) -> Any:
        try:
            return await method(self, request, context)
        except MeshError as e:
            await context.abort(e.code, e.message)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            log.exception("%s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

    return wrapper  # type: ignore[return-value]
