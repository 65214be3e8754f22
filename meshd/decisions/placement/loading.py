"""The load queue's rules: which waiting load starts next, when a miss is refused fast.

Pure: plain numbers in, a decision out; no clock but the `now_ms` given. The daemon's load
path (`meshd.serving.local`) and the simulator (`sim/`) both call these (issue 24, "no
congestion collapse"). The rules, in the order a miss meets them:

1. *Room is taken when a load starts, not while it waits.* A load waiting for a loading
   thread holds no room, so copies that are serving are not evicted for a load that cannot
   start yet. (Upstream admits, and evicts, when the load is queued.)
2. *The queue is ordered by value* (`load_value`): requests waiting on the load, plus the
   model's recent popularity, per unit of the room it will take. Not by arrival: a hot model
   that misses does not wait behind a backlog of cold ones. But no load is overtaken for
   longer than `OVERTAKE_LIMIT_MS`: then the longest waiting goes first (`next_load`).
3. *Admission under pressure* (`under_pressure`, `colder_than_victims`): once the waiting
   loads cannot all start within a quarter of the wait limit (`PRESSURE_SHARE_OF_LIMIT`), a
   miss for a model colder than the copies it would evict (by the instance's `Popularity`
   counts) is refused fast instead of queued;
   so is one whose load could not start within half the wait limit (`start_wait_ms`,
   `accepts`), unless it is worth more than the least valuable load queued in the last
   `DISPLACE_WITHIN_MS`, which it displaces (`displaced_by`). A load that has waited longer keeps its place:
   its requests, refused now, would fail slowly, after waiting (`least_valuable`). The refusal
   is RESOURCE_EXHAUSTED, saying why and when to retry (`exhausted_message`).
4. *Placement weighs each instance's queue* (`queue_backlog`): among the near-best
   instances, a load goes where it can start soonest; with a disk tier, where it is ready
   soonest, a pull skipped where the model's files are on disk (`ready_soonest`).
5. *A request's deadline is its patience* (`patience_ms`, `may_queue`): a miss whose request
   has longer left than the wait limit may queue as long as its load could still end in
   time, and its load waits for a thread until the last of its requests' deadlines; one that
   cannot be served in time is refused fast (`within_deadline`). Where loads are slow the
   limit stretches to `LIMIT_IN_LOADS` mean load times: a queue one 25 s load long is not
   "too long" for a runtime whose every load takes 25 s.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence

from meshd.decisions.placement.view import InstanceView

DEFAULT_LOAD_WAIT_LIMIT_MS = 10_000  # a load that cannot start within this is refused (see docs/policies.md)
ACCEPT_SHARE_OF_LIMIT = 0.5  # a load is queued only if it should start within half the limit (headroom
# for hotter loads that overtake it and loads slower than the mean); past the limit it is refused
# Admission under pressure applies once the waiting loads cannot all start within this share of
# the wait limit (2.5 s by default). Measured (docs/policies.md): the issue's "more than the
# threads can clear within the limit" never arises once the queue is bounded at half the limit;
# 0 (whenever a load waits at all) gave the lowest hot-model p99 but refused requests of a mesh
# well within its load capacity (a queue 0.3 s long; the soak and cluster benchmarks).
PRESSURE_SHARE_OF_LIMIT = 0.25
# A waiting load is overtaken by more valuable ones for at most this long; then the longest
# waiting goes first. Value order alone starved cold loads under steady arrivals: with a queue
# 0.8 s long, loads still waited the whole 10 s limit and were refused, and the p99 of
# bench/peers.py went from 1.3 s to 4.7 s (2 s of overtaking: 2.2 s; 0.5 s: 1.3 s).
OVERTAKE_LIMIT_MS = 500
DEFAULT_MEAN_LOAD_MS = 1_000.0  # the mean load time assumed before any load has finished
# The wait limit is at least this many mean load times: with 10-40 s loads, a 10 s limit
# refused every miss that had to wait behind one load (issue 33's held-back trace: requests
# refused that upstream served). Loads of 3.3 s and less keep the 10 s default as it is.
LIMIT_IN_LOADS = 3
LOAD_MS_EWMA_WEIGHT = 0.1  # weight of each finished load in the mean load time
RETRY_AFTER_FLOOR_S = 1
EXHAUSTED_PREFIX = "load capacity exhausted"  # how a refusal for load capacity starts


def load_value(waiting: int, popularity: float, units: int) -> float:
    """A waiting load's claim on the next free loading thread: the requests waiting on it
    plus the model's recent popularity, per unit of room it will take (a big model must be
    worth more to go first). Higher starts sooner."""
    return (waiting + popularity) / max(1, units)


def next_load(
    values: Iterable[tuple[float, int, int]], now_ms: int, overtake_limit_ms: int = OVERTAKE_LIMIT_MS
) -> int | None:
    """The model to start next among `(value, queued_at_ms, model)`: the earliest queued of
    those overtaken for longer than `overtake_limit_ms`, else the highest value, then the
    earliest queued (None when nothing waits)."""
    best: tuple[float, int, int] | None = None
    oldest: tuple[float, int, int] | None = None
    for value, queued_at, model in values:
        if best is None or value > best[0] or (value == best[0] and queued_at < best[1]):
            best = (value, queued_at, model)
        if oldest is None or queued_at < oldest[1]:
            oldest = (value, queued_at, model)
    if oldest is not None and now_ms - oldest[1] > overtake_limit_ms:
        return oldest[2]
    return None if best is None else best[2]


# A waiting load may be displaced only this soon after it was queued. Its requests are then
# refused fast even after the router's retries elsewhere ((1 + MAX_BUSY_RETRIES) x 250 ms is
# under the simulator's 1 s bar for a fast refusal). Measured (docs/policies.md): displacing
# any waiting load made 8-16 % of overload failures slow ones; with this, none, at the same
# hit ratio and about as many failures.
DISPLACE_WITHIN_MS = 250


def least_valuable(
    values: Iterable[tuple[float, int, int]], now_ms: int, within_ms: int = DISPLACE_WITHIN_MS
) -> int | None:
    """The waiting load a more valuable one displaces from a full queue, among
    `(value, queued_at_ms, model)` queued at most `within_ms` before `now_ms`: the lowest
    value, then the latest queued (None: nothing young enough to give way)."""
    worst = _least_valuable(values, now_ms, within_ms)
    return None if worst is None else worst[2]


def displaced_by(value: float, values: Iterable[tuple[float, int, int]], now_ms: int) -> int | None:
    """The waiting load a miss worth `value` takes the place of in a full queue (among
    `(value, queued_at_ms, model)`): the least valuable one young enough to give way, if it
    is worth less than the newcomer. None: the newcomer is refused instead."""
    worst = _least_valuable(values, now_ms, DISPLACE_WITHIN_MS)
    return worst[2] if worst is not None and worst[0] < value else None


def _least_valuable(
    values: Iterable[tuple[float, int, int]], now_ms: int, within_ms: int
) -> tuple[float, int, int] | None:
    worst: tuple[float, int, int] | None = None
    for value, queued_at, model in values:
        if now_ms - queued_at > within_ms:
            continue
        if worst is None or value < worst[0] or (value == worst[0] and queued_at > worst[1]):
            worst = (value, queued_at, model)
    return worst


# A load whose last use is this recent when it is queued was asked for by requests (a
# background placement is dated at the model's last use). Not "at or after the queueing":
# the request's clock was read before the load was queued, and a peer's before the hop.
ASKED_BY_REQUESTS_MS = 1_000


def admission_date(last_used_ms: int, queued_ms: int, started_ms: int) -> int:
    """The last use a load is admitted at when it gets a thread: now (`started_ms`) if
    requests asked for it, so copies used while it waited do not refuse it room; otherwise
    the older date it was asked with."""
    return started_ms if last_used_ms >= queued_ms - ASKED_BY_REQUESTS_MS else last_used_ms


def update_mean_load_ms(mean_ms: float, took_ms: float, finished_before: int = 1_000) -> float:
    """The mean load time after a load that took `took_ms`, `finished_before` loads having
    finished before it: their plain mean until there are 1 / LOAD_MS_EWMA_WEIGHT of them, then
    a moving mean. The assumed `DEFAULT_MEAN_LOAD_MS` counts for nothing once one load has
    finished: with a fixed weight it stayed 3.6x the real 117 ms after ten loads, and a cold
    start's misses were refused as if the queue needed 6 s (bench/peers.py's warm-up)."""
    weight = max(LOAD_MS_EWMA_WEIGHT, 1.0 / (finished_before + 1))
    return mean_ms + weight * (took_ms - mean_ms)


def start_wait_ms(ahead: int, running: int, threads: int, mean_load_ms: float) -> float:
    """How long until a load with `ahead` queued loads before it gets a thread, with
    `running` loads under way on `threads` threads, each taking `mean_load_ms`."""
    threads = max(1, threads)
    busy = running + ahead
    if busy < threads:
        return 0.0
    return (busy - threads + 1) / threads * mean_load_ms


def accepts(wait_ms: float, wait_limit_ms: float) -> bool:
    """Whether a load expected to start in `wait_ms` may join the queue."""
    return wait_ms <= wait_limit_ms * ACCEPT_SHARE_OF_LIMIT


def wait_limit(wait_limit_ms: float, mean_load_ms: float) -> float:
    """The wait limit in force: the configured one, or `LIMIT_IN_LOADS` mean load times when
    that is longer (slow loads)."""
    return max(wait_limit_ms, LIMIT_IN_LOADS * mean_load_ms)


def patience_ms(wait_limit_ms: float, mean_load_ms: float, budget_ms: float | None) -> float:
    """How long a load asked for by a request with `budget_ms` left (None: no deadline) may
    wait for a thread: the wait limit in force (`wait_limit`), or the request's deadline when
    that is longer (its client said it would wait)."""
    limit = wait_limit(wait_limit_ms, mean_load_ms)
    return limit if budget_ms is None else max(limit, budget_ms)


def may_queue(wait_ms: float, mean_load_ms: float, wait_limit_ms: float, budget_ms: float | None) -> bool:
    """Whether a miss whose load would start in `wait_ms` may join the queue (else it takes a
    less valuable load's place or is refused). A request with longer left than the wait limit
    may, if its load could end in time (`within_deadline`); one without, or with less, if the
    load should start within half the limit in force (`accepts`)."""
    limit = wait_limit(wait_limit_ms, mean_load_ms)
    if budget_ms is not None and budget_ms > limit:
        return within_deadline(wait_ms, mean_load_ms, budget_ms)
    return accepts(wait_ms, limit)


def soonest_end_ms(wait_ms: float, mean_load_ms: float) -> float:
    """The soonest a load expected to start in `wait_ms` can end: the loads under way may be
    nearly done (so one load's time less to wait), then it takes about `mean_load_ms` itself.
    Optimistic on purpose: `start_wait_ms` counts each running load as just started."""
    return max(wait_ms, mean_load_ms)


def within_deadline(wait_ms: float, mean_load_ms: float, budget_ms: float | None) -> bool:
    """Whether a load that must wait `wait_ms` for a thread could end within the `budget_ms`
    its request has left (None: no deadline), at the soonest (`soonest_end_ms`). A load that
    starts at once always may: its request may time out, but the copy serves the next ones; a
    load that would only queue behind others to end after its caller left holds a place others need."""
    return budget_ms is None or wait_ms <= 0 or soonest_end_ms(wait_ms, mean_load_ms) <= budget_ms


class Verdict(enum.Enum):
    """What the queue says to a miss (`queue_verdict`), before the admission test."""

    JOIN = "join"  # it may wait for a loading thread
    LATE = "late"  # its load could not end before its request's deadline: refused at once
    FULL = "full"  # past the wait limit in force: it takes a less valuable load's place, or is refused


def queue_verdict(wait_ms: float, mean_load_ms: float, wait_limit_ms: float, budget_ms: float | None) -> Verdict:
    """The first two rules a miss meets, in order: its deadline (`within_deadline`), then the
    wait limit or its patience (`may_queue`). The daemon and the simulator both ask this."""
    if not within_deadline(wait_ms, mean_load_ms, budget_ms):
        return Verdict.LATE
    if not may_queue(wait_ms, mean_load_ms, wait_limit_ms, budget_ms):
        return Verdict.FULL
    return Verdict.JOIN


def pressed(waiting: int, threads: int, mean_load_ms: float, wait_limit_ms: float, budget_ms: float | None) -> bool:
    """Whether a queue holding `waiting` loads is under pressure for one more, asked for by a
    request with `budget_ms` left: pressure is judged against its patience (`patience_ms`)."""
    return under_pressure(waiting + 1, threads, mean_load_ms, patience_ms(wait_limit_ms, mean_load_ms, budget_ms))


def under_pressure(queued: int, threads: int, mean_load_ms: float, wait_limit_ms: float) -> bool:
    """Whether `queued` waiting loads (the new one included) cannot all start within
    `PRESSURE_SHARE_OF_LIMIT` of `wait_limit_ms`."""
    return queued * mean_load_ms / max(1, threads) > wait_limit_ms * PRESSURE_SHARE_OF_LIMIT


def colder_than_victims(popularity: float, waiting: int, victims: Sequence[float]) -> bool:
    """Whether a model (its popularity count plus the requests waiting on it) is colder than
    the copies its load would evict, taken together: under pressure, such a miss does not
    evict them (TinyLFU's admission test, over the whole set of victims)."""
    return bool(victims) and popularity + waiting <= sum(victims)


# A peer's loads in progress as its answer said (`meshd-loads`) count over its record for this
# long: records are published at most every 2 s, and a busy mesh answers many times a second.
FRESH_LOADS_MS = 1_000


def fresh_loads(
    reported: Mapping[str, tuple[int, int]], now_ms: int, within_ms: int = FRESH_LOADS_MS
) -> dict[str, int]:
    """The loads in progress to place by, from `reported` (instance -> (loads, when said, ms)):
    those said within `within_ms` before `now_ms`; older ones give way to the records."""
    return {iid: loads for iid, (loads, at) in reported.items() if now_ms - at <= within_ms}


def queue_backlog(inst: InstanceView) -> int:
    """Loads on `inst` beyond its loading threads (its record's loads in progress include
    those waiting for a thread): 0 means a new load starts at once."""
    return max(0, inst.loading_in_progress - inst.loading_threads + 1)


def soonest_start(candidates: Sequence[InstanceView]) -> list[InstanceView]:
    """The candidates where a load starts soonest (the shortest queue)."""
    if len(candidates) < 2:
        return list(candidates)
    # queue_backlog inlined: once per candidate per placement, a tenth of this module's calls
    backlogs = [b if (b := c.loading_in_progress - c.loading_threads + 1) > 0 else 0 for c in candidates]
    least = min(backlogs)
    return [c for c, b in zip(candidates, backlogs, strict=True) if b == least]


def ready_soonest(
    candidates: Sequence[InstanceView], model_id: str, pull_ms: float | None, mean_load_ms: float
) -> list[InstanceView]:
    """`soonest_start`, counting the pull a load skips where the model's files are on disk
    (issue 42's disk tier): a load is ready after its wait for a thread, its pull (none where
    the files are) and the runtime's load, the same everywhere. The instances holding the files
    (`InstanceView.disk`) win when the soonest of them starts no later than the soonest of the
    others plus the pull, and then the one of them that starts soonest is taken; else the
    others are, as `soonest_start` takes them. A wait is the loads ahead of it per thread, at
    `mean_load_ms` each. Without a pull estimate (`pull_ms` None or 0), or with the files on
    none or every candidate: `soonest_start`."""
    if not pull_ms or pull_ms <= 0 or len(candidates) < 2:
        return soonest_start(candidates)
    holders: list[InstanceView] = []
    others: list[InstanceView] = []
    for c in candidates:
        (holders if c.disk is not None and model_id in c.disk else others).append(c)
    if not holders or not others:
        return soonest_start(candidates)
    if min(_start_ms(h, mean_load_ms) for h in holders) <= min(_start_ms(o, mean_load_ms) for o in others) + pull_ms:
        return soonest_start(holders)
    return soonest_start(others)


def _start_ms(inst: InstanceView, mean_load_ms: float) -> float:
    """How long until a load placed on `inst` now would start, by its queue."""
    return queue_backlog(inst) * mean_load_ms / max(1, inst.loading_threads)


def retry_after_s(wait_ms: float) -> int:
    """Seconds a refused client should wait before retrying: the queue's backlog, at least 1."""
    return max(RETRY_AFTER_FLOOR_S, math.ceil(wait_ms / 1000))


def exhausted_message(model_id: str, reason: str, wait_ms: float) -> str:
    """The RESOURCE_EXHAUSTED message of a miss refused for load capacity."""
    return (
        f"{EXHAUSTED_PREFIX}: cannot load {model_id!r} now: {reason}; the load queue needs about "
        f"{wait_ms / 1000:.1f} s to clear, retry after {retry_after_s(wait_ms)} s"
    )
