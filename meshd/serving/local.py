"""This instance's copies: the cache decision applied to the runtime and the registry.

`LocalModels.ensure` is the load-on-demand path: a hit touches the entry, a miss admits
the model to the weighted LRU (evicting what the cache chooses), records the copy in the
model record, loads it through the load queue and corrects its size.

Invariants kept here:
- every runtime unload of a model goes through one tracked task per model
  (`_unload_later`), and a new load of that model waits for it, so the runtime never
  sees an unload overtake a newer load;
- evicted copies leave the model record first (nobody routes here), then wait for the
  requests they are serving, then are unloaded;
- the future a load publishes is always resolved, whatever fails (store errors included),
  and callers only ever wait on it through `asyncio.shield`, so one caller's
  cancellation never cancels the load for the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from meshd.core.clock import Clock, wall_ms
from meshd.core.errors import LoadFailed, MeshError, NotFound, ResourceExhausted, Unavailable
from meshd.core.model_types import ADAPTER_SLOTS_FULL, base_model_of
from meshd.core.records import ModelRecord, eviction_note, use_history
from meshd.decisions.cache import CacheEntry, Eviction, Popularity, State, WeightedLRU, adapter_slot_victim, to_units
from meshd.decisions.gate import queue_bound
from meshd.decisions.janitor import Repairs, plan_repairs
from meshd.decisions.placement.liveness import counted_for_max_copies
from meshd.decisions.placement.loading import (
    DEFAULT_LOAD_WAIT_LIMIT_MS,
    Verdict,
    admission_date,
    colder_than_victims,
    displaced_by,
    exhausted_message,
    load_value,
    patience_ms,
    pressed,
    queue_verdict,
    soonest_end_ms,
    start_wait_ms,
)
from meshd.decisions.placement.modelkey import at_max_copies, policy_from_key
from meshd.decisions.placement.rank import load_price, stays
from meshd.decisions.placement.view import ClusterView
from meshd.decisions.status import failure_expired
from meshd.observability.metrics import NO_METRICS, Metrics
from meshd.registry.models import CopiesFull, CopyAdded, Registry
from meshd.runtime.client import RuntimeClient, RuntimeInfo
from meshd.runtime.loader import LoadQueue
from meshd.serving.gate import CopyGate

log = logging.getLogger(__name__)

# A LoRA adapter's size until its runtime says (adapters are small: tens of MiB at rank 8-64).
ADAPTER_DEFAULT_BYTES = 64 << 20

UNLOAD_INFLIGHT_WAIT_S = 120.0  # upstream waits ~2 min for in-flight requests before unloading
CAPPED_UNLOAD_TRIES = 3  # a capped copy's unload is retried before its record lets another load it
CAPPED_UNLOAD_RETRY_S = 1.0
INFLIGHT_POLL_S = 0.05
RECORD_REMOVALS_AT_ONCE = 8  # a runtime gone with etcd down too: each removal may wait seconds


class RuntimeGone(Unavailable):
    """The runtime stopped answering while this load was under way: it must not land."""


class NoRoom(Unavailable):
    """The cache cannot take the model now (too big, or only newer models could make room)."""


class LoadWaitExpired(ResourceExhausted):
    """A load waited the wait limit for a loading thread: its requests have waited long
    enough and are answered (not rerouted to wait again elsewhere)."""


@dataclass(slots=True)
class Counters:
    requests: int = 0  # arrived here (external or from peers)
    served: int = 0  # served by this instance's runtime (what its rpm reports)
    hits: int = 0
    misses: int = 0
    loads: int = 0
    load_failures: int = 0
    evictions: int = 0


class LocalModels:
    def __init__(
        self,
        instance_id: str,
        registry: Registry,
        runtime: RuntimeClient,
        info: RuntimeInfo,
        *,
        failure_expiry_ms: int,
        max_queue_per_copy: int = 0,
        clock: Clock = wall_ms,
        eviction: Eviction = Eviction.LRU,
        latency_target_ms: int = 0,
        metrics: Metrics = NO_METRICS,
        load_queue: bool = False,
        load_wait_limit_ms: int = DEFAULT_LOAD_WAIT_LIMIT_MS,
        pull_deadline_ms: int = 0,
    ) -> None:
        """`max_queue_per_copy`: requests that may wait for a copy whose runtime limits its
        concurrency (upstream MM_MAX_INFLIGHT_PER_MODEL_COPY: 0 auto, < 0 unbounded).
        `load_queue`: the rules of `meshd.decisions.placement.loading` (issue 24): a load takes
        room only once it has a loading thread, the most valuable waiting load goes first,
        and a miss is refused at once (RESOURCE_EXHAUSTED) when its load could not start
        within `load_wait_limit_ms`, or when the queue is under pressure and the model is
        colder than what it would evict. False: upstream's queue (admit, then wait in turn).
        `pull_deadline_ms`: a load may run past the loading timeout while its pull runs, up to
        this long (`decisions.load_deadline`; 0: never)."""
        self.instance_id = instance_id
        self.registry = registry
        self.runtime = runtime
        self.info = info
        self.metrics = metrics
        self.queue = LoadQueue(
            runtime, info, lambda model_id: self._unload_later(model_id), metrics, pull_deadline_ms=pull_deadline_ms
        )
        self.cache = WeightedLRU(to_units(info.capacity_bytes), eviction, latency_target_ms)
        self.failure_expiry_ms = failure_expiry_ms
        self.max_queue_per_copy = max_queue_per_copy
        self.clock = clock
        self.counters = Counters()
        self.on_change: Callable[[], None] = lambda: None  # copies loaded or evicted (publish soon)
        # The cluster as the instances mirror shows it, for the max-copies rule (None: not
        # known yet, e.g. the start-up reconcile; nothing is checked against max copies).
        self.cluster_view: Callable[[], ClusterView] | None = None
        self._loading: dict[str, asyncio.Future[CacheEntry]] = {}
        self._wanted_last_used: dict[str, int] = {}  # newest use asked of a load not yet admitted
        # Loading models -> until when (time.monotonic()) their load may wait for a thread: the
        # wait limit from its first request, or the latest deadline of a patient request on it.
        self._patience: dict[str, float] = {}
        self._slot_timeouts: dict[str, asyncio.Timeout] = {}  # loads waiting for a thread now
        self._unloading: dict[str, asyncio.Task[None]] = {}
        self._releases: set[asyncio.Task[None]] = set()  # record removals of a gone runtime's copies
        self._tasks: set[asyncio.Task[None]] = set()
        self._space = asyncio.Event()  # replaced and set whenever room may have appeared
        # The native data plane's `withdraw`: its route goes and its requests end before an unload.
        self.before_unload: Callable[[str], Awaitable[None]] | None = None
        self.runtime_up = True  # False while the runtime does not answer (meshd.loops.runtime_watch)
        self.runtime_epoch = 0  # counts the runtime's outages: a load spanning one is void
        self._removals = asyncio.Semaphore(RECORD_REMOVALS_AT_ONCE)
        self.load_queue = load_queue
        self.load_wait_limit_ms = load_wait_limit_ms
        self.popularity = Popularity()  # requests arriving here per model, hits included (the router counts them)
        self._demand: dict[str, tuple[int, int]] = {}  # loads waiting for a thread -> (requests, units)
        # LoRA adapters loaded or loading here -> their base model (core.model_types): the base
        # is loaded first, used whenever they are, and evicted only with them.
        self.bases: dict[str, str] = {}

    # ---- the request path ------------------------------------------------------------
    async def ensure(
        self, model_id: str, record: ModelRecord, last_used_ms: int | None = None, deadline: float | None = None
    ) -> CacheEntry:
        """The loaded local copy, loading it first on a miss. Raises LoadFailed/Unavailable.
        `deadline`: when the request gives up (time.monotonic() seconds; None: never)."""
        now = self.clock()
        used = now if last_used_ms is None else last_used_ms
        entry = self.cache.get(model_id)
        if entry is not None and entry.state is State.LOADED:
            self.counters.hits += 1
            self.cache.touch(model_id, used)
            return entry
        self.counters.misses += 1
        missed = time.monotonic()
        pending = self._loading.get(model_id)
        if pending is not None:
            self._want(model_id, used, deadline)
            try:
                loaded = await asyncio.shield(pending)
                self.cache.touch(model_id, used)  # a use like any other: LRFU and GDSF count it
                self.metrics.cache_miss((time.monotonic() - missed) * 1000, model_id)
                return loaded
            except NoRoom:
                # That load was refused at an older last-used time (a background loadNow);
                # this request is newer and may evict what that one could not.
                if model_id in self._loading or model_id in self.cache:
                    raise
        elif entry is not None and not failure_expired(entry.since_ms, now, self.failure_expiry_ms):
            raise LoadFailed(self._failure_message(model_id, record))
        loaded = await asyncio.shield(self.start_load(model_id, record, used, deadline))
        self.metrics.cache_miss((time.monotonic() - missed) * 1000, model_id)
        return loaded

    def start_load(
        self, model_id: str, record: ModelRecord, last_used_ms: int, deadline: float | None = None
    ) -> asyncio.Future[CacheEntry]:
        """Begin loading here (or join the load under way); never waits. `deadline`: the
        requester's (time.monotonic() seconds); a load that would end after it is refused."""
        pending = self._loading.get(model_id)
        if pending is not None:
            self._want(model_id, last_used_ms, deadline)
            return pending
        entry = self.cache.get(model_id)
        fut: asyncio.Future[CacheEntry] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_consume_exception)
        if entry is not None and entry.state is State.LOADED:
            fut.set_result(entry)
            return fut
        if not self.runtime_up:
            fut.set_exception(Unavailable(f"cannot load {model_id!r} here: the runtime is not answering"))
            return fut
        failed_ms = record.failed_in.get(self.instance_id)
        if failed_ms is not None and not failure_expired(failed_ms, self.clock(), self.failure_expiry_ms):
            fut.set_exception(LoadFailed(self._failure_message(model_id, record)))
            return fut
        if self.load_queue:
            budget_ms = None if deadline is None else (deadline - time.monotonic()) * 1000
            refusal = self._refusal(model_id, record, last_used_ms, budget_ms)
            if refusal is not None:
                self.metrics.load_refused()
                fut.set_exception(ResourceExhausted(refusal))
                return fut
        if entry is not None:  # an expired failure
            self._remove(model_id)
        self._loading[model_id] = fut
        self._wanted_last_used[model_id] = last_used_ms
        self._patience[model_id] = time.monotonic() + self._patience_ms(deadline) / 1000
        self._spawn(self._load(model_id, record, fut))
        return fut

    def _patience_ms(self, deadline: float | None) -> float:
        """How long a load its request (`deadline`: time.monotonic() seconds) asks for may wait
        for a thread (`loading.patience_ms`)."""
        budget_ms = None if deadline is None else (deadline - time.monotonic()) * 1000
        return patience_ms(self.load_wait_limit_ms, self.queue.mean_load_ms, budget_ms)

    def _be_patient(self, model_id: str, deadline: float | None) -> None:
        """A request with `deadline` joined the load of `model_id`: if its client waits longer
        than the load may wait for a thread so far, the load waits as long."""
        if deadline is None or model_id not in self._patience:
            return
        until = time.monotonic() + self._patience_ms(deadline) / 1000
        if until <= self._patience[model_id]:
            return
        self._patience[model_id] = until
        waiting = self._slot_timeouts.get(model_id)
        if waiting is not None:
            loop = asyncio.get_running_loop()
            waiting.reschedule(loop.time() + until - time.monotonic())

    def _value(self, model_id: str) -> float:
        requests, units = self._demand.get(model_id, (1, 1))
        return load_value(requests, self.popularity.of(model_id), units)

    def _refusal(
        self, model_id: str, record: ModelRecord, last_used_ms: int, budget_ms: float | None = None
    ) -> str | None:
        """Why a new load must be refused now (None: it may queue). A more valuable load may
        take the place of the least valuable waiting one, which is refused instead."""
        q = self.queue
        threads, mean = q.threads, q.mean_load_ms
        wait = start_wait_ms(q.waiting, q.busy, threads, mean)
        units = self.initial_units(record)
        verdict = queue_verdict(wait, mean, self.load_wait_limit_ms, budget_ms)
        if verdict is Verdict.LATE:
            left, end = max(0.0, budget_ms or 0.0) / 1000, soonest_end_ms(wait, mean) / 1000
            why = (
                f"the request's deadline is {left:.1f} s away, and a load here could end in {end:.1f} s at the soonest"
            )
            return exhausted_message(model_id, why, wait)
        if verdict is Verdict.FULL:
            value = load_value(1, self.popularity.of(model_id), units)
            waiting = q.waiting_models()
            values = [(self._value(m), since, i) for i, (m, since) in enumerate(waiting)]
            coldest = displaced_by(value, values, int(time.monotonic() * 1000))  # the queue's clock
            if coldest is None:
                return exhausted_message(model_id, f"{q.waiting} loads wait for {threads} loading threads", wait)
            displaced = waiting[coldest][0]
            why = f"{model_id!r} is wanted more than it"
            q.displace(displaced, ResourceExhausted(exhausted_message(displaced, why, wait)))
            self.metrics.load_refused()
        if wait > 0 and pressed(q.waiting, threads, mean, self.load_wait_limit_ms, budget_ms):
            victims = self.cache.victims_for(model_id, units, last_used_ms)
            pops = [self.popularity.of(v.model_id) for v in victims or ()]
            if victims is None or colder_than_victims(self.popularity.of(model_id), 1, pops):
                why = "the load queue is under pressure and it is colder than the copies it would evict"
                return exhausted_message(model_id, why, wait)
        return None

    @property
    def loads_in_progress(self) -> int:
        """Loads under way here, as the instance record reports them: with the load queue,
        those waiting for a thread too (they hold no room, but a new load starts after them)."""
        q = self.queue
        return q.busy + q.waiting if self.load_queue else q.in_progress

    def takes_priced_load(self, model_id: str, record: ModelRecord, price_limit: float) -> bool:
        """Whether a load a peer placed by price stays here (`rank.stays`): what it would evict
        now is worth no more than `price_limit` and a loading thread is free. A copy here, or
        its load under way, is no new load: taken."""
        if model_id in self.cache or model_id in self._loading:
            return True
        own = load_price(self.cache.free_units, self.cache.victim_value(), self.initial_units(record))
        return stays(own, price_limit, self.loads_in_progress, self.queue.threads)

    def pending(self, model_id: str) -> asyncio.Future[CacheEntry] | None:
        """The load under way here, if any (join it with asyncio.shield)."""
        return self._loading.get(model_id)

    def view(self, model_id: str) -> CacheEntry | None:
        """The local copy as status sees it: a load still waiting for room counts as LOADING."""
        entry = self.cache.get(model_id)
        if entry is None and model_id in self._loading:
            return CacheEntry(model_id, 0, 0, State.LOADING, self.clock())
        return entry

    def acquire(self, entry: CacheEntry) -> None:
        entry.inflight += 1

    def release(self, entry: CacheEntry) -> None:
        entry.inflight -= 1

    def check_lost(self, model_id: str, entry: CacheEntry) -> None:
        """The runtime said it lacks a model we hold: confirm (modelSize) in the background
        and drop the copy if so (a stream cannot wait for the answer)."""

        async def check() -> None:
            if await self.runtime.has_model(model_id) is False:
                self.lost(model_id, entry)

        self._spawn(check())

    def lost(self, model_id: str, entry: CacheEntry) -> None:
        """The runtime answered NOT_FOUND for a copy we hold: forget it so it reloads."""
        if self.cache.get(model_id) is entry:
            log.warning("runtime lost %s; dropping the copy", model_id)
            self._remove(model_id)
            self._drop_adapters_of(model_id)
            self._spawn(self._quiet(self.registry.remove_copy(model_id, self.instance_id)))
            # Unload anyway (NOT_FOUND counts as done): a runtime that was about to bring the
            # copy back (an adapter restoring after a crash) must not keep one nobody counts.
            self._unload_later(model_id)
            self.on_change()

    def runtime_gone(self) -> None:
        """The runtime stopped answering: refuse loads, forget every loaded or loading copy
        and leave its record (in the background, a few at a time: etcd may be down too).
        Loads under way fail when they end (`RuntimeGone`). Nothing is unloaded (nothing to
        ask); a runtime coming back purges before READY."""
        self.runtime_up = False
        self.runtime_epoch += 1
        for entry in self.cache.entries():
            if entry.state is not State.FAILED:
                self._remove(entry.model_id)
                task = asyncio.get_running_loop().create_task(self._remove_copy_bounded(entry.model_id))
                self._tasks.add(task)
                self._releases.add(task)
                task.add_done_callback(self._tasks.discard)
                task.add_done_callback(self._releases.discard)
        self.on_change()

    async def copies_released(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until the copies a gone runtime held have left the records."""
        if self._releases:
            await asyncio.wait(list(self._releases), timeout=timeout_s)

    def runtime_back(self) -> None:
        """The runtime answered READY again, having purged its models: start from an empty
        cache (a load admitted around the outage fails when it ends), then take loads."""
        self.runtime_epoch += 1
        for entry in self.cache.entries():
            self._remove(entry.model_id)
            if entry.state is not State.FAILED:
                self._spawn(self._remove_copy_bounded(entry.model_id))
        self.runtime_up = True
        self.on_change()

    async def _remove_copy_bounded(self, model_id: str) -> None:
        async with self._removals:
            await self._quiet(self.registry.remove_copy(model_id, self.instance_id))

    def shed(self, model_id: str) -> bool:
        """Unload a loaded copy the scaler no longer wants (counted as an eviction)."""
        entry = self.cache.get(model_id)
        if entry is None or entry.state is not State.LOADED:
            return False
        self._remove(model_id)
        self._evict_all([entry])
        return True

    async def unload_now(self, model_id: str) -> None:
        """Unload the loaded copy and wait until it has left the record and the runtime
        (KServe RepositoryModelUnload)."""
        if self.shed(model_id):
            task = self._unloading.get(model_id)
            if task is not None:
                await asyncio.shield(task)

    def drop(self, model_id: str) -> None:
        """Unload the local copy (model unregistered). A load under way unloads when it ends."""
        entry = self._remove(model_id)
        self._drop_adapters_of(model_id)
        if entry is not None and entry.state is not State.LOADING:
            self._unload_later(model_id, entry)
            self.on_change()

    def _drop_adapters_of(self, base: str) -> None:
        """A base gone from here takes its adapters with it (they lived in its engine)."""
        adapters = [self._remove(a) for a, b in list(self.bases.items()) if b == base]
        self._evict_all([e for e in adapters if e is not None])

    # ---- loading -------------------------------------------------------------------
    def _want(self, model_id: str, last_used_ms: int, deadline: float | None = None) -> None:
        self._be_patient(model_id, deadline)
        demand = self._demand.get(model_id)
        if demand is not None:
            self._demand[model_id] = (demand[0] + 1, demand[1])
        if model_id in self._wanted_last_used and last_used_ms > self._wanted_last_used[model_id]:
            self._wanted_last_used[model_id] = last_used_ms
            self._space_changed()  # re-evaluate a waiting admission with the newer time

    def initial_units(self, record: ModelRecord) -> int:
        """What a model is taken to weigh before the runtime says: its declared size
        (`"meshd": {"size_bytes"}` or upstream's `disk_size_bytes` in the key), else the
        runtime's default model size."""
        try:
            hint = policy_from_key(record.key).size_hint_bytes
        except ValueError:
            hint = None  # validated at registration; a record written by other tools may differ
        if hint is None and base_model_of(record.key) is not None:
            hint = ADAPTER_DEFAULT_BYTES  # not the runtime's default, which is sized for whole models
        return to_units(hint or self.info.default_model_size)

    async def _admit(
        self, model_id: str, record: ModelRecord, units: int | None = None, past: CopyAdded | None = None
    ) -> None:
        """Reserve room (`units`: the runtime's prediction; None: `initial_units`), waiting (up
        to the load timeout) while loading entries fill it. `past`: the record's history as
        this copy's add read it (None: the mirror's `record`)."""
        units = units or self.initial_units(record)
        if past is None:
            past = CopyAdded(use_history(record.extra), eviction_note(record.extra))
        # its uses before, as the last instance to evict it wrote, and which order evicted it (ADAPTIVE's regret)
        history, evicted_by = past.history, past.evicted_by
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.queue.timeout_s
        began = self.clock()
        while True:
            # Requests waiting on it use it now, at each try: copies touched while it waited
            # for room do not refuse it for good (a background load keeps its older date).
            last_used = admission_date(self._wanted_last_used.get(model_id, began), began, self.clock())
            admission = self.cache.admit(
                model_id, units, last_used, self.clock(), self._keep(model_id), history, evicted_by
            )
            if admission.admitted:
                self._evict_all(admission.evicted)
                return
            remaining = deadline - loop.time()
            if not admission.retryable or remaining <= 0:
                raise NoRoom(f"cannot load {model_id!r} here: {admission.reason}")
            space = self._space
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):  # unlike wait_for, never swallows a cancel
                    await space.wait()

    def _keep(self, model_id: str) -> frozenset[str]:
        """What making room may not evict: every base whose adapters are loaded or loading here
        (they live in its engine; the adapters go first, by the cache's own order)."""
        return frozenset(self.bases.values()) if self.bases else frozenset()

    def _space_changed(self) -> None:
        event, self._space = self._space, asyncio.Event()
        event.set()

    async def _load(self, model_id: str, record: ModelRecord, fut: asyncio.Future[CacheEntry]) -> None:
        admitted = recorded = False
        epoch = self.runtime_epoch
        slot_held = False
        try:
            base = base_model_of(record.key)
            if base is not None:  # an adapter loads into its base's engine: the base first
                self.bases[model_id] = base
                await self.ensure(base, self.registry.get(base) or await self.registry.fetch(base))
            # In the load queue at once (a thread first, then the room: a waiting load evicts
            # nothing), so a miss arriving meanwhile sees this load ahead of it. While it waits:
            # - it goes into the record, so requests at other instances join it instead of
            #   placing a load of their own (loads wait seconds when the hot set moves). Refused
            #   (CopiesFull) when the model's max copies are already on serving holders;
            # - its size is asked of the runtime, not while it holds the thread the other loads
            #   wait for (3 ms of each load's hold on the peers bench, 2.6 % of it).
            waiting = asyncio.ensure_future(self._take_slot(model_id, record)) if self.load_queue else None
            try:
                past = await self.registry.add_copy(model_id, self.instance_id, self.clock(), self._serving())
                if past is None:
                    raise NotFound(f"model {model_id!r} was unregistered")
                recorded = True
                sizing = time.monotonic()
                predicted = await self.runtime.predict_size(model_id, record.type, record.path, record.key)
                self.metrics.model_sizing((time.monotonic() - sizing) * 1000, model_id)
                if waiting is not None:
                    await waiting
                    slot_held = True
            except BaseException:
                if waiting is not None and not slot_held:
                    await self._leave_queue(waiting)
                raise
            await self._admit(model_id, record, to_units(predicted) if predicted else None, past)
            admitted = True
            if self.registry.get(model_id) is None:
                raise NotFound(f"model {model_id!r} was unregistered while its load waited")
            self._wanted_last_used.pop(model_id, None)
            pending_unload = self._unloading.get(model_id)
            if pending_unload is not None:
                await asyncio.shield(pending_unload)
            self._check_runtime(model_id, epoch)
            try:
                slot_held, held = False, slot_held  # load() gives the thread back
                try:
                    loaded = await self.queue.load(model_id, record.type, record.path, record.key, slot_held=held)
                except LoadFailed as e:
                    if base is None or ADAPTER_SLOTS_FULL not in e.message or not await self._free_adapter_slot(base):
                        raise
                    loaded = await self.queue.load(model_id, record.type, record.path, record.key)
            except LoadFailed:
                self._check_runtime(model_id, epoch)  # a runtime gone meanwhile is not the model's fault
                raise
            if self.runtime_epoch != epoch:
                self._unload_later(model_id)  # it may have landed after the returning runtime's purge
            self._check_runtime(model_id, epoch)
            entry = self.cache.get(model_id)
            if entry is None:  # unregistered (or dropped) while loading
                self._unload_later(model_id)
                raise NotFound(f"model {model_id!r} was unregistered while loading")
            if loaded.size_bytes:
                self.metrics.loaded_model_size(loaded.size_bytes, model_id)
                self._evict_all(self.cache.resize(model_id, to_units(loaded.size_bytes), self._keep(model_id)))
            else:
                self._spawn(self._size_later(model_id))
            if self.info.limit_model_concurrency and loaded.max_concurrency > 0:
                bound = queue_bound(loaded.max_concurrency, self.max_queue_per_copy)
                entry.gate = CopyGate(model_id, loaded.max_concurrency, bound)
            # The counting orders' cost of a reload: the runtime's load time, not the wait for a slot (that
            # measures the moment's contention, not the model), on a monotonic clock.
            self.cache.set_state(model_id, State.LOADED, self.clock(), loaded.load_ms)
            self.counters.loads += 1
            _resolve(fut, entry)
        except LoadFailed as e:
            self.counters.load_failures += 1
            self.metrics.load_failure()
            self.cache.set_state(model_id, State.FAILED, self.clock())
            log.warning("%s", e.message)
            try:  # recorded before answering, so a status read right after shows it
                await self._quiet(self.registry.record_failure(model_id, self.instance_id, e.message, self.clock()))
            finally:
                _resolve(fut, e)
        except asyncio.CancelledError:
            self._forget_failed_admission(model_id, admitted, recorded)
            _resolve(fut, Unavailable(f"load of {model_id!r} was cancelled (instance stopping)"))
            raise
        except Exception as e:
            self._forget_failed_admission(model_id, admitted, recorded)
            if isinstance(e, RuntimeGone) and admitted:  # its entry went with the outage, maybe not its record
                self._spawn(self._remove_copy_bounded(model_id))
            if not isinstance(e, MeshError):
                log.exception("load of %s failed unexpectedly", model_id)
                e = Unavailable(f"load of {model_id!r} failed: {e}")
            _resolve(fut, e)
        finally:
            if slot_held:
                self.queue.release()
            done = self.cache.get(model_id)
            if done is None or done.state is not State.LOADED:
                self.bases.pop(model_id, None)  # an adapter that did not load holds its base no more
            self._loading.pop(model_id, None)
            self._wanted_last_used.pop(model_id, None)
            self._patience.pop(model_id, None)
            self._space_changed()  # the entry is now evictable, failed or gone
            self.on_change()

    async def _take_slot(self, model_id: str, record: ModelRecord) -> None:
        """Wait for a loading thread, at most its patience (`_patience`: the wait limit, or a
        patient request's deadline; then ResourceExhausted, which the router takes as a busy
        refusal and tries elsewhere). A load that requests waited on is in use now: its
        admission is dated now, not at its first request."""
        queued = self.clock()
        started = time.monotonic()
        self._demand[model_id] = (1, self.initial_units(record))
        loop = asyncio.get_running_loop()
        until = self._patience.get(model_id, started + self.load_wait_limit_ms / 1000)
        try:
            async with asyncio.timeout_at(loop.time() + until - started) as waiting:
                self._slot_timeouts[model_id] = waiting  # a patient joiner may put it off
                await self.queue.slot(model_id, lambda: self._value(model_id))
        except TimeoutError:
            self.metrics.load_refused()
            why = f"it waited {time.monotonic() - started:.1f} s for a loading thread"
            wait = self.queue.waiting * self.queue.mean_load_ms / max(1, self.queue.threads)
            raise LoadWaitExpired(exhausted_message(model_id, why, wait)) from None
        finally:
            self._slot_timeouts.pop(model_id, None)
            self._demand.pop(model_id, None)
        wanted = self._wanted_last_used.get(model_id)
        if wanted is not None:
            self._wanted_last_used[model_id] = admission_date(wanted, queued, self.clock())

    async def _leave_queue(self, waiting: asyncio.Future[None]) -> None:
        """A load that will not run gives up its place in the load queue (`_take_slot`): a
        thread it was handed goes back."""
        if not waiting.done():
            waiting.cancel()  # LoadQueue.slot gives back a thread handed over as it is cancelled
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await waiting
        elif not waiting.cancelled() and waiting.exception() is None:
            self.queue.release()

    def _check_runtime(self, model_id: str, epoch: int) -> None:
        if self.runtime_epoch != epoch:
            raise RuntimeGone(f"load of {model_id!r} abandoned: the runtime stopped answering meanwhile")

    def _forget_failed_admission(self, model_id: str, admitted: bool, recorded: bool) -> None:
        """A load that will not run: its room and its copy in the record go (recorded while it
        waited for a thread or room, it never took room)."""
        if admitted and self.cache.get(model_id) is not None:
            self._remove(model_id)
        elif not (recorded and not admitted and model_id not in self.cache):
            return
        self._spawn(self._quiet(self.registry.remove_copy(model_id, self.instance_id)))

    async def _size_later(self, model_id: str) -> None:
        sizing = time.monotonic()
        size = await self.runtime.model_size(model_id)
        self.metrics.model_sizing((time.monotonic() - sizing) * 1000, model_id)
        if size:
            self.metrics.loaded_model_size(size, model_id)
        if size and self.cache.get(model_id) is not None:
            self._evict_all(self.cache.resize(model_id, to_units(size), self._keep(model_id)))

    def _failure_message(self, model_id: str, record: ModelRecord) -> str:
        msg = record.fails.get(self.instance_id, {}).get("msg")
        return f"loading {model_id!r} failed recently here" + (f": {msg}" if msg else "")

    # ---- eviction and unloading ------------------------------------------------------
    async def _free_adapter_slot(self, base: str) -> bool:
        """Evict the least recently used loaded adapter of `base` here (its engine holds all
        the adapters it takes); False when there is none to evict."""
        victim = adapter_slot_victim(base, self.bases, self.cache.get)
        if victim is None:
            return False
        entry = self._remove(victim.model_id)
        if entry is None:
            return False
        log.info("%s's engine holds all the adapters it takes: evicting %s", base, victim.model_id)
        self._evict_all([entry])
        unloading = self._unloading.get(victim.model_id)
        if unloading is not None:
            await asyncio.shield(unloading)
        return True

    def _remove(self, model_id: str) -> CacheEntry | None:
        entry = self.cache.remove(model_id)
        if entry is not None:
            self._space_changed()
        return entry

    def _evict_all(self, victims: tuple[CacheEntry, ...] | list[CacheEntry]) -> None:
        victims = list(victims)
        gone = {v.model_id for v in victims}
        for adapter, base in list(self.bases.items()):  # an evicted base takes its adapters with it
            if base in gone and adapter not in gone:
                entry = self._remove(adapter)
                if entry is not None:
                    victims.insert(0, entry)
                    gone.add(adapter)
        for victim in victims:
            self.bases.pop(victim.model_id, None)
            log.info("evicting %s (%d units)", victim.model_id, victim.units)
            if victim.state is State.LOADED:
                self.counters.evictions += 1
                self.metrics.age_at_eviction(max(0, self.clock() - victim.last_used_ms), victim.model_id)
            self._unload_later(victim.model_id, victim)
        if victims:
            self._space_changed()
            self.on_change()

    def _unload_later(self, model_id: str, entry: CacheEntry | None = None) -> None:
        """Unload from the runtime after any earlier unload of the same model (tracked)."""
        previous = self._unloading.get(model_id)
        task = asyncio.get_running_loop().create_task(self._unload(model_id, entry, previous))
        self._unloading[model_id] = task
        self._tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            if self._unloading.get(model_id) is t:
                del self._unloading[model_id]

        task.add_done_callback(done)

    async def _unload(self, model_id: str, entry: CacheEntry | None, previous: asyncio.Task[None] | None) -> None:
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        # A capped copy leaves the runtime before it leaves the record: the record is what
        # lets another instance load it, so two runtimes never hold it at once.
        capped = entry is not None and self.capped(model_id)
        # An evicted copy's recent uses go with the record's copy removal (one write), for
        # whichever instance loads the model next (meshd.decisions.fleet_clock).
        history = entry.uses_at if entry is not None and entry.state is State.LOADED else ()
        # ... and, under the adaptive order, which order evicted it (meshd.decisions.regret).
        note = None
        if history and entry is not None and entry.evicted_by >= 0:
            note = (entry.evicted_by, entry.evicted_clock)
        if entry is not None:
            if not capped:
                await self._quiet(self.registry.remove_copy(model_id, self.instance_id, history, note))
            if self.before_unload is not None:
                await self._quiet(self.before_unload(model_id))
            waited = 0.0
            while entry.inflight > 0 and waited < UNLOAD_INFLIGHT_WAIT_S:
                await asyncio.sleep(INFLIGHT_POLL_S)
                waited += INFLIGHT_POLL_S
        started = time.monotonic()
        try:
            for attempt in range(CAPPED_UNLOAD_TRIES if capped else 1):
                try:
                    await self.runtime.unload(model_id)
                    self.metrics.unload((time.monotonic() - started) * 1000, model_id)
                    break
                except Exception as e:
                    self.metrics.unload_failure()
                    log.warning("unload of %s failed: %s", model_id, e)
                    if capped and attempt + 1 < CAPPED_UNLOAD_TRIES:
                        # Its record holds the cap until the runtime lets the copy go.
                        await asyncio.sleep(CAPPED_UNLOAD_RETRY_S)
        finally:
            if capped:  # also when the runtime never confirmed: a record kept forever serves nobody
                await self._quiet(self.registry.remove_copy(model_id, self.instance_id, history, note))

    def capped(self, model_id: str) -> bool:
        """Whether the model has a max copies (its key's policy)."""
        record = self.registry.get(model_id)
        return record is not None and at_max_copies(record.key, 1)

    def releasing(self, model_id: str) -> asyncio.Task[None] | None:
        """The unload under way of a capped copy no longer served here but still in its
        record (a request waits for it: only then may another instance load the model)."""
        task = self._unloading.get(model_id)
        if task is None or model_id in self.cache or not self.capped(model_id):
            return None
        return task

    async def _quiet(self, work: Awaitable[object]) -> None:
        """Registry bookkeeping that must not break the caller (logged, repaired later)."""
        try:
            await work
        except Exception as e:
            log.warning("registry update failed: %s", e)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- lifecycle -------------------------------------------------------------------
    async def reconcile(self, live: AbstractSet[str] | None = None) -> Repairs:
        """Repair drift between this cache and the registry (start-up and the janitor).

        `live`: instances with a record, to drop copies beyond a model's max copies."""
        table = self.registry.models
        live, leaving = self._liveness(live)
        entries = self.cache.entries()
        repairs = plan_repairs(self.instance_id, dict(table.items()), entries, table.corrupt, live, leaving)
        for mid in repairs.remove_from_records:
            # Still true after the awaits before it; not a load waiting for a thread or room (in
            # the record, not yet in the cache); not a capped copy still leaving the runtime
            # (its record goes once the runtime let it go).
            if mid not in self.cache and mid not in self._unloading and mid not in self._loading:
                await self._quiet(self.registry.remove_copy(mid, self.instance_id))
        for mid in repairs.add_to_records:
            entry = self.cache.get(mid)
            if entry is not None and entry.state is State.LOADED:
                try:
                    await self.registry.add_copy(mid, self.instance_id, entry.since_ms, self._serving())
                except CopiesFull:
                    pass  # filled up since the plan: the next round finds this copy surplus
                except Exception as e:
                    log.warning("registry update failed: %s", e)
        for mid in repairs.unload:
            if self.registry.get(mid) is None:
                self.drop(mid)
        for mid in repairs.surplus:
            if not self._still_surplus(mid, live):  # holders may have left during the awaits
                continue
            log.info("unloading %s: its max copies are loaded elsewhere", mid)
            # Out of the record before this returns: a rejoining instance must not count.
            await self._quiet(self.registry.remove_copy(mid, self.instance_id))
            self.shed(mid)
        if repairs:
            log.info("janitor repaired %s", repairs)
        return repairs

    def _serving(self) -> AbstractSet[str] | None:
        """The instances whose copies count toward max copies (None: no cluster view yet):
        live (shutting down too), or departed moments ago, and not lapsed (placement.liveness)."""
        if self.cluster_view is None:
            return None
        return counted_for_max_copies(self.cluster_view())

    def _liveness(self, live: AbstractSet[str] | None) -> tuple[AbstractSet[str] | None, AbstractSet[str]]:
        """`live` as the cluster shows it now (this instance left out if the caller left it
        out: it is rejoining), and the live instances that are leaving (shutdown flag)."""
        if live is None or self.cluster_view is None:
            return live, frozenset()
        instances = self.cluster_view().instances
        now_live = set(instances) if self.instance_id in live else set(instances) - {self.instance_id}
        return now_live, {iid for iid, inst in instances.items() if inst.shutdown}

    def _still_surplus(self, model_id: str, live: AbstractSet[str] | None) -> bool:
        """The surplus verdict again, on the records and cluster as they are now."""
        rec, entry = self.registry.get(model_id), self.cache.get(model_id)
        if rec is None or entry is None:
            return False
        now_live, leaving = self._liveness(live)
        return bool(plan_repairs(self.instance_id, {model_id: rec}, [entry], (), now_live, leaving).surplus)

    async def deregister_copies(self) -> None:
        """Remove this instance from the records of every copy it holds (copies stay loaded)."""
        for entry in self.cache.entries():
            await self._quiet(self.registry.remove_copy(entry.model_id, self.instance_id))

    async def release_capped(self, timeout_s: float) -> None:
        """Unload every capped copy still held, each leaving the runtime before its record, and
        wait for that (at most `timeout_s`): a stopping instance must not leave a capped model's
        record while its runtime still holds it (another could load it: one copy too many)."""
        for entry in self.cache.entries():
            if entry.state is State.LOADED and self.capped(entry.model_id):
                self.shed(entry.model_id)
        unloading = list(self._unloading.values())
        if unloading:
            await asyncio.wait(unloading, timeout=timeout_s)

    async def close(self, deregister: bool = True) -> None:
        """Stop background work; with `deregister`, remove this instance's copies from records
        (also those whose unload was cut short here)."""
        cut_short = list(self._unloading)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if deregister:
            await self.deregister_copies()
            for model_id in cut_short:
                if model_id not in self.cache:
                    await self._quiet(self.registry.remove_copy(model_id, self.instance_id))


def _resolve(fut: asyncio.Future[CacheEntry], outcome: CacheEntry | BaseException) -> None:
    """Settle the load's future unless it is already settled."""
    if fut.done():
        return
    if isinstance(outcome, BaseException):
        fut.set_exception(outcome)
    else:
        fut.set_result(outcome)


def _consume_exception(fut: asyncio.Future[CacheEntry]) -> None:
    # Async ensureLoaded leaves nobody awaiting; the failure is recorded elsewhere.
    if not fut.cancelled():
        fut.exception()
