"""The discrete-event mesh: meshd's decision code driven on a virtual clock.

Owns the simulated fleet (instances with a cache, loading threads and a load queue), the
model records (which instances hold a copy, since when), the event queues (load
completions, request completions, record publication, rate checks) and the counts a run
reports. Every decision is meshd's own, called as the daemon calls it:

- which copy serves: `placement.serving.choose_copy` (router), with the in-flight counts
  the router keeps: per instance, the requests it forwarded to each peer and has not seen
  answered (waiting for the peer's load, queued at its gate, or running);
- where a miss loads: `placement.rank.choose_load` (and `stays`, at the target) with `RecentPlacements` (router);
- what to admit and evict: `cache.WeightedLRU` (local), LRFU, GDSF or LRU;
- a copy's concurrency limit (`Fleet.max_concurrency`, the runtime's maxConcurrency):
  `gate.on_arrival` (run, queue first come first served, or refuse) with `gate.queue_bound`;
  a refused request reroutes as `Router._route` does, at most `MAX_BUSY_RETRIES` times,
  then fails with RESOURCE_EXHAUSTED (counted in `failed` and `rejected`);
- what each instance publishes and when: `instances.instance_record`, `publish_due`,
  `RpmMeter`; decisions read the published records, so they lag as they do in a mesh;
- copy scaling: `placement.scaling.decide_copies` (scaler), every rate-check interval, with
  `scaling.gated_rate` fed by each gated copy's queue and service sums, as the scaler does,
  and the recent-load hold (`scaling.recent_load_window_ms`) from each instance's learnt
  assume-loaded time;
- the disk tier (issue 42, `Fleet.pull_ms_per_gib`, `Fleet.disk_units`): a load pulls its
  model's files first (its size at the pull rate) unless its instance's disk holds them; the
  disk keeps pulled files in the memory cache's value order (a `WeightedLRU` of its budget,
  a use being a load from it), its records carry `placement.disk.disk_value`, and placement
  gets `disk.pull_estimate_ms` from them, as the daemon's router does.

Requests take their model's mean service time (`Catalogue.service_ms`) times a log-normal
jitter (`Fleet.service_jitter`), and occupy the copy meanwhile. Added latency is what meshd
adds (waits for loads and for a gate slot, peer hops); total latency adds the service time.
A request that takes no time (mean 0, or `Fleet.service_time` off) completes at once, with no
completion event, so zero service time gives exactly the results of `service_time` off. (The
engine before service time also ignored the in-flight counts of requests forwarded to a
peer that is loading the model; counting them, as the router does, can break ties between
copies differently.) A forward served by an ungated copy needs no completion event either:
the origin settles its in-flight count from its `answers` heap when it next routes.

What is simplified, on purpose: peers never fail; a load never fails or times out; model
records change at once (etcd writes take milliseconds, far below anything measured here); a
request waiting for room that the cache then refuses for good, or that waits longer than the
load timeout, counts as failed instead of being rerouted; a request never times out in a
gate's queue; an evicted copy finishes the requests it holds (as the daemon's unload waits
for them) but takes no new ones. Also, where the engine knows more than the daemon or acts
on a coarser grid:
- sizes are known up front: placement and admission use a model's real size, where the
  daemon uses the size hint (or the runtime's default) until the runtime reports it;
- records are published on a fixed grid of `Fleet.publish_ms` (2 s); the daemon checks every
  0.5 s and publishes at least 2 s apart, so a change can reach placement up to 1.5 s later here;
- a load waiting for room is retried with the model's last request anywhere; the daemon
  retries with the newest request that joined that load on that instance;
- the leader's preload of recently used models into free room, and the janitor, do not run.
"""

from __future__ import annotations

import heapq
import math
import random
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from meshd.core.records import USE_HISTORY_KEPT, InstanceRecord
from meshd.decisions.cache import UNIT_BYTES, Admission, CacheEntry, Popularity, State, WeightedLRU
from meshd.decisions.fleet_clock import FleetClock
from meshd.decisions.gate import Arrival, on_arrival, queue_bound
from meshd.decisions.placement.disk import GIB, disk_value, pull_estimate_ms
from meshd.decisions.placement.loading import (
    DEFAULT_LOAD_WAIT_LIMIT_MS,
    DEFAULT_MEAN_LOAD_MS,
    Verdict,
    admission_date,
    colder_than_victims,
    displaced_by,
    load_value,
    next_load,
    patience_ms,
    pressed,
    queue_verdict,
    start_wait_ms,
    update_mean_load_ms,
)
from meshd.decisions.placement.rank import (
    DEFAULT_LOADING_TIMEOUT_MS,
    LoadRequest,
    Placement,
    PriceOffer,
    RecentPlacements,
    background_load_used_ms,
    choose_load,
    eligible,
    load_here_as_last_resort,
    load_price,
    stays,
)
from meshd.decisions.placement.scaling import (
    DEFAULT_CONC_SCALEUP_BANDWIDTH_PCT,
    DEFAULT_POLICY,
    DEFAULT_SCALE_UP_RPM_THRESHOLD,
    RATE_CHECK_INTERVAL_MS,
    QueueSample,
    copy_rpm,
    decide_copies,
    gated_rate,
    recent_load_window_ms,
)
from meshd.decisions.placement.serving import (
    MAX_ATTEMPTS,
    MAX_BUSY_RETRIES,
    AssumeLoaded,
    assume_loaded_ms,
    choose_copy,
)
from meshd.decisions.placement.view import ClusterView, InstanceView
from meshd.decisions.publishing import PUBLISH_MIN_INTERVAL_MS, Identity, RpmMeter, instance_record, publish_due
from meshd.decisions.regret import Tally, fleet_order
from sim.policies import Policy
from sim.workloads import Workload

IDLE_GAP_MS = 3_600_000  # idle longer than this is crossed in one step
FAST_REFUSAL_MS = 1_000  # a failure later than this after arrival counts as slow (`Result.failed_slow`)
EPOCH_MS = 1_700_000_000_000  # virtual time starts here: records carry epoch ms


