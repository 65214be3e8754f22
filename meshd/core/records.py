"""Upstream-compatible JSON records stored in etcd (SPEC §5).

Field names are upstream ModelMesh's so tools that watch its etcd keep working. Fields
meshd does not know are kept in `extra` and written back unchanged on every rewrite.
Decoding is total: a value that is not a JSON object, or has fields of the wrong type,
raises `RecordError` naming the problem, so a corrupt record is reported, never fatal.
Decoding is also as tolerant as upstream's writer needs: its Jackson writer omits every
field at its default (an absent `type`, `instanceIds`, `count`, `shutdown`...), so an absent
field reads as its default.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Self


class RecordError(ValueError):
    """A stored value that cannot be decoded as the expected record."""


def _int_map(raw: Any, name: str) -> dict[str, int]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in raw.values()):
        raise RecordError(f"field {name!r} must be an object of integers")
    return dict(raw)


def _typed(raw: Any, name: str, kind: type, default: Any) -> Any:
    if raw is None:
        return default
    # bool is an int subclass in Python; JSON true is not a count.
    if not isinstance(raw, kind) or (kind is int and isinstance(raw, bool)):
        raise RecordError(f"field {name!r} has the wrong type")
    return raw


def _load_object(data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        # ValueError covers bad UTF-8, bad JSON and integers too long to convert;
        # RecursionError, nesting deeper than the parser allows.
        raise RecordError(f"not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(obj, dict):
        raise RecordError("not a JSON object")
    return obj


def _dump(known: dict[str, Any], extra: dict[str, Any]) -> bytes:
    out = dict(extra)
    out.update({k: v for k, v in known.items() if v is not None})
    return json.dumps(out, separators=(",", ":"), sort_keys=True).encode()


@dataclass(slots=True)
class ModelRecord:
    """`<prefix>/<service>/registry/<modelId>`."""

    type: str
    path: str = ""  # mPath
    key: str = ""  # encKey
    instance_ids: dict[str, int] = field(default_factory=dict)  # instanceId -> load start ms
    failed_in: dict[str, int] = field(default_factory=dict)  # instanceId -> failure ms
    fails: dict[str, dict[str, Any]] = field(default_factory=dict)  # instanceId -> {"msg": ...}
    refs: int = 0  # vmodels referencing this model
    auto_delete: bool = False  # autoDel
    last_used: int = 0  # lu, ms
    extra: dict[str, Any] = field(default_factory=dict)

    _NAMES: ClassVar[dict[str, str]] = {
        "type": "type",
        "path": "mPath",
        "key": "encKey",
        "instance_ids": "instanceIds",
        "failed_in": "failedIn",
        "fails": "fails",
        "refs": "refs",
        "auto_delete": "autoDel",
        "last_used": "lu",
    }
    # Set membership, not `in _NAMES.values()` (a scan): decode runs once per record at start-up.
    _WIRE: ClassVar[frozenset[str]] = frozenset(_NAMES.values())

    @classmethod
    def decode(cls, data: bytes) -> Self:
        obj = _load_object(data)
        n = cls._NAMES
        model_type = _typed(obj.get(n["type"]), n["type"], str, "")  # upstream omits a null type
        fails_raw = _typed(obj.get(n["fails"]), n["fails"], dict, {})
        if not all(isinstance(v, dict) for v in fails_raw.values()):
            raise RecordError("field 'fails' must be an object of objects")
        return cls(
            type=model_type,
            path=_typed(obj.get(n["path"]), n["path"], str, ""),
            key=_typed(obj.get(n["key"]), n["key"], str, ""),
            instance_ids=_int_map(obj.get(n["instance_ids"]), n["instance_ids"]),
            failed_in=_int_map(obj.get(n["failed_in"]), n["failed_in"]),
            fails=dict(fails_raw),
            refs=_typed(obj.get(n["refs"]), n["refs"], int, 0),
            auto_delete=_typed(obj.get(n["auto_delete"]), n["auto_delete"], bool, False),
            last_used=_typed(obj.get(n["last_used"]), n["last_used"], int, 0),
            extra={k: v for k, v in obj.items() if k not in cls._WIRE},
        )

    def encode(self) -> bytes:
        n = self._NAMES
        known: dict[str, Any] = {
            n["type"]: self.type,
            n["path"]: self.path or None,
            n["key"]: self.key or None,
            n["instance_ids"]: self.instance_ids,
            n["failed_in"]: self.failed_in or None,
            n["fails"]: self.fails or None,
            n["refs"]: self.refs or None,
            n["auto_delete"]: self.auto_delete or None,
            n["last_used"]: self.last_used,
        }
        return _dump(known, self.extra)

    def copy(self) -> ModelRecord:
        return ModelRecord.decode(self.encode())

    def same_info(self, model_type: str, path: str, key: str) -> bool:
        return (self.type, self.path, self.key) == (model_type, path, key)


@dataclass(slots=True)
class VModelRecord:
    """`<prefix>/<service>/vmodels/<vModelId>`."""

    owner: str = ""  # o
    active_model: str = ""  # amid
    target_model: str = ""  # tmid
    failed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    _NAMES: ClassVar[dict[str, str]] = {
        "owner": "o",
        "active_model": "amid",
        "target_model": "tmid",
        "failed": "failed",
    }

    @classmethod
    def decode(cls, data: bytes) -> Self:
        obj = _load_object(data)
        n = cls._NAMES
        return cls(
            owner=_typed(obj.get(n["owner"]), "o", str, ""),
            active_model=_typed(obj.get(n["active_model"]), "amid", str, ""),
            target_model=_typed(obj.get(n["target_model"]), "tmid", str, ""),
            failed=_typed(obj.get(n["failed"]), "failed", bool, False),
            extra={k: v for k, v in obj.items() if k not in n.values()},
        )

    def encode(self) -> bytes:
        n = self._NAMES
        known = {
            n["owner"]: self.owner or None,
            n["active_model"]: self.active_model,
            n["target_model"]: self.target_model,
            n["failed"]: self.failed or None,
        }
        return _dump(known, self.extra)


RUNTIME_DOWN = "runtimeDown"  # instance record key meshd adds beside `shutdown`
# The instance record key that marks a meshd instance (value: the version of meshd's record
# and peer protocol). Upstream (Java) instances never write it; see `InstanceRecord.upstream`.
MESHD_MARKER = "meshd"
MESHD_RECORD_VERSION = 1
EMPTY_LRU_TIME = (1 << 63) - 1  # upstream's lruTime of an instance with nothing loaded (Long.MAX_VALUE)
# MM_LOCATION (the node's address): upstream writes it to `loc`, which meshd uses for the
# address peers dial, so it goes under its own key.
NODE_LOCATION = "nodeLoc"
NATIVE_ADDRESS = "meshdNative"  # host:port of the instance's native data plane (MESHD_DATAPLANE=native)
# The fleet's shared cache clock (meshd.decisions.fleet_clock), as added keys upstream ignores:
# an instance's cumulative 8 KiB units evicted, and its clock; a model's recent uses on that
# clock, written when a copy is evicted and read by whichever instance loads it next.
FLEET_EVICTED = "meshdEvicted"
FLEET_CLOCK = "meshdClock"
USE_HISTORY = "meshdUses"
# The adaptive order's regret (meshd.decisions.regret): a model record notes which order evicted
# its last copy and the fleet clock then (`["rate" | "recency", clock]`), for whichever instance
# loads it next; an instance record carries its decayed evictions and charges per order
# (`[RATE's evictions, RATE's charges, recency's evictions, recency's charges]`).
EVICTED_BY = "meshdEvictedBy"
REGRET = "meshdRegret"
EVICTION_ORDERS = ("rate", "recency")  # meshd.decisions.regret.ORDERS
# What the copy an instance evicts next is worth (log2, `WeightedLRU.victim_value`; absent
# under LRU and GDSF): placement sends a load where it evicts the least (rank.cheapest).
VICTIM_VALUE = "meshdVictim"
USE_HISTORY_KEPT = 8  # RATE's uses kept (meshd.decisions.cache.RATE_USES_KEPT)
# The `lu` a registration gave by upstream's default rule (6 h ago, 1 h with --load-now): while
# no use is newer, the model has never been used, and `meshd models list` says so rather than
# showing the made-up time. Absent: registered with a time of its own (or by another writer).
REGISTERED_LU = "meshdRegLu"
# The models whose pulled files the instance's runtime keeps on its disk (issue 42's disk tier),
# as a Bloom filter with the pull time per GiB (meshd.decisions.placement.disk): placement
# counts a load there as one without a pull. Absent: the runtime has no disk tier.
DISK_TIER = "meshdDisk"


def _number(value: object) -> float | None:
    """A finite JSON number (not a bool), else None: an added key another writer may get wrong."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def never_used(extra: Mapping[str, Any], last_used_ms: int) -> bool:
    """Whether a model whose newest use (record and copies) is `last_used_ms` has not been used
    since a registration that gave it the default `lu` (REGISTERED_LU)."""
    registered = _number(extra.get(REGISTERED_LU))
    return registered is not None and last_used_ms <= registered


