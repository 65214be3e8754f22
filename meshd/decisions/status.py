"""What getModelStatus reports, decided from the record and this instance's view (pure)."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from meshd.core.records import ModelRecord
from meshd.decisions.cache import CacheEntry, State


class ModelStatus(enum.IntEnum):
    """Values of mmesh ModelStatusInfo.ModelStatus (SPEC §2)."""

    NOT_FOUND = 0
    NOT_LOADED = 1
    LOADING = 2
    LOADED = 3
    LOADING_FAILED = 4
    UNKNOWN = 5


@dataclass(frozen=True, slots=True)
class CopyView:
    location: str
    status: ModelStatus
    time_ms: int


@dataclass(frozen=True, slots=True)
class StatusView:
    status: ModelStatus
    errors: tuple[str, ...] = ()
    copies: tuple[CopyView, ...] = field(default_factory=tuple)


NOT_FOUND = StatusView(ModelStatus.NOT_FOUND)


class CopyState(enum.Enum):
    """A peer's copy as the peer itself reports it."""

    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"
    GONE = "gone"  # the peer holds no such copy (the record is behind)
    UNKNOWN = "unknown"  # the peer did not answer


def failure_expired(failed_ms: int, now_ms: int, expiry_ms: int) -> bool:
    return now_ms - failed_ms >= expiry_ms


def recent_failures(failed_in: Mapping[str, int], now_ms: int, expiry_ms: int) -> list[str]:
    """Instances where the model failed to load within the last `expiry_ms`."""
    return [i for i, ms in failed_in.items() if not failure_expired(ms, now_ms, expiry_ms)]


def given_up_message(model_id: str, record: ModelRecord, recent: Sequence[str]) -> str:
    """A load failure's answer (upstream: INTERNAL): the runtime's newest message, then where
    it failed lately. `recent`: the instances where it failed lately (not empty)."""
    newest = max(recent, key=lambda i: record.failed_in.get(i, 0))
    fails = {i: record.fails.get(i, {}).get("msg", "load failed") for i in recent}
    return load_failure_message(model_id, fails, fails[newest], " recently")


def load_failure_message(model_id: str, fails: Mapping[str, str], first: str, when: str = "") -> str:
    """`first` once, then how many instances failed and where, each message said once with
    the instances that gave it (every attempt failing alike is one line, not one per attempt)."""
    by_message: dict[str, list[str]] = {}
    for instance, message in fails.items():
        by_message.setdefault(message, []).append(instance)
    count = f"{len(fails)} instance{'s' if len(fails) != 1 else ''}"
    if len(by_message) == 1:
        where = ", ".join(sorted(fails))
    else:
        where = "; ".join(f"{', '.join(sorted(ids))}: {message}" for message, ids in by_message.items())
    return f"{first} (model {model_id!r} failed to load on {count}{when}: {where})"


def failed_everywhere(
    model_id: str,
    excluded: AbstractSet[str],
    record: ModelRecord,
    recent: Sequence[str],
    told: Mapping[str, str],
) -> str | None:
    """When a request ran out of instances, whether it is a load failure (INTERNAL, with this
    message) rather than churn worth retrying (None): every instance it was turned away from
    failed to load the model, by the record's recent failures or, before their record writes
    reach this instance's mirror, by what the peers said (`told`: instance -> message)."""
    if not excluded:
        return None
    if recent and excluded <= set(recent):
        return given_up_message(model_id, record, recent)
    if told and excluded <= set(recent) | told.keys():
        fails = {i: record.fails.get(i, {}).get("msg", "load failed") for i in recent if i in excluded}
        fails.update(told)
        return load_failure_message(model_id, fails, next(iter(told.values())))
    return None


def model_status(
    record: ModelRecord | None,
    local: CacheEntry | None,
    self_id: str,
    now_ms: int,
    failure_expiry_ms: int,
    live: AbstractSet[str] | None = None,
    peers: Mapping[str, CopyState] | None = None,
    no_home: str | None = None,
) -> StatusView:
    """Status across the mesh as this instance sees it.

    The local copy's state is known exactly; other instances' copies are as they reported
    them (`peers`: a copy still loading is LOADING, one they no longer hold is left out), and
    taken as loaded when not asked or not answering, while the instance is live (`live`:
    ids with a record, None: all). Unexpired failures count; newest copies first.
    `no_home`: upstream's message when no running instance may load the model's type
    (`constraints.no_home_message`); with no copy and no failure the status is then
    LOADING_FAILED with that message, which modelmesh-serving's controller decodes.
    """
    if record is None:
        return NOT_FOUND
    peers = peers or {}
    copies: list[CopyView] = []
    for iid, start_ms in record.instance_ids.items():
        if iid == self_id:
            if local is None:
                continue  # stale: this instance does not hold it (janitor repairs)
            state = {State.LOADING: ModelStatus.LOADING, State.LOADED: ModelStatus.LOADED}.get(
                local.state, ModelStatus.LOADING_FAILED
            )
            copies.append(CopyView(iid, state, start_ms))
        elif live is None or iid in live:
            said = peers.get(iid, CopyState.UNKNOWN)
            if said is CopyState.LOADING:
                copies.append(CopyView(iid, ModelStatus.LOADING, start_ms))
            elif said in (CopyState.LOADED, CopyState.UNKNOWN):
                copies.append(CopyView(iid, ModelStatus.LOADED, start_ms))
    if local is not None and local.state is State.LOADING and self_id not in record.instance_ids:
        copies.append(CopyView(self_id, ModelStatus.LOADING, local.since_ms))
    errors: list[str] = []
    for iid, failed_ms in record.failed_in.items():
        if failure_expired(failed_ms, now_ms, failure_expiry_ms):
            continue
        copies.append(CopyView(iid, ModelStatus.LOADING_FAILED, failed_ms))
        msg = record.fails.get(iid, {}).get("msg", "load failed")
        errors.append(f"{iid}: {msg}")
    copies.sort(key=lambda c: c.time_ms, reverse=True)
    states = {c.status for c in copies}
    if ModelStatus.LOADED in states:
        status = ModelStatus.LOADED
    elif ModelStatus.LOADING in states:
        status = ModelStatus.LOADING
    elif ModelStatus.LOADING_FAILED in states:
        status = ModelStatus.LOADING_FAILED
    elif no_home is not None:
        return StatusView(ModelStatus.LOADING_FAILED, (no_home,), tuple(copies))
    else:
        status = ModelStatus.NOT_LOADED
    return StatusView(status, tuple(errors), tuple(copies))