@dataclass(frozen=True, slots=True)
class Fleet:
    """The simulated instances, all alike. `capacity_units`: each instance's cache (8 KiB units)."""

    instances: int
    capacity_units: int
    loading_threads: int = 1
    hop_ms: float = 1.0  # added latency of a peer hop (DESIGN.md: ~0.5-0.8 ms per hop here)
    load_jitter: float = 0.25  # sigma of the log-normal factor on each load's mean time
    default_model_units: int | None = None  # the runtime's default model size (None: median model)
    rate_check_ms: int = RATE_CHECK_INTERVAL_MS
    scaleup_rpm_threshold: int = DEFAULT_SCALE_UP_RPM_THRESHOLD
    loading_timeout_ms: int = DEFAULT_LOADING_TIMEOUT_MS
    publish_ms: int = PUBLISH_MIN_INTERVAL_MS
    seed: int = 0
    service_time: bool = True  # False: requests take no time (the catalogue's service_ms ignored)
    service_jitter: float = 0.5  # sigma of the log-normal factor on each request's mean service time
    max_concurrency: int = 0  # per copy (the runtime's maxConcurrency); 0: unlimited, no gate
    max_queue: int = 0  # waiters per gated copy: MM_MAX_INFLIGHT_PER_MODEL_COPY (0 auto, < 0 unbounded)
    scaleup_bandwidth_pct: int = DEFAULT_CONC_SCALEUP_BANDWIDTH_PCT
    load_wait_limit_ms: int = DEFAULT_LOAD_WAIT_LIMIT_MS  # Policy.load_queue: longest a load may wait to start
    client_timeout_ms: int = 0  # each request's deadline after its arrival (0: none; `Result.late`)
    # Issue 42's disk tier: a load that does not find its model's files on the instance's disk
    # pulls them first, `pull_ms_per_gib` per GiB of the model (0: pulls not modelled, every
    # load takes its catalogue time alone); `disk_units` is each instance's disk budget for
    # pulled files, kept after unload (0: no tier, every load pulls)
    pull_ms_per_gib: float = 0.0
    disk_units: int = 0

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ValueError("a fleet needs at least one instance")
        if self.capacity_units < 1:
            raise ValueError("instance capacity must be at least one unit")
        if self.loading_threads < 1:
            raise ValueError("loading threads must be at least 1")
        if self.max_concurrency < 0:
            raise ValueError("max concurrency must be 0 (unlimited) or more")
        if not self.service_jitter >= 0 or not self.load_jitter >= 0:
            raise ValueError("jitter (a log-normal sigma) must be 0 or more")
        if self.client_timeout_ms < 0:
            raise ValueError("a client deadline must be 0 (none) or more milliseconds")
        if not (self.pull_ms_per_gib >= 0 and math.isfinite(self.pull_ms_per_gib)):
            raise ValueError("a pull time per GiB must be 0 (no pulls) or more milliseconds")
        if self.disk_units < 0:
            raise ValueError("a disk budget must be 0 (no disk tier) or more units")


@dataclass(slots=True)
class Result:
    policy: str
    workload: str
    instances: int
    capacity_units: int  # per instance
    requests: int = 0  # counted (after warm-up)
    hits: int = 0  # served by a copy loaded when the request arrived
    local_hits: int = 0  # ... on the instance the request arrived at
    loads: int = 0
    evictions: int = 0
    failed: int = 0  # no answer: no room, or refused by every copy's gate (incl. `rejected`)
    duration_ms: int = 0
    added_p50_ms: float = 0.0  # latency meshd added: waits for loads and gate slots, peer hops
    added_p99_ms: float = 0.0
    added_mean_ms: float = 0.0
    loads_per_minute: list[int] = field(default_factory=list)
    rejected: int = 0  # RESOURCE_EXHAUSTED: every copy tried had a full gate queue
    queued: int = 0  # requests that waited for a slot at a copy's gate
    total_p50_ms: float = 0.0  # added latency plus the service time
    total_p99_ms: float = 0.0
    total_mean_ms: float = 0.0
    # The load queue and what it costs (issue 24): loads that waited for a loading thread,
    # their wait, copies evicted while in use (a request in the last minute), and the
    # added p99 of requests for the hottest 10 % of models (by requests in the trace).
    loads_queued: int = 0
    load_wait_mean_ms: float = 0.0
    load_wait_p99_ms: float = 0.0
    evicted_in_use: int = 0
    hot_added_p99_ms: float = 0.0
    repriced: int = 0  # loads a peer refused for price or queue (placement by price): placed again
    refused_fast: int = 0  # Policy.load_queue: misses refused at once (RESOURCE_EXHAUSTED), counted in `failed`
    failed_slow: int = 0  # failed after waiting more than FAST_REFUSAL_MS (the rest were refused at once)
    late: int = 0  # with Fleet.client_timeout_ms: served, but answered after the client's deadline
    pulls: int = 0  # with Fleet.pull_ms_per_gib: loads that pulled their model's files first
    disk_loads: int = 0  # ... and loads that found them on the instance's disk tier (no pull)

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def loads_per_min(self) -> float:
        minutes = self.duration_ms / 60_000
        return self.loads / minutes if minutes > 0 else float(self.loads)


class _Gate:
    """A copy's concurrency gate (meshd.decisions.gate.CopyGate on the virtual clock) and the sums the
    scaler samples. Requests hold a reference, so an evicted copy finishes its queue."""

    __slots__ = ("bound", "completed", "inst", "limit", "model", "queue", "queue_ms", "queued", "running", "service_ms")

    def __init__(self, inst: int, model: int, limit: int, bound: int | None) -> None:
        self.inst = inst
        self.model = model
        self.limit = limit
        self.bound = bound
        self.running = 0
        self.queue: deque[tuple[float, float, int, bool]] = deque()  # (queued at, arrival, origin, forwarded)
        self.completed = 0
        self.service_ms = 0.0
        self.queued = 0
        self.queue_ms = 0.0

    def sums(self) -> QueueSample:
        return QueueSample(self.limit, self.completed, self.service_ms, self.queued, self.queue_ms)


# A request being served: (done at, seq, gate, holder, model, origin, forwarded, service ms).
_Done = tuple[float, int, "_Gate | None", int, int, int, bool, float]


