"""The discrete-event mesh: meshd's decision code driven on a virtual clock.

Owns the simulated fleet (instances with a cache, loading threads and a load queue), the
model records (which instances hold a copy, since when), the event queue (load
completions, record publication, rate checks) and the counts a run reports. Every
decision is meshd's own, called as the daemon calls it:

- which copy serves: `placement.serving.choose_copy` (router);
- where a miss loads: `placement.rank.choose_load_target` with `RecentPlacements` (router);
- what to admit and evict: `cache.WeightedLRU` (local), GDSF or LRU;
- what each instance publishes and when: `instances.instance_record`, `publish_due`,
  `RpmMeter`; decisions read the published records, so they lag as they do in a mesh;
- copy scaling: `placement.scaling.decide_copies` (scaler), every rate-check interval.

What is simplified, on purpose: requests take no time on the runtime (service time is not
simulated, so copies have no in-flight requests and no concurrency limits); peers never
fail; a load never fails or times out; model records change at once (etcd writes take
milliseconds, far below anything measured here); a request waiting for room that the cache
then refuses for good, or that waits longer than the load timeout, counts as failed instead
of being rerouted.
"""

from __future__ import annotations

import heapq
import math
import random
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from meshd.cache import CacheEntry, State, WeightedLRU
from meshd.instances import PUBLISH_MIN_INTERVAL_MS, Identity, RpmMeter, instance_record, publish_due
from meshd.kv.records import InstanceRecord
from meshd.placement.rank import (
    DEFAULT_LOADING_TIMEOUT_MS,
    LoadRequest,
    RecentPlacements,
    choose_load_target,
    eligible,
    may_load_as_last_resort,
)
from meshd.placement.scaling import (
    DEFAULT_POLICY,
    DEFAULT_SCALE_UP_RPM_THRESHOLD,
    RATE_CHECK_INTERVAL_MS,
    decide_copies,
)
from meshd.placement.serving import assume_loaded_ms, choose_copy
from meshd.placement.view import ClusterView, InstanceView
from meshd.router import MAX_ATTEMPTS
from sim.policies import Policy
from sim.workloads import Workload

EPOCH_MS = 1_700_000_000_000  # virtual time starts here: records carry epoch ms
_NO_INFLIGHT: dict[str, int] = {}
_NOTHING: frozenset[str] = frozenset()


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

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ValueError("a fleet needs at least one instance")
        if self.capacity_units < 1:
            raise ValueError("instance capacity must be at least one unit")
        if self.loading_threads < 1:
            raise ValueError("loading threads must be at least 1")


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
    failed: int = 0
    duration_ms: int = 0
    added_p50_ms: float = 0.0  # latency meshd added: waits for loads, peer hops
    added_p99_ms: float = 0.0
    added_mean_ms: float = 0.0
    loads_per_minute: list[int] = field(default_factory=list)

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def loads_per_min(self) -> float:
        minutes = self.duration_ms / 60_000
        return self.loads / minutes if minutes > 0 else float(self.loads)