def use_history(extra: Mapping[str, Any]) -> tuple[float, ...]:
    """A model record's recent uses on the fleet clock (oldest first); () when absent or not a
    list of numbers in order (a record written by hand or by another tool loses only that)."""
    raw = extra.get(USE_HISTORY)
    if not isinstance(raw, list) or len(raw) > USE_HISTORY_KEPT:
        return ()
    values = [_number(v) for v in raw]
    if any(v is None for v in values):
        return ()
    out = tuple(v for v in values if v is not None)
    return out if list(out) == sorted(out) else ()


def newer_history(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether use history `a` says more than `b`: a later last use, or as late and more uses
    (two instances whose clocks have not moved apart yet write equal times)."""
    return bool(a) and (not b or (a[-1], len(a)) > (b[-1], len(b)))


def eviction_note(extra: Mapping[str, Any]) -> tuple[int, float] | None:
    """A model record's `meshdEvictedBy` as (order index, fleet clock); None when absent or
    malformed (the reload then charges no order)."""
    raw = extra.get(EVICTED_BY)
    if not isinstance(raw, list) or len(raw) != 2 or raw[0] not in EVICTION_ORDERS:
        return None
    clock = _number(raw[1])
    return None if clock is None else (EVICTION_ORDERS.index(raw[0]), clock)


def regret_reading(extra: Mapping[str, Any]) -> tuple[float, float, float, float] | None:
    """An instance record's `meshdRegret`; None when absent or malformed (four numbers, none
    negative), so one bad record leaves the fleet's sums as the others make them."""
    raw = extra.get(REGRET)
    if not isinstance(raw, list) or len(raw) != 4:
        return None
    values = [_number(v) for v in raw]
    if any(v is None or v < 0 for v in values):
        return None
    a, b, c, d = (v or 0.0 for v in values)
    return (a, b, c, d)