class _Instance:
    __slots__ = (
        "answers",
        "assume_loaded",
        "blocked",
        "cache",
        "changed_since_publish",
        "checked",
        "disk",
        "disk_record",
        "disk_version",
        "fleet_clock",
        "gate_sums",
        "gates",
        "identity",
        "index",
        "inflight",
        "initiated",
        "instance_id",
        "loading",
        "loads_finished",
        "mean_load_ms",
        "patience",
        "pending",
        "placed",
        "popularity",
        "queue",
        "record",
        "record_ms",
        "rpm",
        "served",
        "waiters",
    )

    def __init__(self, index: int, instance_id: str, cache: WeightedLRU, start_ms: int, assume_ms: int) -> None:
        self.index = index
        self.instance_id = instance_id
        self.cache = cache
        self.identity = Identity(instance_id, f"{instance_id}:8080", "", (), start_ms)
        self.loading = 0  # loads running (<= loading threads)
        self.queue: deque[int] = deque()  # admitted models waiting for a loading thread
        self.pending: dict[int, int] = {}  # Policy.load_queue: loads waiting for a thread, no room taken -> since
        self.patience: dict[int, float] = {}  # ... -> until when it may wait (LocalModels._patience)
        self.fleet_clock = FleetClock()  # Policy.fleet_clock: peers' eviction counts seen
        self.popularity = Popularity()  # Policy.load_queue: requests arriving here, per model
        self.mean_load_ms = DEFAULT_MEAN_LOAD_MS
        self.loads_finished = 0
        self.assume_loaded = AssumeLoaded(assume_ms)  # LoadQueue.assume_loaded: learnt from its loads
        self.blocked: dict[int, tuple[int, int]] = {}  # models waiting for room -> (last used, since)
        # model -> (arrival, origin instance, forwarded) per request waiting for the load
        self.waiters: dict[int, list[tuple[float, int, bool]]] = {}
        self.initiated: set[int] = set()  # loads a request started (its first waiter)
        self.served = 0
        self.rpm = RpmMeter()
        self.placed = RecentPlacements()
        self.record: InstanceRecord | None = None
        self.record_ms = 0
        self.changed_since_publish = False
        self.checked: dict[str, int] = {}  # model -> served count at the last rate check
        self.inflight: dict[str, int] = {}  # Router.inflight: requests forwarded per peer, unanswered
        self.answers: list[tuple[float, str]] = []  # (answered at, peer): ungated forwards being served
        self.gates: dict[int, _Gate] = {}  # loaded copies' gates (max_concurrency > 0)
        self.gate_sums: dict[str, QueueSample] = {}  # model -> its gate's sums at the last rate check
        self.disk: WeightedLRU | None = None  # Fleet.disk_units: the pulled files it keeps
        self.disk_version = 0  # changes with the disk's set of models
        self.disk_record: tuple[int, dict[str, Any] | None] = (-1, None)  # (version, meshdDisk value)