class _Instance:
    __slots__ = (
        "blocked",
        "cache",
        "checked",
        "identity",
        "index",
        "instance_id",
        "loading",
        "loads_since_publish",
        "placed",
        "queue",
        "record",
        "record_ms",
        "rpm",
        "served",
        "waiters",
    )

    def __init__(self, index: int, instance_id: str, cache: WeightedLRU, start_ms: int) -> None:
        self.index = index
        self.instance_id = instance_id
        self.cache = cache
        self.identity = Identity(instance_id, f"{instance_id}:8080", "", (), start_ms)
        self.loading = 0  # loads running (<= loading threads)
        self.queue: deque[int] = deque()  # admitted models waiting for a loading thread
        self.blocked: dict[int, tuple[int, int]] = {}  # models waiting for room -> (last used, since)
        self.waiters: dict[int, list[tuple[int, bool]]] = {}  # model -> (arrival, forwarded) per request
        self.served = 0
        self.rpm = RpmMeter()
        self.placed = RecentPlacements()
        self.record: InstanceRecord | None = None
        self.record_ms = 0
        self.loads_since_publish = False
        self.checked: dict[str, int] = {}  # model -> served count at the last rate check


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
        self.rng = random.Random(fleet.seed)
        self.placement_rng = random.Random(fleet.seed + 1)
        self.default_units = fleet.default_model_units or max(1, sorted(cat.units)[len(cat.units) // 2])
        self.assume_loaded = assume_loaded_ms(fleet.loading_timeout_ms)
        self.insts = [
            _Instance(i, f"i{i:03d}", WeightedLRU(fleet.capacity_units, policy.eviction), EPOCH_MS)
            for i in range(fleet.instances)
        ]
        self.by_id = {inst.instance_id: inst for inst in self.insts}
        self.views: dict[str, InstanceView] = {}
        self.copies: list[dict[str, int]] = [{} for _ in cat.ids]  # model records: holder -> load start
        self.last_used: list[int] = [0] * len(cat.ids)
        self.events: list[tuple[int, int, int, int, float]] = []  # (done at, seq, instance, model, load ms)
        self.seq = 0
        self.counting = warmup == 0
        self.result = Result(policy.name, workload.name, fleet.instances, fleet.capacity_units)
        self.zero_latency = 0
        self.latencies: array[float] = array("d")
        self.minute_loads: dict[int, int] = {}

    # ---- the run -----------------------------------------------------------------------
    def run(self) -> Result:
        times, models = self.workload.times_ms, self.workload.models
        n = len(models)
        ingress = self.rng.randrange
        k = len(self.insts)
        self._publish(EPOCH_MS, force=True)
        next_publish = EPOCH_MS + self.fleet.publish_ms
        next_check = EPOCH_MS + self.fleet.rate_check_ms
        events = self.events
        start_ms = EPOCH_MS + (times[self.warmup] if self.warmup < n else 0)
        t = EPOCH_MS
        for i in range(n):
            t = EPOCH_MS + times[i]
            while True:
                due = events[0][0] if events else math.inf
                if due <= t and due <= next_publish and due <= next_check:
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
        while events:  # let the last loads finish so their waiting requests are counted
            self._load_done(*heapq.heappop(events))
        return self._finish(start_ms, t)

    def _finish(self, start_ms: int, end_ms: int) -> Result:
        r = self.result
        r.duration_ms = max(0, end_ms - start_ms)
        waits = sorted(self.latencies)
        total = self.zero_latency + len(waits)

        def pct(p: float) -> float:
            rank = math.ceil(p * total) - 1  # nearest-rank percentile
            if total == 0 or rank < self.zero_latency:
                return 0.0
            return waits[rank - self.zero_latency]

        r.added_p50_ms = pct(0.50)
        r.added_p99_ms = pct(0.99)
        r.added_mean_ms = sum(waits) / total if total else 0.0
        if self.minute_loads:
            first, last = min(self.minute_loads), max(self.minute_loads)
            r.loads_per_minute = [self.minute_loads.get(m, 0) for m in range(first, last + 1)]
        return r

    # ---- requests ----------------------------------------------------------------------
    def _request(self, t: int, m: int, inst: _Instance) -> None:
        self.last_used[m] = t
        if self.counting:
            self.result.requests += 1
        entry = inst.cache.get(self.ids[m])
        if entry is not None and entry.state is State.LOADED:  # a local hit, as in Router._serve
            inst.cache.touch(entry.model_id, t)
            entry.served += 1
            inst.served += 1
            if self.counting:
                self.result.hits += 1
                self.result.local_hits += 1
                self.zero_latency += 1
            return
        self._route(t, m, inst)

    def _route(self, t: int, m: int, inst: _Instance) -> None:
        """Router._route: a copy serves, else placement picks where to load; refusals reroute."""
        mid = self.ids[m]
        excluded: set[str] = set()
        me = inst.instance_id
        for _ in range(MAX_ATTEMPTS):
            view = ClusterView(me, t, self.views)
            copies = self.copies[m]
            if excluded:
                copies = {i: s for i, s in copies.items() if i not in excluded}
            target = choose_copy(view, copies, _NO_INFLIGHT, excluded, self.assume_loaded, False, False)
            if target is not None:
                holder = self.by_id[target]
                entry = holder.cache.get(mid)
                forwarded = target != me
                if entry is not None and entry.state is State.LOADED:
                    holder.cache.touch(mid, t)
                    entry.served += 1
                    holder.served += 1
                    if self.counting:
                        self.result.hits += 1
                        self._latency(self.fleet.hop_ms if forwarded else 0.0)
                    return
                if m in holder.waiters:  # loading there: wait for it
                    holder.waiters[m].append((t, forwarded))
                    return
                excluded.add(target)
                continue
            target = self._load_target(view, m, frozenset(excluded))
            if target is None:
                if me in excluded or not may_load_as_last_resort(view, frozenset(), frozenset()):
                    break
                target = me
            holder = self.by_id[target]
            if self._start_load(holder, m, t, t):
                holder.waiters[m].append((t, target != me))
                return
            excluded.add(target)
        if self.counting:
            self.result.failed += 1

    def _latency(self, ms: float) -> None:
        if ms <= 0:
            self.zero_latency += 1
        else:
            self.latencies.append(ms)

    def _load_target(self, view: ClusterView, m: int, exclude: frozenset[str]) -> str | None:
        inst = self.by_id[view.self_id]
        req = LoadRequest(
            model_id=self.ids[m],
            model_type="",
            size_units=self.units[m],
            exclude=exclude,
            default_model_units=self.default_units,
            recent_placements=inst.placed.counts(view.now_ms) if self.policy.spread_recent_loads else {},
        )
        if self.policy.random_placement:
            candidates = eligible(view, req)
            if not candidates:
                return None
            return candidates[self.placement_rng.randrange(len(candidates))].instance_id
        target = choose_load_target(view, req, self.placement_rng)
        if target is not None and self.policy.spread_recent_loads:
            inst.placed.add(view.now_ms, target)
        return target

    # ---- loading -----------------------------------------------------------------------
    def _start_load(self, inst: _Instance, m: int, t: int, last_used: int) -> bool:
        """LocalModels.start_load: join a load under way, or admit (evicting) and queue it.
        False when the cache refuses it for good (too big, or only newer models to evict)."""
        if m in inst.waiters:
            return True
        admission = inst.cache.admit(self.ids[m], self.units[m], last_used, t)
        if admission.admitted:
            inst.waiters[m] = []
            self._admitted(inst, m, t, admission.evicted)
            return True
        if admission.retryable:
            inst.waiters[m] = []
            inst.blocked[m] = (last_used, t)
            return True
        return False

    def _admitted(self, inst: _Instance, m: int, t: int, evicted: tuple[CacheEntry, ...]) -> None:
        for victim in evicted:
            v = self.index[victim.model_id]
            self.copies[v].pop(inst.instance_id, None)
            if self.counting:
                self.result.evictions += 1
        self.copies[m][inst.instance_id] = t
        if inst.loading < self.fleet.loading_threads:
            self._begin(inst, m, t)
        else:
            inst.queue.append(m)

    def _begin(self, inst: _Instance, m: int, t: int) -> None:
        inst.loading += 1
        mean = self.load_ms[m]
        ms = mean * self.rng.lognormvariate(0.0, self.fleet.load_jitter) if self.fleet.load_jitter else mean
        self.seq += 1
        heapq.heappush(self.events, (t + int(ms), self.seq, inst.index, m, ms))

    def _load_done(self, t: int, _seq: int, i: int, m: int, ms: float) -> None:
        inst = self.insts[i]
        inst.loading -= 1
        mid = self.ids[m]
        entry = inst.cache.get(mid)
        waiters = inst.waiters.pop(m, [])
        if entry is not None:
            inst.cache.set_state(mid, State.LOADED, t, ms)
            inst.loads_since_publish = True
            entry.served += len(waiters)
            inst.served += len(waiters)
            if self.counting:
                self.result.loads += 1
                minute = (t - EPOCH_MS) // 60_000
                self.minute_loads[minute] = self.minute_loads.get(minute, 0) + 1
                for arrived, forwarded in waiters:
                    self._latency(t - arrived + (self.fleet.hop_ms if forwarded else 0.0))
        while inst.queue and inst.loading < self.fleet.loading_threads:
            nxt = inst.queue.popleft()
            if inst.cache.get(self.ids[nxt]) is not None:
                self._begin(inst, nxt, t)
        for b, (used, since) in list(inst.blocked.items()):  # room may have appeared (LocalModels._admit)
            admission = inst.cache.admit(self.ids[b], self.units[b], max(used, self.last_used[b]), t)
            if admission.admitted:
                del inst.blocked[b]
                self._admitted(inst, b, t, admission.evicted)
            elif not admission.retryable or t - since > self.fleet.loading_timeout_ms:
                del inst.blocked[b]  # refused for good, or waited the load timeout (NoRoom)
                refused = inst.waiters.pop(b, [])
                if self.counting:
                    self.result.failed += len(refused)

    # ---- periodic work -----------------------------------------------------------------
    def _publish(self, t: int, force: bool = False) -> None:
        """InstancePublisher: each instance's record, on upstream's cadence."""
        for inst in self.insts:
            rpm = inst.rpm.rpm(inst.served, t)
            record = instance_record(inst.identity, inst.cache, self.fleet.loading_threads, inst.loading, rpm, False, t)
            if force or publish_due(inst.record, record, inst.record_ms, t, inst.loads_since_publish):
                inst.record, inst.record_ms, inst.loads_since_publish = record, t, False
                self.views[inst.instance_id] = InstanceView.from_record(inst.instance_id, record)

    def _rate_check(self, t: int) -> None:
        """Scaler.check on every instance: copy scaling for each loaded copy."""
        if not self.policy.copy_scaling:
            return
        interval = self.fleet.rate_check_ms
        for inst in self.insts:
            view = ClusterView(inst.instance_id, t, self.views)
            if view.get(inst.instance_id) is None:
                continue
            checked: dict[str, int] = {}
            for entry in inst.cache.entries():
                if entry.state is not State.LOADED:
                    continue
                mid = entry.model_id
                checked[mid] = entry.served
                rpm = (entry.served - inst.checked.get(mid, entry.served)) * 60_000 // interval
                m = self.index[mid]
                decision = decide_copies(
                    view,
                    holders=self.copies[m],
                    policy=DEFAULT_POLICY,
                    rpm=rpm,
                    threshold_rpm=self.fleet.scaleup_rpm_threshold,
                    last_used_ms=entry.last_used_ms,
                    prior_use_ms=entry.prior_use_ms,
                    default_model_units=self.default_units,
                )
                if decision.drop:
                    inst.cache.remove(mid)
                    self.copies[m].pop(inst.instance_id, None)
                    if self.counting:
                        self.result.evictions += 1
                elif decision.add:
                    self._add_copies(view, m, decision.add, t)
            inst.checked = checked

    def _add_copies(self, view: ClusterView, m: int, count: int, t: int) -> None:
        """Router.place, `count` times: background loads dated at the model's last use."""
        placed: set[str] = set()
        used = min(self.last_used[m] or t, t)
        for _ in range(count):
            exclude = frozenset(placed | set(self.copies[m]))
            target = self._load_target(view, m, exclude)
            if target is None:
                return
            placed.add(target)
            self._start_load(self.by_id[target], m, t, used)


def simulate(
    workload: Workload, fleet: Fleet, policy: Policy, warmup: int = 0, ingress: Sequence[int] | None = None
) -> Result:
    """Run `policy` over `workload` on `fleet`; the first `warmup` requests are not counted."""
    return Simulation(workload, fleet, policy, warmup, ingress).run()
