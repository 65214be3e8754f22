"""Whether the store is answering, and calls made for a client that give up soon when it is not.

A frozen etcd (stopped, swapped out, a stalled disk) accepts connections and answers
nothing, so each call waits for its whole deadline (the store's 5 s). Background loops can
afford that; a client waiting on `registerModel` should hear UNAVAILABLE at once. What
the store's calls have seen says which case this is (`Responsiveness`):

- the last call to end failed for want of an answer (UNAVAILABLE, DEADLINE_EXCEEDED) and
  none has answered since; or
- a call has waited more than `STALL_S` and nothing has answered since it was sent
  (etcd's own put round trip stays under 1 s even at its p99 under load: README, Scale).

Either way the store is *unresponsive*, and a caller-facing call (`for_client`) gives up
once it has waited `GIVE_UP_S` while it is so, with StoreUnavailable, instead of the full
deadline. The lease keep-alive and the watches keep their full deadline and clear the
verdict as soon as etcd answers one of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from meshd.kv.store import StoreUnavailable

STALL_S = 1.0  # a call unanswered this long, with no other answer since it was sent: stalled
GIVE_UP_S = 0.5  # how long a caller-facing call waits on an unresponsive store
POLL_S = 0.1  # how often a waiting caller-facing call looks at the verdict

T = TypeVar("T")


class Responsiveness:
    """The store's recent answers, from its calls' outcomes (clock: seconds, monotonic)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, stall_s: float = STALL_S) -> None:
        self.clock = clock
        self.stall_s = stall_s
        self._pending: dict[int, float] = {}  # call token -> when it was sent
        self._tokens = itertools.count()
        self._answered_at = float("-inf")
        self._failing = False

    def sent(self) -> int:
        token = next(self._tokens)
        self._pending[token] = self.clock()
        return token

    def answered(self, token: int | None = None) -> None:
        """The store answered (a result, or an error that is an answer: a failed compare,
        an unknown lease). `token`: the call it answered (None: a watch response)."""
        if token is not None:
            self._pending.pop(token, None)
        self._answered_at = self.clock()
        self._failing = False

    def unanswered(self, token: int) -> None:
        """The call ended without an answer (unreachable, or its deadline passed)."""
        self._pending.pop(token, None)
        self._failing = True

    def dropped(self, token: int) -> None:
        """The call was cancelled by its caller: says nothing about the store, unless it had
        already waited past `stall_s` unanswered (then the verdict it gave stays)."""
        sent = self._pending.pop(token, None)
        if sent is not None and self.clock() - sent > self.stall_s and self._answered_at < sent:
            self._failing = True

    def responsive(self) -> bool:
        if self._failing:
            return False
        if self._pending:
            oldest = min(self._pending.values())
            if self.clock() - oldest > self.stall_s and self._answered_at < oldest:
                return False
        return True


class Checked(Protocol):
    def responsive(self) -> bool: ...


async def for_client(store: Checked, call: Awaitable[T], give_up_s: float = GIVE_UP_S) -> T:
    """`call`'s result, or StoreUnavailable once it has waited `give_up_s` while the store
    is unresponsive (the call is cancelled: like a passed deadline, a write may or may not
    have been applied). A responsive store gets the call's own deadline."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(call)
    start = loop.time()
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                return task.result()
            if loop.time() - start >= give_up_s and not store.responsive():
                raise StoreUnavailable(f"etcd is not answering (gave up after {give_up_s:.1f}s)")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
