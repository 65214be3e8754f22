"""The local cache decision: a size-weighted LRU of models in 8 KiB units.

Pure: no I/O, no asyncio; time comes in as arguments (ms). The mechanism that owns the
runtime (`meshd.local`) asks it what to admit and what to evict, then does the loads and
unloads. The simulator drives exactly this class.

Ordering is by each entry's last-used time, which may be set "in the past" (a model
registered without a recent use must not push out models in active use).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshd.gate import CopyGate  # carried, never used, by this pure module

UNIT_BYTES = 8192  # upstream ModelMesh's 8 KiB cache unit (SPEC §6)
USE_SPELL_GAP_MS = 10_000  # uses further apart than upstream's rate-check interval are separate spells


def to_units(nbytes: int) -> int:
    """Whole 8 KiB units for `nbytes`, at least one (an entry always weighs something)."""
    return max(1, -(-nbytes // UNIT_BYTES))


class State(enum.Enum):
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"  # kept at weight 1 as a negative cache until evicted or expired


@dataclass(slots=True)
class CacheEntry:
    model_id: str
    units: int
    last_used_ms: int
    state: State = State.LOADING
    since_ms: int = 0  # when it entered its current state
    inflight: int = 0  # requests being served from this copy
    served: int = 0  # requests served from this copy (the scaler samples it for rates)
    prior_use_ms: int | None = None  # last use before the current spell of use
    gate: CopyGate | None = None  # the copy's concurrency limit, when the runtime asks for one


@dataclass(frozen=True, slots=True)
class Admission:
    admitted: bool
    evicted: tuple[CacheEntry, ...] = ()
    reason: str = ""
    retryable: bool = False  # room may appear once loads in progress finish


class WeightedLRU:
    def __init__(self, capacity_units: int) -> None:
        if capacity_units < 1:
            raise ValueError("cache capacity must be at least one unit")
        self.capacity_units = capacity_units
        self.used_units = 0
        self._entries: dict[str, CacheEntry] = {}

    # ---- reads ---------------------------------------------------------------------
    def get(self, model_id: str) -> CacheEntry | None:
        return self._entries.get(model_id)

    def __contains__(self, model_id: str) -> bool:
        return model_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[CacheEntry]:
        return list(self._entries.values())

    @property
    def free_units(self) -> int:
        return self.capacity_units - self.used_units

    def lru_ms(self, now_ms: int) -> int:
        """Oldest last-used time among loaded entries (now when there are none)."""
        times = [e.last_used_ms for e in self._entries.values() if e.state is State.LOADED]
        return min(times) if times else now_ms

    # ---- decisions -----------------------------------------------------------------
    def touch(self, model_id: str, now_ms: int) -> None:
        entry = self._entries.get(model_id)
        if entry is not None and entry.last_used_ms < now_ms:
            if now_ms - entry.last_used_ms > USE_SPELL_GAP_MS:
                entry.prior_use_ms = entry.last_used_ms  # a new spell of use begins
            entry.last_used_ms = now_ms

    def admit(self, model_id: str, units: int, last_used_ms: int, now_ms: int) -> Admission:
        """Reserve `units` for a new LOADING entry, evicting least-recently-used ones.

        Nothing changes when it is refused: too big for the whole cache, or only entries
        that are still loading (or used more recently than the newcomer) could make room.
        """
        if model_id in self._entries:
            return Admission(False, reason="already in the cache")
        if units > self.capacity_units:
            return Admission(False, reason=f"needs {units} units, the cache holds {self.capacity_units}")
        needed = units - self.free_units
        victims = self._plan_eviction(needed, exclude=model_id, newer_than=last_used_ms)
        if victims is None:
            # Worth waiting only if loads in progress, once evictable, could make the room.
            loading = sum(e.units for e in self._entries.values() if e.state is State.LOADING)
            evictable = sum(
                e.units
                for e in self._entries.values()
                if e.state is not State.LOADING and e.last_used_ms <= last_used_ms and e.model_id != model_id
            )
            if loading + evictable >= needed:
                return Admission(False, reason="no room until loads in progress finish", retryable=True)
            return Admission(False, reason="no room: the cache is full of more recently used models")
        for victim in victims:
            self._drop(victim.model_id)
        self._entries[model_id] = CacheEntry(model_id, units, last_used_ms, State.LOADING, now_ms)
        self.used_units += units
        return Admission(True, tuple(victims))

    def resize(self, model_id: str, units: int) -> tuple[CacheEntry, ...]:
        """Correct an entry's weight (after load or `modelSize`); returns what that evicts.

        If the correction cannot be covered by evicting others, the cache runs over its
        capacity rather than drop a model that is already loaded (upstream does the same).
        """
        entry = self._entries.get(model_id)
        if entry is None or units == entry.units:
            return ()
        self.used_units += units - entry.units
        entry.units = units
        victims = self._plan_eviction(-self.free_units, exclude=model_id, newer_than=None) or []
        for victim in victims:
            self._drop(victim.model_id)
        return tuple(victims)

    def set_state(self, model_id: str, state: State, now_ms: int) -> None:
        entry = self._entries.get(model_id)
        if entry is None:
            return
        entry.state = state
        entry.since_ms = now_ms
        if state is State.FAILED:
            self.resize(model_id, 1)

    def remove(self, model_id: str) -> CacheEntry | None:
        return self._drop(model_id)

    def _drop(self, model_id: str) -> CacheEntry | None:
        entry = self._entries.pop(model_id, None)
        if entry is not None:
            self.used_units -= entry.units
        return entry

    def _plan_eviction(self, needed: int, exclude: str, newer_than: int | None) -> list[CacheEntry] | None:
        """Victims freeing at least `needed` units, oldest first; None if impossible.

        Loading entries are never victims. Idle copies go before copies serving requests.
        With `newer_than`, an entry used more recently than the newcomer is not evicted
        for it (the newcomer would be the next victim anyway).
        """
        if needed <= 0:
            return []
        candidates = [e for e in self._entries.values() if e.state is not State.LOADING and e.model_id != exclude]
        candidates.sort(key=lambda e: (e.inflight > 0, e.last_used_ms))
        victims: list[CacheEntry] = []
        freed = 0
        for entry in candidates:
            if freed >= needed:
                break
            if newer_than is not None and entry.last_used_ms > newer_than:
                continue
            victims.append(entry)
            freed += entry.units
        return victims if freed >= needed else None