class Simulation:
    """One run of one policy over one workload on one fleet."""

    def __init__(
        self,
        workload: Workload,
        fleet: Fleet,
        policy: Policy,
        warmup: int = 0,
        ingress: Sequence[int] | None = None,
    ) -> None:
        """`ingress`: the instance (index) each request arrives at; default uniformly random,
        as a load balancer in front of the mesh spreads them. Given, it replays a real run."""
        if ingress is not None and len(ingress) != len(workload.models):
            raise ValueError(f"ingress names {len(ingress)} instances for {len(workload.models)} requests")
        if ingress is not None and any(not 0 <= i < fleet.instances for i in ingress):
            raise ValueError(f"ingress names an instance outside 0..{fleet.instances - 1}")
        self.ingress = ingress
        self.workload = workload
        self.fleet = fleet
        self.policy = policy
        self.warmup = warmup
        cat = workload.catalogue
        self.ids = cat.ids
        self.index = {mid: i for i, mid in enumerate(cat.ids)}
        self.units = cat.units
        self.load_ms = cat.load_ms
        self.service_ms = cat.service_ms if fleet.service_time else (0.0,) * len(cat.ids)
        self.rng = random.Random(fleet.seed)
        self.placement_rng = random.Random(fleet.seed + 1)
        self.service_rng = random.Random(fleet.seed + 2)  # its own stream: loads draw as before
        self.gated = fleet.max_concurrency > 0
        self.gate_bound = queue_bound(fleet.max_concurrency, fleet.max_queue)
        self.default_units = fleet.default_model_units or max(1, sorted(cat.units)[len(cat.units) // 2])
        target = policy.latency_target_ms
        caches = [WeightedLRU(fleet.capacity_units, policy.eviction, target) for _ in range(fleet.instances)]
        assume = assume_loaded_ms(fleet.loading_timeout_ms)
        self.insts = [_Instance(i, f"i{i:03d}", cache, EPOCH_MS, assume) for i, cache in enumerate(caches)]
        # Issue 42: what each model's pull costs, and each instance's disk tier, kept in the
        # memory cache's value order (the storage room evicts its disk the same way)
        rate = fleet.pull_ms_per_gib
        self.pull_ms = tuple(u * UNIT_BYTES / GIB * rate for u in cat.units)
        if fleet.disk_units:
            for inst in self.insts:
                inst.disk = WeightedLRU(fleet.disk_units, policy.eviction)
        self.by_id = {inst.instance_id: inst for inst in self.insts}
        self.views: dict[str, InstanceView] = {}
        self.copies: list[dict[str, int]] = [{} for _ in cat.ids]  # model records: holder -> load start
        self.histories: list[tuple[float, ...]] = [()] * len(cat.ids)  # model records: uses on the fleet clock
        self.evicted_by: list[tuple[int, float] | None] = [None] * len(cat.ids)  # ... and the adaptive order's note
        self.last_used: list[int] = [0] * len(cat.ids)
        self.events: list[tuple[int, int, int, int, float]] = []  # (done at, seq, instance, model, load ms)
        self.done: list[_Done] = []  # requests being served at gated copies
        self.seq = 0
        self.counting = warmup == 0
        self.result = Result(policy.name, workload.name, fleet.instances, fleet.capacity_units)
        self.zero_latency = 0
        self.latencies: array[float] = array("d")
        self.zero_total = 0
        self.totals: array[float] = array("d")
        self.minute_loads: dict[int, int] = {}
        self.exhausted = False  # the last _start_load was refused by the load queue's limits
        self.wait_limit_ms = fleet.load_wait_limit_ms
        self.timeout_ms = fleet.client_timeout_ms
        self.load_waits: array[float] = array("d")
        self.queued_at: dict[tuple[int, int], int] = {}  # (instance, model) -> queued for a thread at
        counts = [0] * len(cat.ids)
        for m in workload.models:
            counts[m] += 1
        hottest = sorted(range(len(counts)), key=lambda m: -counts[m])[: max(1, len(counts) // 10)]
        self.hot = bytearray(len(cat.ids))
        for m in hottest:
            self.hot[m] = 1
        self.zero_hot = 0
        self.hot_latencies: array[float] = array("d")
        self.current_model = -1  # the model of the request whose latency is recorded next

    # ---- the run -----------------------------------------------------------------------
    def run(self) -> Result:
        times, models = self.workload.times_ms, self.workload.models
        n = len(models)
        ingress = self.rng.randrange
        k = len(self.insts)
        self._publish(EPOCH_MS, force=True)
        next_publish = EPOCH_MS + self.fleet.publish_ms
        next_check = EPOCH_MS + self.fleet.rate_check_ms
        events, done = self.events, self.done
        start_ms = EPOCH_MS + (times[self.warmup] if self.warmup < n else 0)
        t = EPOCH_MS
        for i in range(n):
            t = EPOCH_MS + times[i]
            while True:
                if not events and not done and min(next_publish, next_check) < t - IDLE_GAP_MS:
                    # Nothing runs until this request: one publish and one check at the end
                    # of the gap stand for the idle ticks (a trace with hours of silence
                    # would otherwise be stepped through 2 s at a time).
                    next_publish += (t - next_publish) // self.fleet.publish_ms * self.fleet.publish_ms
                    next_check += (t - next_check) // self.fleet.rate_check_ms * self.fleet.rate_check_ms
                due = events[0][0] if events else math.inf
                fin = done[0][0] if done else math.inf
                if fin <= t and fin <= due and fin <= next_publish and fin <= next_check:
                    self._complete(*heapq.heappop(done))
                elif due <= t and due <= next_publish and due <= next_check:
                    self._load_done(*heapq.heappop(events))
                elif next_publish <= t and next_publish <= next_check:
                    self._publish(next_publish)
                    next_publish += self.fleet.publish_ms
                elif next_check <= t:
                    self._rate_check(next_check)
                    next_check += self.fleet.rate_check_ms
                else:
                    break
            if i == self.warmup:
                self.counting = True
            at = ingress(k) if self.ingress is None else self.ingress[i]
            self._request(t, models[i], self.insts[at])
        while events or done:  # let the last loads and requests finish so they are counted
            if done and (not events or done[0][0] <= events[0][0]):
                self._complete(*heapq.heappop(done))
            else:
                self._load_done(*heapq.heappop(events))
        return self._finish(start_ms, t)

    def _finish(self, start_ms: int, end_ms: int) -> Result:
        r = self.result
        r.duration_ms = max(0, end_ms - start_ms)
        r.added_p50_ms, r.added_p99_ms, r.added_mean_ms = _summary(self.zero_latency, self.latencies)
        r.total_p50_ms, r.total_p99_ms, r.total_mean_ms = _summary(self.zero_total, self.totals)
        waits = self.load_waits
        r.loads_queued = sum(1 for x in waits if x > 0)
        _, r.load_wait_p99_ms, r.load_wait_mean_ms = _summary(0, waits) if waits else (0.0, 0.0, 0.0)
        r.hot_added_p99_ms = _summary(self.zero_hot, self.hot_latencies)[1]
        if self.minute_loads:
            first, last = min(self.minute_loads), max(self.minute_loads)
            r.loads_per_minute = [self.minute_loads.get(m, 0) for m in range(first, last + 1)]
        return r

    # ---- requests ----------------------------------------------------------------------
    def _request(self, t: int, m: int, inst: _Instance) -> None:
        self.last_used[m] = t
        if self.policy.load_queue:
            inst.popularity.count(self.ids[m])
        if self.counting:
            self.result.requests += 1
        entry = inst.cache.get(self.ids[m])
        if entry is not None and entry.state is State.LOADED:  # a local hit, as in Router._serve
            inst.cache.touch(entry.model_id, t)
            if self._serve(t, inst, m, entry, t, inst.index, False):
                if self.counting:
                    self.result.hits += 1
                    self.result.local_hits += 1
                return
            self._route(t, m, inst, t, {inst.instance_id}, 1, True)  # its gate is full: Refused(busy)
            return
        self._route(t, m, inst, t, set(), 0, True)

    def _route(
        self,
        t: int,
        m: int,
        inst: _Instance,
        arrival: float,
        excluded: set[str],
        busy: int,
        fresh: bool,
        exhausted: int = 0,
    ) -> None:
        """Router._route: a copy serves, else placement picks where to load; refusals reroute.
        `busy`: refusals by full gates so far; `fresh`: the request has not waited yet (a
        loaded copy serving it is a hit)."""
        mid = self.ids[m]
        me = inst.instance_id
        inflight = inst.inflight
        answers = inst.answers
        offer = PriceOffer()  # placement by price, once per request
        while answers and answers[0][0] <= t:  # answers that came back by now
            inflight[heapq.heappop(answers)[1]] -= 1
        for _ in range(MAX_ATTEMPTS):
            view = ClusterView(me, t, self.views)
            copies = self.copies[m]
            if excluded:
                copies = {i: s for i, s in copies.items() if i not in excluded}
            target = choose_copy(view, copies, inflight, excluded, inst.assume_loaded.ms(""), False, False)
            if target is not None:
                holder = self.by_id[target]
                entry = holder.cache.get(mid)
                forwarded = target != me
                if entry is not None and entry.state is State.LOADED:
                    holder.cache.touch(mid, t)
                    if forwarded:  # counted from the call on, as Forwarder.unary does
                        inflight[target] = inflight.get(target, 0) + 1
                    if self._serve(t, holder, m, entry, arrival, inst.index, forwarded):
                        if fresh and self.counting:
                            self.result.hits += 1
                        return
                    if forwarded:
                        inflight[target] -= 1
                    excluded.add(target)
                    busy += 1
                    if busy > MAX_BUSY_RETRIES:
                        self._failed(True, t - arrival)
                        return
                    continue
                if m in holder.waiters:  # loading there: wait for it
                    self._be_patient(holder, m, t, self._budget(t, arrival))
                    holder.waiters[m].append((arrival, inst.index, forwarded))
                    if forwarded:
                        inflight[target] = inflight.get(target, 0) + 1
                    return
                excluded.add(target)
                continue
            if busy:  # every copy is saturated: a new load would not answer in time
                self._failed(True, t - arrival)
                return
            placed = self._load_target(view, m, frozenset(excluded), offer.ceiling)
            if placed is None:
                if not load_here_as_last_resort(view, excluded, frozenset(), frozenset()):
                    break
                placed = Placement(me)
            target = placed.target
            holder = self.by_id[target]
            joining = m in holder.waiters
            limit = offer.limit_for(placed, me)
            # The peer refuses a load sent with a limit (Router.forwarded_entry) if it would
            # evict more, or queue it; one it is loading already it joins.
            if limit is not None and not joining and not self._stays(holder, m, limit):
                excluded.add(target)
                offer.refused(limit)
                if self.counting:
                    self.result.repriced += 1
                continue
            self.exhausted = False
            if self._start_load(holder, m, t, t, self._budget(t, arrival)):
                forwarded = target != me
                if not joining:
                    holder.initiated.add(m)  # this request's use is the admission's
                holder.waiters[m].append((arrival, inst.index, forwarded))
                if forwarded:
                    inflight[target] = inflight.get(target, 0) + 1
                return
            excluded.add(target)
            if self.exhausted:  # the load queue there is past its limit: refused fast
                exhausted += 1
                if exhausted > MAX_BUSY_RETRIES:
                    break
        self._failed(exhausted > 0, t - arrival)

    def _budget(self, t: float, arrival: float) -> float | None:
        """What a request that arrived at `arrival` has left of its deadline at `t` (None: none)."""
        return None if not self.timeout_ms else self.timeout_ms - (t - arrival)

    def _be_patient(self, inst: _Instance, m: int, t: float, budget_ms: float | None) -> None:
        """LocalModels._be_patient: a request with a deadline joined a waiting load."""
        if budget_ms is None or m not in inst.patience:
            return
        until = t + patience_ms(self.wait_limit_ms, inst.mean_load_ms, budget_ms)
        inst.patience[m] = max(inst.patience[m], until)

    def _failed(self, rejected: bool, waited: float) -> None:
        """No answer: UNAVAILABLE, or RESOURCE_EXHAUSTED (`rejected`) when copies were busy
        or loads could not start in time; `waited`: since the request arrived."""
        if self.counting:
            self.result.failed += 1
            self.result.rejected += rejected
            self.result.failed_slow += waited > FAST_REFUSAL_MS

    def _serve(
        self, t: float, holder: _Instance, m: int, entry: CacheEntry, arrival: float, origin: int, forwarded: bool
    ) -> bool:
        """Router._enter and the runtime call on `holder`'s loaded copy: run now or wait at
        its gate. False when the gate refuses (its queue is full: Refused(busy))."""
        gate = holder.gates.get(m) if self.gated else None
        if gate is not None:
            arrived = on_arrival(gate.running, len(gate.queue), gate.limit, gate.bound)
            if arrived is Arrival.REFUSE:
                return False
            if arrived is Arrival.QUEUE:
                entry.served += 1
                holder.served += 1
                gate.queue.append((t, arrival, origin, forwarded))
                if self.counting:
                    self.result.queued += 1
                return True
            gate.running += 1
        entry.served += 1
        holder.served += 1
        self._start(t, holder.index, m, gate, arrival, origin, forwarded)
        return True

    def _start(self, t: float, holder: int, m: int, gate: _Gate | None, arrival: float, origin: int, fwd: bool) -> None:
        """The runtime starts on a request: its latency is known now; its end is an event
        when something waits on it (a gate slot, the origin's in-flight count)."""
        mean = self.service_ms[m]
        jitter = self.fleet.service_jitter
        ms = mean * math.exp(self.service_rng.gauss(0.0, jitter)) if mean > 0 and jitter else mean
        if self.counting:
            added = t - arrival + (self.fleet.hop_ms if fwd else 0.0)
            self._latency(added, added + ms)
            if self.timeout_ms and added + ms > self.timeout_ms:
                self.result.late += 1
            if self.hot[m]:
                if added <= 0:
                    self.zero_hot += 1
                else:
                    self.hot_latencies.append(added)
        if ms > 0:
            if gate is not None:
                self.seq += 1
                heapq.heappush(self.done, (t + ms, self.seq, gate, holder, m, origin, fwd, ms))
            elif fwd:  # only the origin's in-flight count waits on it: settled when it next routes
                heapq.heappush(self.insts[origin].answers, (t + ms, self.insts[holder].instance_id))
        elif gate is not None or fwd:
            self._complete(t, 0, gate, holder, m, origin, fwd, ms)

    def _complete(
        self, t: float, _seq: int, gate: _Gate | None, holder: int, m: int, origin: int, fwd: bool, ms: float
    ) -> None:
        """A request answered: the origin sees it (in-flight count), its gate slot passes on."""
        if fwd:
            self.insts[origin].inflight[self.insts[holder].instance_id] -= 1
        if gate is None:
            return
        gate.completed += 1
        gate.service_ms += ms
        if gate.queue:  # CopyGate.leave: the slot moves to the first waiter
            queued_at, arrival, o, f = gate.queue.popleft()
            gate.queued += 1
            gate.queue_ms += t - queued_at
            self._start(t, holder, m, gate, arrival, o, f)
        else:
            gate.running -= 1

    def _latency(self, added: float, total: float) -> None:
        if added <= 0:
            self.zero_latency += 1
        else:
            self.latencies.append(added)
        if total <= 0:
            self.zero_total += 1
        else:
            self.totals.append(total)

    def _load_target(
        self, view: ClusterView, m: int, exclude: frozenset[str], price_ceiling: float | None = None
    ) -> Placement | None:
        inst = self.by_id[view.self_id]
        req = LoadRequest(
            model_id=self.ids[m],
            model_type="",
            size_units=self.units[m],
            exclude=exclude,
            default_model_units=self.default_units,
            recent_placements=inst.placed.counts(view.now_ms) if self.policy.spread_recent_loads else {},
            start_soonest=self.policy.load_queue,
            by_price=self.policy.by_price,
            price_ceiling=price_ceiling,
            # Issue 42: where the model's files are on disk a load skips the pull (ready_soonest)
            pull_ms=pull_estimate_ms((v.disk for v in view.instances.values()), self.units[m])
            if self.fleet.disk_units
            else None,
            mean_load_ms=inst.mean_load_ms,
        )
        if self.policy.random_placement:
            candidates = eligible(view, req)
            if not candidates:
                return None
            return Placement(candidates[self.placement_rng.randrange(len(candidates))].instance_id)
        if self.policy.load_queue:  # the router's own queue and cache as they are now, not as published
            view = view.with_loads({inst.instance_id: self._loads_in_progress(inst)})
            if self.policy.by_price:
                view = view.with_own_cache(inst.cache.used_units, inst.cache.victim_value())
        placed = choose_load(view, req, self.placement_rng)
        if placed is not None and self.policy.spread_recent_loads:
            inst.placed.add(view.now_ms, placed.target)
        return placed

    def _stays(self, inst: _Instance, m: int, price_limit: float) -> bool:
        """Router.forwarded_entry's check of a load placed by price, on the instance as it is now."""
        own = load_price(inst.cache.free_units, inst.cache.victim_value(), self.units[m])
        return stays(own, price_limit, self._loads_in_progress(inst), self.fleet.loading_threads)

    # ---- loading -----------------------------------------------------------------------
    def _start_load(self, inst: _Instance, m: int, t: int, last_used: int, budget_ms: float | None = None) -> bool:
        """LocalModels.start_load: join a load under way, or admit (evicting) and queue it.
        False when the cache refuses it for good (too big, or only newer models to evict).
        `budget_ms`: what the asking request has left of its deadline (None: none)."""
        if m in inst.waiters:
            self._be_patient(inst, m, t, budget_ms)
            return True
        if self.policy.load_queue and (inst.loading >= self.fleet.loading_threads or inst.pending):
            return self._enqueue(inst, m, t, last_used, budget_ms)
        admission = self._admit(inst, m, last_used, t)
        if admission.admitted:
            inst.waiters[m] = []
            self._admitted(inst, m, t, admission.evicted)
            return True
        if admission.retryable:
            inst.waiters[m] = []
            inst.blocked[m] = (last_used, t)
            return True
        return False

    def _enqueue(self, inst: _Instance, m: int, t: int, last_used: int, budget_ms: float | None) -> bool:
        """Policy.load_queue: wait for a loading thread without taking room, unless the load
        could not end before the request's deadline, or not start within the wait limit (or
        the deadline, if longer), or the queue is under pressure and the model is colder than
        what it would evict (refused fast: `self.exhausted`)."""
        mid, units, pop = self.ids[m], self.units[m], inst.popularity
        threads, mean = self.fleet.loading_threads, inst.mean_load_ms
        wait = start_wait_ms(len(inst.pending), inst.loading, threads, mean)
        verdict = queue_verdict(wait, mean, self.wait_limit_ms, budget_ms)
        refuse = verdict is Verdict.LATE
        if verdict is Verdict.FULL:
            # The queue is at its bound: this load goes in only in place of a less valuable one.
            value = load_value(1, pop.of(mid), units)
            values = {p: load_value(len(inst.waiters[p]), pop.of(self.ids[p]), self.units[p]) for p in inst.pending}
            coldest = displaced_by(value, ((values[p], since, p) for p, since in inst.pending.items()), t)
            if coldest is not None:
                del inst.pending[coldest]
                inst.patience.pop(coldest, None)
                self._refuse_load(inst, coldest, t, reroute=True)
            else:
                refuse = True
        pressure = self.policy.pressure_admission and pressed(
            len(inst.pending), threads, mean, self.wait_limit_ms, budget_ms
        )
        if not refuse and pressure:
            victims = inst.cache.victims_for(mid, units, last_used)
            refuse = victims is None or colder_than_victims(pop.of(mid), 1, [pop.of(v.model_id) for v in victims])
        if refuse:
            self.exhausted = True
            if self.counting:
                self.result.refused_fast += 1
            return False
        inst.waiters[m] = []
        inst.pending[m] = t
        inst.patience[m] = t + patience_ms(self.wait_limit_ms, mean, budget_ms)
        self.copies[m][inst.instance_id] = t  # recorded now, so requests elsewhere join this load
        return True

    def _start_pending(self, inst: _Instance, t: int) -> None:
        """Free loading threads take the most valuable waiting loads; room is taken now."""
        pop = inst.popularity
        for p in list(inst.pending):  # waited past its patience (the limit, or a deadline): refused
            if t > inst.patience[p]:  # LoadWaitExpired: answered, not rerouted
                del inst.pending[p]
                del inst.patience[p]
                self._refuse_load(inst, p, t)
        while inst.pending and inst.loading < self.fleet.loading_threads:
            m = next_load(
                (
                    (load_value(len(inst.waiters[p]), pop.of(self.ids[p]), self.units[p]), since, p)
                    for p, since in inst.pending.items()
                ),
                t,
            )
            assert m is not None
            since = inst.pending.pop(m)
            del inst.patience[m]
            # Requests wait on it now: it is in use now (a background load keeps its older date).
            used = t if inst.waiters[m] else max(since, self.last_used[m])
            admission = self._admit(inst, m, used, t)
            if admission.admitted:
                self.queued_at[(inst.index, m)] = since
                self._admitted(inst, m, t, admission.evicted)
            elif admission.retryable:
                inst.blocked[m] = (used, t)
            else:
                self._refuse_load(inst, m, t)

    def _refuse_load(self, inst: _Instance, m: int, t: int, reroute: bool = False) -> None:
        """A queued load that will not run: its record goes, its waiters fail, or with
        `reroute` (refused for load capacity: ResourceExhausted, which the router takes as a
        busy refusal) try elsewhere, as one more load-capacity refusal each."""
        self.copies[m].pop(inst.instance_id, None)
        refused = inst.waiters.pop(m, [])
        inst.initiated.discard(m)
        for arrived, origin, forwarded in refused:
            self._answered(origin, inst, forwarded)
            if reroute:
                self._route(t, m, self.insts[origin], arrived, {inst.instance_id}, 0, False, exhausted=1)
                continue
            if self.counting:
                self.result.failed += 1
                self.result.failed_slow += t - arrived > FAST_REFUSAL_MS

    def _admit(self, inst: _Instance, m: int, last_used: int, t: int) -> Admission:
        """LocalModels._admit: the model's record gives its use history and, under the adaptive
        order, which order evicted it last (charged for this reload; the copy's record write
        then clears the note)."""
        admission = inst.cache.admit(
            self.ids[m], self.units[m], last_used, t, history=self.histories[m], evicted_by=self.evicted_by[m]
        )
        if admission.admitted:
            self.evicted_by[m] = None
        return admission

    def _admitted(self, inst: _Instance, m: int, t: int, evicted: tuple[CacheEntry, ...]) -> None:
        if evicted:
            inst.changed_since_publish = True  # LocalModels.on_change: evictions publish soon too
        for victim in evicted:
            v = self.index[victim.model_id]
            self.copies[v].pop(inst.instance_id, None)
            if self.policy.fleet_clock and victim.uses_at:  # written with the record's copy removal
                self.histories[v] = victim.uses_at[-USE_HISTORY_KEPT:]  # as much as a record keeps
                if victim.evicted_by >= 0 and inst.cache.regret is not None:
                    self.evicted_by[v] = (victim.evicted_by, victim.evicted_clock)
            inst.gates.pop(v, None)  # it finishes what it holds, takes nothing new
            if self.counting:
                self.result.evictions += 1
                if victim.state is State.LOADED and t - victim.last_used_ms < 60_000:
                    self.result.evicted_in_use += 1
        self.copies[m][inst.instance_id] = t
        if inst.loading < self.fleet.loading_threads:
            self._begin(inst, m, t)
        else:
            inst.queue.append(m)
            self.queued_at[(inst.index, m)] = t

    def _begin(self, inst: _Instance, m: int, t: int) -> None:
        inst.loading += 1
        queued = self.queued_at.pop((inst.index, m), t)
        if self.counting:
            self.load_waits.append(float(t - queued))
        mean = self.load_ms[m]
        ms = mean * self.rng.lognormvariate(0.0, self.fleet.load_jitter) if self.fleet.load_jitter else mean
        ms += self._pull(inst, m, t)
        self.seq += 1
        heapq.heappush(self.events, (t + int(ms), self.seq, inst.index, m, ms))

    def _pull(self, inst: _Instance, m: int, t: int) -> float:
        """What a load starting now spends pulling the model's files: nothing when its
        instance's disk tier holds them (it counts as used now), else the model's pull, and the
        files stay on the disk as far as its budget lets them (evicting in the value order)."""
        pull = self.pull_ms[m]
        if not pull:
            return 0.0
        disk, mid = inst.disk, self.ids[m]
        if disk is not None and mid in disk:
            disk.touch(mid, t)
            if self.counting:
                self.result.disk_loads += 1
            return 0.0
        if self.counting:
            self.result.pulls += 1
        if disk is not None:
            admission = disk.admit(mid, self.units[m], t, t)
            if admission.admitted:
                disk.set_state(mid, State.LOADED, t, pull)
                inst.disk_version += 1
        return pull

    def _disk_value(self, inst: _Instance) -> dict[str, Any] | None:
        """The record's meshdDisk value for `inst` (None: no disk tier), built again only
        when its disk's models changed."""
        disk = inst.disk
        if disk is None:
            return None
        version, value = inst.disk_record
        if version != inst.disk_version:
            ids, units = self.index, self.units
            value = disk_value(
                (e.model_id, units[ids[e.model_id]] * UNIT_BYTES, int(self.pull_ms[ids[e.model_id]]))
                for e in disk.entries()
            )
            inst.disk_record = (inst.disk_version, value)
        return value

    def _load_done(self, t: int, _seq: int, i: int, m: int, ms: float) -> None:
        inst = self.insts[i]
        inst.loading -= 1
        mid = self.ids[m]
        entry = inst.cache.get(mid)
        waiters = inst.waiters.pop(m, [])
        first = 1 if m in inst.initiated else 0
        inst.initiated.discard(m)
        if entry is not None:
            inst.cache.set_state(mid, State.LOADED, t, ms)
            inst.changed_since_publish = True
            if self.gated:  # LocalModels: the runtime's maxConcurrency gives the copy a gate
                inst.gates[m] = _Gate(i, m, self.fleet.max_concurrency, self.gate_bound)
            if self.counting:
                self.result.loads += 1
                minute = (t - EPOCH_MS) // 60_000
                self.minute_loads[minute] = self.minute_loads.get(minute, 0) + 1
            for arrived, _, _ in waiters[first:]:  # LocalModels.ensure: a request that joined a load uses it
                inst.cache.touch(mid, int(arrived))
            for arrived, origin, forwarded in waiters:
                if not self._serve(t, inst, m, entry, arrived, origin, forwarded):  # Refused(busy): reroute
                    self._answered(origin, inst, forwarded)
                    self._route(t, m, self.insts[origin], arrived, {inst.instance_id}, 1, False)
        else:
            for _, origin, forwarded in waiters:
                self._answered(origin, inst, forwarded)
        inst.mean_load_ms = update_mean_load_ms(inst.mean_load_ms, ms, inst.loads_finished)
        inst.loads_finished += 1
        inst.assume_loaded.record("", ms)
        while inst.queue and inst.loading < self.fleet.loading_threads:
            nxt = inst.queue.popleft()
            if inst.cache.get(self.ids[nxt]) is not None:
                self._begin(inst, nxt, t)
        if inst.pending:
            self._start_pending(inst, t)
        for b, (used, since) in list(inst.blocked.items()):  # room may have appeared (LocalModels._admit)
            # Requests waiting on it use it now (LocalModels._admit); a background load keeps its date.
            used = admission_date(max(used, self.last_used[b]), since, t) if inst.waiters.get(b) else used
            admission = self._admit(inst, b, used, t)
            if admission.admitted:
                del inst.blocked[b]
                self._admitted(inst, b, t, admission.evicted)
            elif not admission.retryable or t - since > self.fleet.loading_timeout_ms:
                del inst.blocked[b]  # refused for good, or waited the load timeout (NoRoom)
                refused = inst.waiters.pop(b, [])
                inst.initiated.discard(b)
                for arrived, origin, forwarded in refused:
                    self._answered(origin, inst, forwarded)
                    if self.counting and t - arrived > FAST_REFUSAL_MS:
                        self.result.failed_slow += 1
                if self.counting:
                    self.result.failed += len(refused)

    def _answered(self, origin: int, holder: _Instance, forwarded: bool) -> None:
        """A forwarded request came back without being served (refused): off the in-flight count."""
        if forwarded:
            self.insts[origin].inflight[holder.instance_id] -= 1

    def _loads_in_progress(self, inst: _Instance) -> int:
        """LocalModels.loads_in_progress: running, and with the load queue those waiting too."""
        return inst.loading + len(inst.pending) + len(inst.queue) if self.policy.load_queue else inst.loading

    # ---- periodic work -----------------------------------------------------------------
    def _publish(self, t: int, force: bool = False) -> None:
        """InstancePublisher: each instance's record, on upstream's cadence."""
        for inst in self.insts:
            rpm = inst.rpm.rpm(inst.served, t)
            loading = self._loads_in_progress(inst)
            record = instance_record(
                inst.identity, inst.cache, self.fleet.loading_threads, loading, rpm, False, t, self._disk_value(inst)
            )
            if force or publish_due(inst.record, record, inst.record_ms, t, inst.changed_since_publish):
                inst.record, inst.record_ms, inst.changed_since_publish = record, t, False
                self.views[inst.instance_id] = InstanceView.from_record(inst.instance_id, record, empty_lru_ms=t)
        if self.policy.fleet_clock:  # each instance reads its peers' records (Instance's fleet clock loop)
            views = self.views
            for inst in self.insts:
                me = inst.instance_id
                step = inst.fleet_clock.step({i: (v.evicted, v.clock) for i, v in views.items() if i != me})
                inst.cache.follow_fleet(step.fleet_size, step.advance, step.floor)
                regret = inst.cache.regret
                if regret is not None:  # ADAPTIVE: the order the fleet's regret says
                    peers = (Tally.from_list(v.regret) for i, v in views.items() if i != me and v.regret is not None)
                    inst.cache.follow_order(fleet_order(regret, peers))

    def _rate_check(self, t: int) -> None:
        """Scaler.check on every instance: copy scaling for each loaded copy."""
        if not self.policy.copy_scaling:
            return
        interval = self.fleet.rate_check_ms
        configured = self.fleet.scaleup_rpm_threshold
        index, loaded = self.index, State.LOADED
        for inst in self.insts:
            view = ClusterView(inst.instance_id, t, self.views)
            if view.get(inst.instance_id) is None:
                continue
            checked: dict[str, int] = {}
            sums: dict[str, QueueSample] = {}
            before = inst.checked
            recent_ms = recent_load_window_ms(interval, inst.assume_loaded.ms(""))
            for entry in inst.cache.entries():
                if entry.state is not loaded:
                    continue
                mid = entry.model_id
                checked[mid] = entry.served
                rpm = copy_rpm(entry.served, before.get(mid, entry.served), interval)
                m = index[mid]
                threshold = configured
                gate = inst.gates.get(m)
                if gate is not None:  # Scaler.check: the gate's figures since the last check
                    now = sums[mid] = gate.sums()
                    sample = now.since(inst.gate_sums.get(mid))
                    rpm, threshold = gated_rate(rpm, threshold, sample, self.fleet.scaleup_bandwidth_pct)
                decision = decide_copies(
                    view,
                    holders=self.copies[m],
                    policy=DEFAULT_POLICY,
                    rpm=rpm,
                    threshold_rpm=threshold,
                    last_used_ms=entry.last_used_ms,
                    prior_use_ms=entry.prior_use_ms,
                    default_model_units=self.default_units,
                    recent_load_ms=recent_ms,
                )
                if decision.drop:
                    inst.changed_since_publish = True
                    inst.cache.remove(mid)
                    self.copies[m].pop(inst.instance_id, None)
                    inst.gates.pop(m, None)
                    if self.counting:
                        self.result.evictions += 1
                elif decision.add:
                    self._add_copies(view, m, decision.add, t)
            inst.checked = checked
            inst.gate_sums = sums

    def _add_copies(self, view: ClusterView, m: int, count: int, t: int) -> None:
        """Router.place, `count` times: background loads dated at the model's last use."""
        placed: set[str] = set()
        used = background_load_used_ms(None, self.last_used[m], t)  # the record's last use
        for _ in range(count):
            exclude = frozenset(placed | set(self.copies[m]))
            target = self._load_target(view, m, exclude)
            if target is None:
                return
            placed.add(target.target)
            self._start_load(self.by_id[target.target], m, t, used)


def _summary(zeros: int, values: array[float]) -> tuple[float, float, float]:
    """(p50, p99, mean) of `zeros` zero latencies and `values` (nearest-rank percentiles)."""
    ordered = sorted(values)
    total = zeros + len(ordered)

    def pct(p: float) -> float:
        rank = math.ceil(p * total) - 1
        if total == 0 or rank < zeros:
            return 0.0
        return ordered[rank - zeros]

    return pct(0.50), pct(0.99), sum(ordered) / total if total else 0.0


def simulate(
    workload: Workload, fleet: Fleet, policy: Policy, warmup: int = 0, ingress: Sequence[int] | None = None
) -> Result:
    """Run `policy` over `workload` on `fleet`; the first `warmup` requests are not counted."""
    return Simulation(workload, fleet, policy, warmup, ingress).run()
