"""The janitor's decision (pure): what to repair between this instance's cache and the registry.

- a record names this instance for a model it does not hold → remove the copy from it;
- a loaded copy whose record does not name this instance → add it back (peers route to it);
- a loaded copy of a model no longer registered → unload it;
- a loaded copy when the model's record already names its max copies on other live
  instances that are not leaving (shutdown flag) → unload it (and leave the record)
  rather than add it back. A leaving holder does not count: its copy is about to go, and
  shedding this one for it would leave the model with none. An instance that
  lost its lease (frozen, cut off) finds its copies reloaded elsewhere meanwhile: it checks
  this before its instance record returns (so `live` lacks it), and counting itself again
  would exceed the max. While it is live, only the record's absence is judged here (two
  live holders would both drop); the scaler sheds extra live copies one at a time.
The runtime side is kept honest elsewhere: it purges at READY, and a NOT_FOUND from it
drops the copy. (The SPI has no "list loaded" call to compare against.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from meshd.core.records import ModelRecord
from meshd.decisions.cache import CacheEntry, State
from meshd.decisions.placement.modelkey import policy_from_key
from meshd.decisions.placement.scaling import max_reached


@dataclass(frozen=True, slots=True)
class Repairs:
    remove_from_records: tuple[str, ...] = ()
    add_to_records: tuple[str, ...] = ()
    unload: tuple[str, ...] = ()
    surplus: tuple[str, ...] = ()  # held here, but the max copies are loaded elsewhere

    def __bool__(self) -> bool:
        return bool(self.remove_from_records or self.add_to_records or self.unload or self.surplus)


def plan_repairs(
    self_id: str,
    records: Mapping[str, ModelRecord],
    entries: Iterable[CacheEntry],
    corrupt: Iterable[str] = (),
    live: AbstractSet[str] | None = None,
    leaving: AbstractSet[str] = frozenset(),
) -> Repairs:
    """`live`: the instances with a record, without this one while it rejoins (None: copies
    are not checked against max copies). `leaving`: live instances with the shutdown flag."""
    held = {e.model_id: e for e in entries}
    skip = set(corrupt)  # a corrupt record is reported elsewhere and never rewritten
    remove = [mid for mid, rec in records.items() if self_id in rec.instance_ids and mid not in held]
    add: list[str] = []
    unload: list[str] = []
    surplus: list[str] = []
    for mid, entry in held.items():
        if entry.state is not State.LOADED or mid in skip:
            continue
        rec = records.get(mid)
        if rec is None:
            unload.append(mid)
        elif (
            live is not None
            and (self_id not in rec.instance_ids or self_id not in live)
            and at_max_elsewhere(self_id, rec, live - leaving)
        ):
            surplus.append(mid)
        elif self_id not in rec.instance_ids:
            add.append(mid)
    return Repairs(tuple(sorted(remove)), tuple(sorted(add)), tuple(sorted(unload)), tuple(sorted(surplus)))


def at_max_elsewhere(self_id: str, rec: ModelRecord, serving: AbstractSet[str]) -> bool:
    """The record names the model's max copies on `serving` instances other than this one."""
    try:
        policy = policy_from_key(rec.key)
    except ValueError:
        return False  # validated at registration; a record from another tool: no limit known
    return bool(policy.max_copies) and max_reached(policy, rec.instance_ids, self_id, serving)