def fleet_reading(extra: Mapping[str, Any]) -> tuple[int, float]:
    """An instance record's (units evicted, fleet clock); zeros when absent or malformed."""
    evicted = _number(extra.get(FLEET_EVICTED))
    clock = _number(extra.get(FLEET_CLOCK))
    return (int(evicted) if evicted is not None and evicted >= 0 else 0, clock if clock is not None else 0.0)


def victim_reading(extra: Mapping[str, Any]) -> float | None:
    """An instance record's `meshdVictim`; None when absent or malformed (placement then
    does without prices)."""
    return _number(extra.get(VICTIM_VALUE))


@dataclass(slots=True)
class InstanceRecord:
    """`<prefix>/<service>/instances/<instanceId>`, attached to the instance's lease."""

    lru_time: int = 0  # lruTime, ms: oldest last-used among loaded models
    count: int = 0  # models loaded
    capacity: int = 0  # cap, 8 KiB units
    used: int = 0  # used, 8 KiB units
    loading_threads: int = 0  # lThreads
    loading_in_progress: int = 0  # lInProg
    rpm: int = 0  # requests per minute
    shutdown: bool = False
    start_time: int = 0  # startTime, ms
    version: int = 0  # vers
    location: str = ""  # loc: host:port peers dial
    zone: str = ""
    labels: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    # Read, not written: the record was written by an upstream (Java) ModelMesh instance.
    upstream: bool = field(default=False, compare=False)

    _NAMES: ClassVar[dict[str, str]] = {
        "lru_time": "lruTime",
        "count": "count",
        "capacity": "cap",
        "used": "used",
        "loading_threads": "lThreads",
        "loading_in_progress": "lInProg",
        "rpm": "rpm",
        "shutdown": "shutdown",
        "start_time": "startTime",
        "version": "vers",
        "location": "loc",
        "zone": "zone",
        "labels": "labels",
    }

    @classmethod
    def decode(cls, data: bytes) -> Self:
        obj = _load_object(data)
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in ("extra", "upstream"):
                continue
            wire = cls._NAMES[f.name]
            default = cls.__dataclass_fields__[f.name].default
            if f.name == "labels":
                labels = _typed(obj.get(wire), wire, list, [])
                if not all(isinstance(x, str) for x in labels):
                    raise RecordError("field 'labels' must be a list of strings")
                values[f.name] = list(labels)
            elif f.name == "shutdown":
                values[f.name] = _typed(obj.get(wire), wire, bool, False)
            else:
                values[f.name] = _typed(obj.get(wire), wire, type(default), default)
        values["extra"] = {k: v for k, v in obj.items() if k not in cls._NAMES.values() and k != MESHD_MARKER}
        values["upstream"] = is_upstream_instance(obj)
        return cls(**values)

    def encode(self) -> bytes:
        known = {
            self._NAMES[f.name]: getattr(self, f.name) for f in fields(self) if f.name not in ("extra", "upstream")
        }
        known[MESHD_MARKER] = MESHD_RECORD_VERSION
        return _dump(known, self.extra)

    @property
    def runtime_down(self) -> bool:
        """meshd only: `shutdown` is set because the runtime does not answer, not for a drain.
        Carried as an extra key, which upstream ignores (it reads `shutdown`)."""
        return self.extra.get(RUNTIME_DOWN) is True


def is_upstream_instance(obj: dict[str, Any]) -> bool:
    """Whether a decoded instance record was written by an upstream (Java) ModelMesh instance.

    meshd writes `"meshd": <record version>` in every instance record; upstream never does.
    meshd before that marker wrote every field, `"shutdown": false` included, which
    upstream's writer never writes (it omits a false). So: no marker and no explicit
    `"shutdown": false` means upstream. (An older meshd while draining, `shutdown` true,
    reads as upstream for its last seconds; both mean "do not route there".)
    """
    return MESHD_MARKER not in obj and obj.get("shutdown") is not False
