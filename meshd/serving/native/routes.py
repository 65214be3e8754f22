"""Which models the native data plane carries, and where (pure).

Local: a copy that is loaded, whose runtime answers, and that has no concurrency limit (a
limited copy's queue is the Python path's). Peers: a model this instance was asked for
and has no such copy of, held by a live peer that serves natively, goes to that peer's
native port; the peer is the one Python's routing would pick first for an idle instance
(`placement.serving.choose_copy`), so both paths agree. Everything else takes the Python path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from meshd.core.records import ModelRecord
from meshd.decisions.placement.serving import choose_copy
from meshd.decisions.placement.view import ClusterView
from meshd.serving.native.haproxy_config import PEER_BACKEND, map_key_ok


@dataclass(frozen=True, slots=True)
class LocalCopy:
    model_id: str
    loaded: bool
    limited: bool  # the runtime limits its concurrency: the Python path's gate queues for it


def local_routes(copies: Iterable[LocalCopy], runtime_up: bool) -> set[str]:
    if not runtime_up:
        return set()
    return {c.model_id for c in copies if c.loaded and not c.limited and map_key_ok(c.model_id)}


def native_peers(view: ClusterView, address_ok: Callable[[str], bool]) -> dict[str, str]:
    """Peer instance -> native address, for the live peers a native hop may go to: serving (not
    shutting down), not found unreachable lately, with an address HAProxy can dial."""
    return {
        i.instance_id: i.native
        for i in view.serving
        if i.native and i.instance_id != view.self_id and i.instance_id not in view.unreachable and address_ok(i.native)
    }


def carried_since(previous: Mapping[str, int], now: Mapping[str, int]) -> dict[str, int]:
    """Model -> requests carried natively between two reads of HAProxy's counters (its table
    counts from its own start: a model new to it starts at 0)."""
    return {m: n - previous.get(m, 0) for m, n in now.items() if n > previous.get(m, 0)}


def assign_slots(current: Mapping[str, str], natives: Mapping[str, str], slots: int) -> dict[str, str]:
    """Peer instance -> native address for each peer slot (slot index as a string), stable:
    a peer keeps its slot while it stays; a new peer takes the lowest free slot; beyond
    `slots` peers, the rest have none (their models take the Python path)."""
    kept = {s: inst for s, inst in current.items() if inst in natives}
    taken = set(kept.values())
    free = (str(i) for i in range(slots) if str(i) not in kept)
    for inst in sorted(natives):
        if inst in taken:
            continue
        slot = next(free, None)
        if slot is None:
            break
        kept[slot] = inst
    return kept


def peer_routes(
    wanted: Iterable[str],
    records: Mapping[str, ModelRecord],
    view: ClusterView,
    natives: Mapping[str, str],
    slot_of: Mapping[str, str],
    assume_loaded_ms: Callable[[str], int],
    local: set[str],
) -> dict[str, str]:
    """Model id -> peer backend for the models asked of this instance that a native peer holds
    (`assume_loaded_ms`: model type -> the horizon learnt so far)."""
    routes: dict[str, str] = {}
    for model_id in wanted:
        if model_id in local or not map_key_ok(model_id):
            continue
        record = records.get(model_id)
        if record is None or not record.instance_ids:
            continue
        target = choose_copy(view, record.instance_ids, {}, frozenset(), assume_loaded_ms(record.type), False, False)
        if target is None or target == view.self_id or target not in natives:
            continue
        slot = slot_of.get(target)
        if slot is not None:
            routes[model_id] = f"{PEER_BACKEND}{slot}"
    return routes


@dataclass
class MapChanges:
    put: dict[str, str] = field(default_factory=dict)  # key -> value (added or changed)
    delete: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.put or self.delete)


def map_changes(current: Mapping[str, str], desired: Mapping[str, str]) -> MapChanges:
    changes = MapChanges()
    for key, value in desired.items():
        if current.get(key) != value:
            changes.put[key] = value
    changes.delete = sorted(k for k in current if k not in desired)
    return changes


def runtime_api_commands(path: str, current: Mapping[str, str], changes: MapChanges) -> list[str]:
    """HAProxy runtime API commands that turn `current` into what `changes` say."""
    commands = [f"del map {path} {k}" for k in changes.delete]
    for key, value in changes.put.items():
        verb = "set" if key in current else "add"
        commands.append(f"{verb} map {path} {key} {value}")
    return commands
