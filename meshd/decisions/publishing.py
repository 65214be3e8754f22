"""What this instance's record says and when it is published (SPEC §5, §6), pure.

The record: cache fill, LRU time, loading threads, request rate, identity, and (with a disk
tier) the models on the runtime's disk. Publication:
when it changed materially, at most every 2 s, at least every 40 s while changed, and
right after loads. `judge_stored` says what the mirror's copy of the own record means
(lagging, ours, gone, changed, or another process's). `meshd.registry.instances` does the
writing; the simulator publishes on the same rules.
"""

from __future__ import annotations

import calendar
import dataclasses
import functools
import operator
import re
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from meshd import __version__
from meshd.core.records import (
    DISK_TIER,
    EMPTY_LRU_TIME,
    FLEET_CLOCK,
    FLEET_EVICTED,
    REGRET,
    VICTIM_VALUE,
    InstanceRecord,
)
from meshd.decisions.cache import WeightedLRU

PUBLISH_MIN_INTERVAL_MS = 2_000  # upstream: >= 2 s apart
PUBLISH_MAX_INTERVAL_MS = 40_000  # upstream: every 40 s when changed


# Upstream's service version forms (`-v` of its start.sh: the build-version file or
# SERVICE_VERSION): `<name>-YYYYMMDD-N` and the older `YYYYMMDD-HHMM[-N]`, both numbered as the
# date's epoch milliseconds plus N, so a mixed mesh orders them as upstream does.
_UPSTREAM_VERSION = re.compile(r".+-(\d{8})-(\d+)")
_UPSTREAM_VERSION_OLD = re.compile(r"(\d{8}-\d{4})(?:-(\d+))?")


@functools.lru_cache(maxsize=64)  # read on every record built: a handful of distinct versions
def numeric_version(version: str) -> int:
    """The instance record's `vers`: newer versions compare greater (placement prefers them).

    Upstream's forms as upstream numbers them; otherwise dotted, `1.2.3` -> 10203."""
    for pattern in (_UPSTREAM_VERSION, _UPSTREAM_VERSION_OLD):
        m = pattern.fullmatch(version)
        if m:
            digits = m.group(1).replace("-", "")  # YYYYMMDD or YYYYMMDDHHMM
            y, mo, d = int(digits[:4]), int(digits[4:6]), int(digits[6:8])
            hh, mm = (int(digits[8:10]), int(digits[10:12])) if len(digits) == 12 else (0, 0)
            if not (1 <= mo <= 12 and 1 <= d <= calendar.monthrange(y, mo)[1] and hh < 24 and mm < 60):
                break  # not a date: not upstream's form
            return calendar.timegm((y, mo, d, hh, mm, 0)) * 1000 + int(m.group(2) or 0)
    # ASCII digits only: str.isdigit() also takes '²', which int() refuses.
    parts = [int(p) if p.isascii() and p.isdigit() else 0 for p in version.split(".")[:3]]
    parts += [0] * (3 - len(parts))
    return parts[0] * 10_000 + parts[1] * 100 + parts[2]


@dataclass(frozen=True, slots=True)
class Identity:
    instance_id: str
    location: str  # host:peer_port
    zone: str
    labels: tuple[str, ...]
    start_ms: int
    version: str = __version__  # SERVICE_VERSION; meshd's own by default


def instance_record(
    me: Identity,
    cache: WeightedLRU,
    loading_threads: int,
    loading_in_progress: int,
    rpm: int,
    shutdown: bool,
    now_ms: int,
    disk: Mapping[str, Any] | None = None,
) -> InstanceRecord:
    """`disk`: the runtime's disk tier as the record carries it (`placement.disk.disk_value`;
    None: it has none)."""
    count, lru_ms = cache.loaded_summary(now_ms)
    extra: dict[str, Any] = {FLEET_EVICTED: cache.evicted_units, FLEET_CLOCK: round(cache.clock, 3)}
    victim = cache.victim_value()
    if victim is not None:
        extra[VICTIM_VALUE] = round(victim, 3)
    if cache.regret is not None:  # ADAPTIVE: its part of the fleet's regret
        extra[REGRET] = cache.regret.tally().as_list()
    if disk is not None:
        extra[DISK_TIER] = disk
    return InstanceRecord(
        lru_time=lru_ms if count else EMPTY_LRU_TIME,  # upstream's value when empty
        count=count,
        capacity=cache.capacity_units,
        used=cache.used_units,
        loading_threads=loading_threads,
        loading_in_progress=loading_in_progress,
        rpm=rpm,
        shutdown=shutdown,
        start_time=me.start_ms,
        version=numeric_version(me.version),
        location=me.location,
        zone=me.zone,
        labels=list(me.labels),
        extra=extra,
    )


class RpmMeter:
    """Requests in the last minute, from samples of a running total (no per-request work).

    Counted, not extrapolated: a burst of 3 requests in the first second of an instance's
    life is 3 rpm, not 180 (an extrapolated rate made fresh instances look hot to placement).
    """

    def __init__(self, window_ms: int = 60_000) -> None:
        self.window_ms = window_ms
        self._samples: deque[tuple[int, int]] = deque()

    def rpm(self, total: int, now_ms: int) -> int:
        self._samples.append((now_ms, total))
        # Keep the newest sample at least a window old as the baseline.
        while len(self._samples) > 1 and now_ms - self._samples[1][0] >= self.window_ms:
            self._samples.popleft()
        return total - self._samples[0][1]


# The record's fields that do not drift with every request (all but LRU time, request rate and
# the fleet clock, which moves with peers' evictions), as one getter: compared on every publish
# tick (the simulator makes millions).
_MATERIAL = operator.attrgetter(
    *(f.name for f in dataclasses.fields(InstanceRecord) if f.compare and f.name not in ("lru_time", "rpm", "extra"))
)


_DRIFTING = frozenset((FLEET_CLOCK, VICTIM_VALUE, REGRET))  # the regret decays with every eviction


def material(r: InstanceRecord) -> tuple[Any, ...]:
    """The record without the fields that drift with every request (LRU time, request rate, the
    next victim's value) or with peers' evictions (the fleet clock)."""
    extra = {k: v for k, v in r.extra.items() if k not in _DRIFTING}
    return (*_MATERIAL(r), extra)


def publish_due(last: InstanceRecord | None, new: InstanceRecord, last_ms: int, now_ms: int, forced: bool) -> bool:
    if last is None:
        return True
    if now_ms - last_ms < PUBLISH_MIN_INTERVAL_MS:
        return False
    if forced or material(last) != material(new):
        return True
    return new != last and now_ms - last_ms >= PUBLISH_MAX_INTERVAL_MS


class Stored(Enum):
    """What the instances mirror holds at the own key, against the last record published."""

    LAGGING = "lagging"  # the mirror has not applied the last put yet: no judgement
    OURS = "ours"
    GONE = "gone"  # absent (or corrupt): write it back
    CHANGED = "changed"  # this process's identity, other contents: write it back
    FOREIGN = "foreign"  # another process with this instance id: report, do not fight


def judge_stored(
    last: InstanceRecord, put_revision: int, mirror_revision: int, stored: InstanceRecord | None
) -> Stored:
    if mirror_revision < put_revision:
        return Stored.LAGGING
    if stored is None:
        return Stored.GONE
    if stored == last:
        return Stored.OURS
    # start_time and location together tell processes apart (one port, one start).
    if (stored.start_time, stored.location) != (last.start_time, last.location):
        return Stored.FOREIGN
    return Stored.CHANGED
