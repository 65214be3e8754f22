"""How the storage helper moves bytes: the parts of an object, the retries of a part, the
stall rule, and the disk tier's admission and eviction order.

Pure: no I/O, no clock (times come in as `now_ms`). The pull engine (`meshd.storage.pull`)
asks and does; the tier's index is the memory cache's own class (`WeightedLRU`, RATE order:
a model's value = its use rate x its pull time per unit of disk), so disk and memory keep
models by one rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from meshd.decisions.cache import UNIT_BYTES, Eviction, State, WeightedLRU, to_units

MIB = 1 << 20
# Ranged GETs: 16 MiB parts, up to 16 at once per model (the speed anchors in
# docs/storage.md: 8-64 parallel ranged GETs of 8-64 MiB saturate a link; s3transfer uses
# 8 MiB x 10, s5cmd 50 MiB x 5). Objects below PART_THRESHOLD go in one GET.
PART_BYTES = 16 * MIB
PART_THRESHOLD = 32 * MIB
MAX_PARTS_IN_FLIGHT = 16
RETRIES_PER_PART = 5  # s3transfer's 5 download attempts
BACKOFF_BASE_MS = 200
BACKOFF_CAP_MS = 10_000
STALL_TIMEOUT_MS = 60_000  # a pull fails after this long without a byte arriving (MESHD_PULL_STALL_MS)
DISK_BUDGET_SHARE = 0.8  # MESHD_DISK_CACHE_BYTES' default: this share of the model volume
# A cached GCS/Azure token is fetched anew this long before it expires (azure-identity
# refreshes 5 minutes before; google-auth 3 min 45 s), so no request carries one that lapses.
TOKEN_REFRESH_MARGIN_S = 300.0
# Room a pull leaves over before it may create its files as it goes (`allocate_first`).
ALLOCATE_HEADROOM_BYTES = 1 << 30
# Objects fetched in one GET each (a folder of small files): workers at the start of a pull and
# at most (`ObjectWorkers`). 4: on loopback 4 beat 16 in each of five runs (3-12 %, fewer GIL
# hand-overs, docs/storage.md); 64: a store 30 ms from the first byte keeps ~20 busy here, and
# more on faster cores (s5cmd's default is 256, s3transfer's 10).
OBJECTS_START = 4
OBJECTS_CAP = 64
# Cores the workers keep busy (their CPU seconds over their wall seconds, summed) when Python
# is the limit: measured 1.2-1.6 (windows of 16 objects; 1.0 in the first, which opens the
# connections) for 4 workers on loopback here: the GIL's one core plus the kernel's work on the
# syscalls made without it. Below half of it the workers are waiting on the store: 4 of them
# kept 0.32 busy at 20 ms to the first byte.
BUSY_CORES = 1.5
WAITING_SHARE = 0.5
# Workers grown to this many times what Little's law says keeps BUSY_CORES busy: too few
# costs in proportion (each missing worker is a store wait not overlapped), too many only a
# few per cent (16 against 4 on loopback: 3-12 %).
GROW_HEADROOM = 1.5
# Objects measured before a decision: enough that one slow file (a cold inode, a preempted
# thread) does not look like a slow store.
MIN_SAMPLES = 16


@dataclass(frozen=True)
class Part:
    start: int
    end: int  # inclusive, as an HTTP Range says

    @property
    def size(self) -> int:
        return self.end - self.start + 1

    def header(self) -> str:
        return f"bytes={self.start}-{self.end}"


def plan_parts(size: int, part_bytes: int = PART_BYTES, threshold: int = PART_THRESHOLD) -> tuple[Part, ...]:
    """The ranged GETs for an object of `size` bytes: one for a small object (or none for an
    empty one), else `part_bytes` parts, the last one shorter."""
    if size < 0 or part_bytes < 1:
        raise ValueError("bad size or part size")
    if size == 0:
        return ()
    if size < threshold:
        return (Part(0, size - 1),)
    return tuple(Part(s, min(s + part_bytes, size) - 1) for s in range(0, size, part_bytes))


class Failure:
    """Kinds of a failed request, each with its retry rule."""

    AUTH = "auth"  # 401/403, bad signature: a retry would fail again (and storm the store)
    NOT_FOUND = "not_found"  # 404: the bucket or object is not there
    TRANSIENT = "transient"  # 5xx, 429, a dropped connection, a short body: retry
    TLS = "tls"  # an untrusted or bad certificate
    DISK = "disk"  # no space left here
    BAD = "bad"  # any other 4xx


def classify_status(status: int) -> str:
    if status in (401, 403):
        return Failure.AUTH
    if status == 404:
        return Failure.NOT_FOUND
    if status == 429 or status == 408 or status >= 500:
        return Failure.TRANSIENT
    return Failure.BAD


def retryable(kind: str) -> bool:
    return kind == Failure.TRANSIENT


def backoff_ms(attempt: int, jitter: float, base_ms: int = BACKOFF_BASE_MS, cap_ms: int = BACKOFF_CAP_MS) -> int:
    """The wait before retry `attempt` (1-based): exponential, capped, `jitter` in [0, 1)
    spreading it over its upper half so parts retried together do not hit the store together."""
    top = min(cap_ms, base_ms * (1 << min(attempt - 1, 20)))
    return int(top / 2 + top / 2 * jitter)


def stalled(last_progress_ms: int, now_ms: int, stall_ms: int = STALL_TIMEOUT_MS) -> bool:
    """A pull times out only while it makes no progress (upstream's counted the whole download
    against the load timeout: modelmesh-serving#219, #369)."""
    return now_ms - last_progress_ms > stall_ms


def default_budget(volume_bytes: int, share: float = DISK_BUDGET_SHARE) -> int:
    return max(UNIT_BYTES, int(volume_bytes * share))


def token_fresh(fetched_s: float, expires_s: float, now_s: float, margin_s: float = TOKEN_REFRESH_MARGIN_S) -> bool:
    """Whether a token fetched at `fetched_s`, lapsing at `expires_s`, may still be used at
    `now_s`: until the margin before it lapses, or half its life for one shorter than twice the
    margin (so a short-lived token is still used more than once)."""
    margin = min(margin_s, (expires_s - fetched_s) / 2)
    return fetched_s <= now_s < expires_s - margin


def allocate_first(
    free_bytes: int, need_bytes: int, pulling_bytes: int = 0, headroom_bytes: int = ALLOCATE_HEADROOM_BYTES
) -> bool:
    """Whether a pull creates and preallocates every file before its first GET (True), or
    lets each download worker create its own file as it starts on it (False).

    Allocating first makes a disk that fills under the pull refuse it before a byte moves,
    but costs time one file after another (1,000 small files: +0.1 s on a journaled ext4,
    +0.4-0.6 s on this project's journal-less VM disk; docs/storage.md); created by the
    workers, that time overlaps the GETs. A disk that
    fills anyway fails either way cleanly (nothing left behind); the difference is only the
    bytes moved for nothing. So: as the workers go only where the volume's free space covers
    the other pulls in progress (`pulling_bytes`, not yet written), this pull twice over (as
    much again from any other writer during it) and a headroom; else first."""
    return free_bytes < pulling_bytes + 2 * need_bytes + headroom_bytes


class ObjectWorkers:
    """How many workers fetch a pull's single-GET objects at once, adapted to the store.

    By Little's law the workers that keep the CPU busy are (time an object takes: waiting for
    its first byte, then its bytes) / (CPU an object costs) per core: few where the store
    answers at once (loopback: Python is the limit, and more workers only hand the GIL over
    more), many where each object waits on the store (a remote one's 10-30 ms to the first
    byte). The pull starts with `start`; the workers report each object's wall and CPU
    seconds (`done`); after each `MIN_SAMPLES` objects (or a round of the current workers,
    when more), if the workers kept less than `WAITING_SHARE` of `BUSY_CORES` busy, the
    objects' wait dominates and they grow: to twice as many, or to `GROW_HEADROOM` times
    Little's count for `BUSY_CORES` when more. Never beyond `cap`, never beyond the objects
    left, never shrinking (a worker the store kept waiting once costs little more than a
    thread)."""

    def __init__(self, objects: int, start: int = OBJECTS_START, cap: int = OBJECTS_CAP) -> None:
        if objects < 0 or start < 1 or cap < start:
            raise ValueError("bad object count, start or cap")
        self.cap = cap
        self.workers = max(1, min(start, objects))
        self._wall = 0.0
        self._cpu = 0.0
        self._seen = 0

    def done(self, wall_s: float, cpu_s: float, left: int) -> int:
        """One object fetched, in `wall_s` seconds of which `cpu_s` its worker's CPU; `left`
        objects not yet started. Returns how many workers to add now (0 mostly)."""
        self._wall += max(0.0, wall_s)
        self._cpu += max(0.0, cpu_s)
        self._seen += 1
        if self._seen < max(MIN_SAMPLES, self.workers):
            return 0
        wall, cpu = self._wall, self._cpu
        self._wall = self._cpu = 0.0
        self._seen = 0
        if wall <= 0.0 or self.workers * cpu / wall >= WAITING_SHARE * BUSY_CORES or self.workers >= self.cap:
            return 0
        little = math.inf if cpu <= 0.0 else GROW_HEADROOM * BUSY_CORES * wall / cpu
        grown = min(self.cap, self.workers + max(0, left), max(2 * self.workers, math.ceil(min(little, self.cap))))
        added = max(0, grown - self.workers)
        self.workers += added
        return added


# ---- the disk tier -------------------------------------------------------------------


@dataclass(frozen=True)
class DiskAdmission:
    admitted: bool
    evict: tuple[str, ...] = ()
    reason: str = ""


@dataclass(frozen=True)
class DiskEntry:
    model_id: str
    size_bytes: int
    pull_ms: int
    last_used_ms: int
    complete: bool


class DiskTier:
    """Which models' files the disk keeps, under a byte budget, evicted in the memory cache's
    value order. Models the runtime holds, and pulls in progress, are never evicted."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < UNIT_BYTES:
            raise ValueError(f"a disk budget must be at least {UNIT_BYTES} bytes")
        self.budget_bytes = budget_bytes
        self._lru = WeightedLRU(max(1, budget_bytes // UNIT_BYTES), Eviction.RATE)
        self._sizes: dict[str, int] = {}
        self._pull_ms: dict[str, int] = {}
        self.version = 0

    @property
    def used_bytes(self) -> int:
        return sum(self._sizes.values())

    def __contains__(self, model_id: str) -> bool:
        return model_id in self._sizes

    def complete(self, model_id: str) -> bool:
        entry = self._lru.get(model_id)
        return entry is not None and entry.state is State.LOADED

    def admit(self, model_id: str, size_bytes: int, now_ms: int, held: Iterable[str] = ()) -> DiskAdmission:
        """Room for a pull of `size_bytes`: what to evict first, or why it cannot fit (nothing
        changes when refused). `held`: models the runtime has loaded from this disk."""
        if model_id in self._sizes:
            return DiskAdmission(False, reason="already on disk or being pulled")
        if size_bytes > self.budget_bytes:
            return DiskAdmission(
                False, reason=f"needs {size_bytes} bytes, more than the disk budget of {self.budget_bytes}"
            )
        got = self._lru.admit(model_id, to_units(size_bytes), now_ms, now_ms, keep=frozenset(held))
        if not got.admitted:
            return DiskAdmission(
                False,
                reason=f"needs {size_bytes} bytes; the disk budget of {self.budget_bytes} is held by "
                "models in use or being pulled",
            )
        evicted = tuple(e.model_id for e in got.evicted)
        for mid in evicted:
            self._sizes.pop(mid, None)
            self._pull_ms.pop(mid, None)
        self._sizes[model_id] = size_bytes
        self.version += 1
        return DiskAdmission(True, evicted)

    def done(self, model_id: str, size_bytes: int, pull_ms: int, now_ms: int) -> None:
        """The pull finished: its files are complete, weighing `size_bytes`."""
        if model_id not in self._sizes:
            return
        self._sizes[model_id] = size_bytes
        self._pull_ms[model_id] = pull_ms
        self._lru.resize(model_id, to_units(size_bytes))
        self._lru.set_state(model_id, State.LOADED, now_ms, load_ms=float(max(1, pull_ms)))
        self.version += 1

    def restore(self, model_id: str, size_bytes: int, pull_ms: int, last_used_ms: int) -> bool:
        """A complete model found on disk at start-up; False when the budget has no room
        for it (the caller deletes it)."""
        if model_id in self._sizes or to_units(size_bytes) > self._lru.free_units:
            return False
        self.admit(model_id, size_bytes, last_used_ms)
        self.done(model_id, size_bytes, pull_ms, last_used_ms)
        return True

    def touch(self, model_id: str, now_ms: int) -> None:
        self._lru.touch(model_id, now_ms)

    def drop(self, model_id: str) -> None:
        if self._sizes.pop(model_id, None) is not None:
            self._pull_ms.pop(model_id, None)
            self._lru.remove(model_id)
            self.version += 1

    def entries(self) -> list[DiskEntry]:
        out = []
        for mid, size in sorted(self._sizes.items()):
            entry = self._lru.get(mid)
            assert entry is not None
            out.append(DiskEntry(mid, size, self._pull_ms.get(mid, 0), entry.last_used_ms, self.complete(mid)))
        return out
