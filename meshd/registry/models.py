"""Model and vmodel registry operations over the watch-fed tables (CAS loops).

Each operation is a pure update function handed to `Table.update`, so conflicting
writers retry against fresh data and nothing here decides placement.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TypeVar

from meshd.core.errors import AlreadyExists, DataLoss, FailedPrecondition, NotFound, Unavailable
from meshd.core.records import (
    EVICTED_BY,
    EVICTION_ORDERS,
    REGISTERED_LU,
    USE_HISTORY,
    USE_HISTORY_KEPT,
    ModelRecord,
    RecordError,
    VModelRecord,
    eviction_note,
    newer_history,
    use_history,
)
from meshd.decisions.ids import ModelInfo
from meshd.decisions.janitor import at_max_elsewhere
from meshd.kv.health import for_client
from meshd.kv.store import StoreError
from meshd.kv.table import KEEP, Keep, Table

T = TypeVar("T")

# Upstream dates a registration without lastUsedTime in the past so it cannot evict
# models in active use (SPEC §2).
REGISTER_AGE_LOAD_NOW_MS = 3_600_000
REGISTER_AGE_NO_LOAD_MS = 6 * 3_600_000


def default_last_used(now_ms: int, load_now: bool) -> int:
    return now_ms - (REGISTER_AGE_LOAD_NOW_MS if load_now else REGISTER_AGE_NO_LOAD_MS)


class CopiesFull(Unavailable):
    """The model's max copies are already loaded (or loading) on serving instances: the
    request goes to one of `holders` instead (this instance does not load it)."""

    def __init__(self, model_id: str, instance_id: str, holders: Mapping[str, int]) -> None:
        super().__init__(f"not loading {model_id!r} on {instance_id}: its max copies are on {sorted(holders)}")
        self.holders = dict(holders)


@dataclass(frozen=True)
class CopyAdded:
    """A model's past as its record held it when a copy of it was added: read in that
    compare-and-set, not from the mirror, which may not show yet the eviction another instance
    wrote just before (its uses then, and the adaptive order's note this add clears)."""

    history: tuple[float, ...]
    evicted_by: tuple[int, float] | None


class Registry:
    def __init__(self, models: Table[ModelRecord], vmodels: Table[VModelRecord]) -> None:
        self.models = models
        self.vmodels = vmodels

    def get(self, model_id: str) -> ModelRecord | None:
        return self.models.get(model_id)

    def require(self, model_id: str) -> ModelRecord:
        """The record, or NOT_FOUND; DATA_LOSS when the stored value is corrupt."""
        rec = self.models.get(model_id)
        if rec is None:
            corrupt = self.models.corrupt.get(model_id)
            if corrupt is not None:
                raise DataLoss(f"stored record for model {model_id!r} is corrupt and was left untouched: {corrupt}")
            raise NotFound(f"model {model_id!r} not found")
        return rec

    def corrupt_reason(self, model_id: str) -> str | None:
        return self.models.corrupt.get(model_id)

    async def fetch(self, model_id: str) -> ModelRecord:
        """A linearizable read, for a record the mirror has not seen yet (just registered
        through another instance). NOT_FOUND / DATA_LOSS like `require`."""
        try:
            kv = await for_client(self.models.store, self.models.store.get(self.models.key(model_id)))
        except StoreError as e:
            raise Unavailable(f"model registry unavailable: {e}") from None
        if kv is None:
            raise NotFound(f"model {model_id!r} not found")
        try:
            return ModelRecord.decode(kv.value)
        except RecordError as e:
            raise DataLoss(f"stored record for model {model_id!r} is corrupt and was left untouched: {e}") from None

    async def _update(self, table: Table[T], item_id: str, fn: Callable[[T | None], T | Keep | None]) -> T | None:
        try:
            # A client waits on this: UNAVAILABLE at once while etcd is not answering (kv.health).
            return await for_client(table.store, table.update(item_id, fn))
        except RecordError as e:
            raise DataLoss(f"stored record for {item_id!r} is corrupt and was left untouched: {e}") from None
        except StoreError as e:
            # Unreachable, overloaded (etcd NOSPACE) or refusing: retryable for the client.
            raise Unavailable(f"model registry unavailable: {e}") from None

    async def register(
        self, model_id: str, info: ModelInfo, last_used_ms: int, by_default: bool = False
    ) -> ModelRecord:
        """Create the record; identical info is a no-op, different info ALREADY_EXISTS.
        `by_default`: `last_used_ms` is upstream's made-up registration time (REGISTERED_LU)."""

        def fn(rec: ModelRecord | None) -> ModelRecord | Keep:
            if rec is None:
                extra = {REGISTERED_LU: last_used_ms} if by_default else {}
                return ModelRecord(type=info.type, path=info.path, key=info.key, last_used=last_used_ms, extra=extra)
            if not rec.same_info(info.type, info.path, info.key):
                raise AlreadyExists(f"model {model_id!r} is already registered with different model info")
            return KEEP

        rec = await self._update(self.models, model_id, fn)
        assert rec is not None
        return rec

    async def unregister(self, model_id: str) -> ModelRecord | None:
        """Delete the record (absent: no-op); refused while a vmodel references it."""
        removed: list[ModelRecord] = []

        def fn(rec: ModelRecord | None) -> ModelRecord | Keep | None:
            if rec is None:
                return KEEP
            if rec.refs > 0:
                raise FailedPrecondition(f"model {model_id!r} is referenced by {rec.refs} vmodel(s)")
            removed[:] = [rec]
            return None

        await self._update(self.models, model_id, fn)
        return removed[0] if removed else None

    async def add_copy(
        self, model_id: str, instance_id: str, start_ms: int, serving: AbstractSet[str] | None = None
    ) -> CopyAdded | None:
        """Record a copy loading here; None when the model is no longer registered.

        `serving`: the live instances not shutting down (None: no max-copies check). Then
        the copy is refused (`CopiesFull`, nothing written) when holders among them already
        reach the model's max copies. Checked inside the compare-and-set, so of instances
        adding a copy at once (all rerouting from a holder that left) only the max win."""

        past: list[CopyAdded] = []

        def fn(rec: ModelRecord | None) -> ModelRecord | Keep:
            if rec is None:
                return KEEP
            added = instance_id not in rec.instance_ids
            if added and serving is not None and at_max_elsewhere(instance_id, rec, serving):
                raise CopiesFull(model_id, instance_id, rec.instance_ids)
            past[:] = [CopyAdded(use_history(rec.extra), eviction_note(rec.extra))]  # the last try's
            rec.instance_ids[instance_id] = start_ms
            rec.extra.pop(EVICTED_BY, None)  # this load was charged for it (one eviction, one charge)
            rec.failed_in.pop(instance_id, None)
            rec.fails.pop(instance_id, None)
            return rec

        return past[0] if await self._update(self.models, model_id, fn) is not None else None

    async def remove_copy(
        self,
        model_id: str,
        instance_id: str,
        history: Sequence[float] = (),
        evicted_by: tuple[int, float] | None = None,
    ) -> None:
        """The instance's copy leaves the record; `history`: the evicted copy's recent uses on
        the fleet clock, kept in the record unless it holds newer ones (`newer_history`);
        `evicted_by`: the adaptive order's note (the order that chose it, the clock then)."""

        def fn(rec: ModelRecord | None) -> ModelRecord | Keep:
            if rec is None or instance_id not in rec.instance_ids:
                return KEEP
            del rec.instance_ids[instance_id]
            kept = use_history(rec.extra)
            if history and newer_history(history, kept):
                rec.extra[USE_HISTORY] = [round(c, 3) for c in history[-USE_HISTORY_KEPT:]]
            if evicted_by is not None:
                rec.extra[EVICTED_BY] = [EVICTION_ORDERS[evicted_by[0]], round(evicted_by[1], 3)]
            return rec

        await self._update(self.models, model_id, fn)

    async def record_failure(self, model_id: str, instance_id: str, message: str, now_ms: int) -> None:
        def fn(rec: ModelRecord | None) -> ModelRecord | Keep:
            if rec is None:
                return KEEP
            rec.instance_ids.pop(instance_id, None)
            rec.failed_in[instance_id] = now_ms
            rec.fails[instance_id] = {"msg": message}
            return rec

        await self._update(self.models, model_id, fn)

    async def clear_failure(self, model_id: str, instance_id: str) -> None:
        def fn(rec: ModelRecord | None) -> ModelRecord | Keep:
            if rec is None or instance_id not in rec.failed_in:
                return KEEP
            rec.failed_in.pop(instance_id, None)
            rec.fails.pop(instance_id, None)
            return rec

        await self._update(self.models, model_id, fn)

    async def touch(self, model_id: str, last_used_ms: int) -> None:
        def fn(rec: ModelRecord | None) -> ModelRecord | Keep:
            if rec is None or rec.last_used >= last_used_ms:
                return KEEP
            rec.last_used = last_used_ms
            return rec

        await self._update(self.models, model_id, fn)
