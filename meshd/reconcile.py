"""The janitor's decision (pure): what to repair between this instance's cache and the registry.

- a record names this instance for a model it does not hold → remove the copy from it;
- a loaded copy whose record does not name this instance → add it back (peers route to it);
- a loaded copy of a model no longer registered → unload it.
The runtime side is kept honest elsewhere: it purges at READY, and a NOT_FOUND from it
drops the copy. (The SPI has no "list loaded" call to compare against.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from meshd.cache import CacheEntry, State
from meshd.kv.records import ModelRecord


@dataclass(frozen=True, slots=True)
class Repairs:
    remove_from_records: tuple[str, ...] = ()
    add_to_records: tuple[str, ...] = ()
    unload: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.remove_from_records or self.add_to_records or self.unload)


def plan_repairs(
    self_id: str,
    records: Mapping[str, ModelRecord],
    entries: Iterable[CacheEntry],
    corrupt: Iterable[str] = (),
) -> Repairs:
    held = {e.model_id: e for e in entries}
    skip = set(corrupt)  # a corrupt record is reported elsewhere and never rewritten
    remove = [mid for mid, rec in records.items() if self_id in rec.instance_ids and mid not in held]
    add: list[str] = []
    unload: list[str] = []
    for mid, entry in held.items():
        if entry.state is not State.LOADED or mid in skip:
            continue
        rec = records.get(mid)
        if rec is None:
            unload.append(mid)
        elif self_id not in rec.instance_ids:
            add.append(mid)
    return Repairs(tuple(sorted(remove)), tuple(sorted(add)), tuple(sorted(unload)))
