"""Routes one inference call to a copy of its model: the routing attempts, and serving on a
local copy. Calls to peers are `forwarding`'s; what peers say to each other, `peer_protocol`'s.

External calls (`unary`): a loaded local copy serves at once (each peer hop costs as much
as the first). Otherwise a live copy elsewhere serves, chosen by placement; with no copy
anywhere, placement picks where to load, here or on a peer asked to load and serve.
Failures reroute with the failing instance excluded, up to 8 attempts (upstream's
iteration count): a peer that is gone, a copy that is not there, a load that failed.
Exhausted attempts answer UNAVAILABLE naming the model and what was tried, never INTERNAL.

Streams (`open_stream`) are routed the same way once, when they open, and stay on the
copy chosen; a peer accepts a stream before any request message is sent to it, so a
refusal reroutes with nothing lost. A copy whose runtime limits its concurrency lets that
many requests run, queues a bounded number and refuses the rest ("busy"): the request
tries other copies (twice more, as upstream) and then answers RESOURCE_EXHAUSTED.

Forwarded calls (`serve_forwarded`, `open_forwarded_stream`) arrive on the internal port
from a peer that chose this instance: serve the local copy, or load it first when asked to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar

import grpc

from meshd._proto.meshd import peer_pb2, peer_pb2_grpc
from meshd.core.errors import (
    DataLoss,
    LoadFailed,
    MeshError,
    ModelLoadError,
    NotFound,
    ResourceExhausted,
    Unavailable,
    means_model_missing,
)
from meshd.core.model_types import base_model_of
from meshd.core.records import ModelRecord, RecordError, VModelRecord
from meshd.decisions.cache import CacheEntry, State
from meshd.decisions.openai import CALL_METHOD
from meshd.decisions.placement.constraints import TypeConstraints
from meshd.decisions.placement.disk import pull_estimate_ms
from meshd.decisions.placement.liveness import trusted_peer
from meshd.decisions.placement.llm import (
    FRESH_MS,
    LOAD_HEADER,
    EngineLoad,
    PrefixOwners,
    choose_llm_copy,
    format_load,
    fresh,
    load_now,
)
from meshd.decisions.placement.loading import EXHAUSTED_PREFIX, fresh_loads
from meshd.decisions.placement.rank import (
    LoadRequest,
    Placement,
    PriceOffer,
    RecentPlacements,
    adapter_exclusions,
    background_load_used_ms,
    choose_load,
    load_here_as_last_resort,
)
from meshd.decisions.placement.serving import MAX_ATTEMPTS, MAX_BUSY_RETRIES, choose_copy
from meshd.decisions.placement.view import ClusterView
from meshd.decisions.status import failed_everywhere, given_up_message, recent_failures
from meshd.observability.metrics import NO_METRICS, Metrics
from meshd.observability.tracing import Tracing
from meshd.registry.models import CopiesFull, Registry
from meshd.serving.cluster import Cluster
from meshd.serving.forwarding import Forwarder
from meshd.serving.invocations import SERVED
from meshd.serving.local import LoadWaitExpired, LocalModels
from meshd.serving.peer_protocol import (
    AT_MAX,
    BUSY,
    LOAD_FAILED,
    NOT_HERE,
    REPRICED,
    PeerRefusal,
    Refused,
    peer_failure,
    runtime_failure,
)
from meshd.serving.peers import Peers, RawCalls
from meshd.serving.proxy.headers import Metadata, RequestIds, runtime_metadata
from meshd.serving.proxy.methods import MethodSpec
from meshd.serving.proxy.streams import Relay, ResponseStream
from meshd.serving.proxy.wire import inject_id

log = logging.getLogger(__name__)

MAX_RECENT_FAILURES = 3  # upstream gives up loading after 3 recent failures (SPEC §6)
PLACE_TIMEOUT_S = 10.0
# The longest a request waits for etcd's word on holders found unreachable (a live one
# renews its lease every 2 s at most, so the word comes sooner).
SETTLE_WAIT_S = 5.0
# How long a request waits for this runtime to be confirmed down (about 1 s of probes, then the
# copies' record removals) before it is rerouted anyway.
RUNTIME_CONFIRM_WAIT_S = 5.0
# How long a request waits for a capped copy leaving this runtime (its unload waits for the
# copy's requests in flight) before it is routed anyway.
RELEASE_WAIT_S = 10.0

GRPC_MASKED_STATUS = "Internal error from Core"  # grpc/grpc#36066, see open_entry_stream
_RUNTIME_HOP = {"meshd.hop": "runtime"}  # the runtime call's span attribute

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Attempt(Protocol[T_co]):
    """What one request does once a copy is chosen: serve from a loaded local copy, load
    here and serve, or go to a peer. `retarget` is the same request for another model (a
    vmodel that moved)."""

    model_id: str

    async def local(self, entry: CacheEntry) -> T_co: ...

    async def here(self, record: ModelRecord) -> T_co: ...

    async def peer(self, target: str, mode: str, price_limit: float | None = None) -> T_co: ...

    def retarget(self, model_id: str) -> Attempt[T_co]: ...


class Router:
    def __init__(
        self,
        local: LocalModels,
        registry: Registry,
        serving_channel: grpc.aio.Channel,
        cluster: Cluster,
        peers: Peers,
        failure_expiry_ms: int,
        rng: random.Random | None = None,
        constraints: TypeConstraints | None = None,
        labels: frozenset[str] = frozenset(),
        metrics: Metrics = NO_METRICS,
        tracing: Tracing | None = None,
        note_served: bool = True,
    ) -> None:
        self.metrics = metrics
        self.tracing = tracing  # None: tracing off (meshd.observability.tracing)
        # Who served a call, for the per-call metrics and log (meshd.serving.invocations); with both
        # off nothing reads it, so the request path skips the context-variable write.
        self.note_served = note_served
        self.constraints = constraints or TypeConstraints()
        self.labels = labels
        self.local = local
        self.registry = registry
        self.cluster = cluster
        self.peers = peers
        self.failure_expiry_ms = failure_expiry_ms
        self.rng = rng or random.Random()
        self.self_id = local.instance_id
        self.runtime_calls = RawCalls(serving_channel)
        self.forwarder = Forwarder(self.self_id, cluster, peers, tracing, note_served)
        self.inflight = self.forwarder.inflight  # requests this instance has in flight per peer
        self._placed = RecentPlacements()  # loads placed lately, per instance
        # Language models' calls (OpenAI port) go where they start soonest, their long prompt
        # prefixes where they were served last (decisions.placement.llm); False: as any
        # inference (local first, then the fewest in flight), MESHD_LLM_ROUTING=inflight.
        self.llm_routing = True
        self.prefixes = PrefixOwners()
        self.forwarded = 0  # external requests served by a peer (share of peer hops)
        # The native data plane: told of each model routed here without a local copy (its peer routes).
        self.noticed: Callable[[str], None] | None = None
        # Probes the runtime at once after it refused a call (meshd.loops.runtime_watch).
        self.runtime_unreachable: Callable[[], Awaitable[None]] | None = None

    # ---- lookups ---------------------------------------------------------------------
    async def place(
        self, model_id: str, exclude: frozenset[str] = frozenset(), last_used_ms: int | None = None
    ) -> str | None:
        """Start loading one more copy somewhere (placement's choice); never waits for it.

        `last_used_ms` dates the new copy in its cache (default: the record's last use, so a
        hand-over or preload does not push out models used more recently). Returns the
        instance asked, or None when no instance could take it.
        """
        try:
            record = await self.record(model_id)
        except MeshError as e:
            log.warning("cannot place %s: %s", model_id, e.message)
            return None
        view = self.cluster.view()
        holders = frozenset(i for i in record.instance_ids if i == self.self_id or view.live(i))
        expiry = self.failure_expiry_ms
        failed = frozenset(recent_failures(record.failed_in, view.now_ms, expiry))
        placed = self._load_target(view, model_id, record, exclude | holders | failed, prefer_self=False)
        if placed is None:
            return None
        target = placed.target
        used = background_load_used_ms(last_used_ms, record.last_used, view.now_ms)
        if target == self.self_id:
            self.local.start_load(model_id, record, used)
            return target
        inst = view.get(target)
        if inst is None:
            return None
        stub = peer_pb2_grpc.MeshPeerStub(self.peers.get(target, inst.location).channel)
        req = peer_pb2.InternalOpRequest(modelId=model_id, load=True, lastUsed=used)
        try:
            resp = await stub.InternalOperation(req, timeout=PLACE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.warning("asking %s to load %s failed: %s", target, model_id, e.details())
            return None
        if resp.state == peer_pb2.InternalOpResponse.FAILED:
            return None
        return target

    async def unload_copies(self, model_id: str) -> list[str]:
        """Unload every copy of the model in the mesh (it stays registered); the holders asked."""
        record = await self.record(model_id)
        view = self.cluster.view()
        asked: list[str] = []
        for iid in sorted(record.instance_ids):
            if iid == self.self_id:
                await self.local.unload_now(model_id)
            else:
                inst = view.get(iid)
                if inst is None or not inst.location:
                    continue  # gone: its copy goes with it
                stub = peer_pb2_grpc.MeshPeerStub(self.peers.get(iid, inst.location).channel)
                try:
                    await stub.InternalOperation(peer_pb2.InternalOpRequest(modelId=model_id, unload=True), timeout=10)
                except grpc.aio.AioRpcError as e:
                    log.warning("asking %s to unload %s failed: %s", iid, model_id, e.details())
                    continue
            asked.append(iid)
        return asked

    async def record(self, model_id: str) -> ModelRecord:
        """The model's record; a strong read when the mirror has not seen it yet."""
        rec = self.registry.get(model_id)
        if rec is not None:
            return rec
        return await self.registry.fetch(model_id)

    # ---- external calls ----------------------------------------------------------------
    async def unary(
        self, spec: MethodSpec, request: bytes, ids: RequestIds, forward: Metadata, remaining_s: float | None
    ) -> bytes:
        """Serve one external unary call; `remaining_s` is the client's deadline (None: none)."""
        deadline = _deadline_after(remaining_s)
        self.local.counters.requests += 1
        model_id = ids.model_id or await self.resolve_vmodel(ids.vmodel_id or "")
        if self.tracing is not None:
            self.tracing.note_model(model_id, ids.vmodel_id)
        return await self._serve_ids(ids, _Unary(self, spec, request, model_id, forward, deadline))

    async def open_stream(
        self,
        spec: MethodSpec,
        first: bytes | None,
        requests: AsyncIterator[bytes],
        ids: RequestIds,
        forward: Metadata,
        remaining_s: float | None,
    ) -> ResponseStream:
        """Open one external stream on a copy of its model; the caller relays and closes it.

        The copy is chosen once, when the stream opens (a peer accepts it before any request
        message is sent, so refusals reroute); the stream then stays on that copy.
        `first`: a request message already read (for id extraction), sent first.
        """
        deadline = _deadline_after(remaining_s)
        self.local.counters.requests += 1
        model_id = ids.model_id or await self.resolve_vmodel(ids.vmodel_id or "")
        if self.tracing is not None:
            self.tracing.note_model(model_id, ids.vmodel_id)
        return await self._serve_ids(ids, _Stream(self, spec, first, requests, model_id, forward, deadline))

    async def open_answered(
        self,
        spec: MethodSpec,
        request: bytes,
        ids: RequestIds,
        forward: Metadata,
        remaining_s: float | None,
        direct: DirectOpen | None = None,
        prefix: str | None = None,
    ) -> Answered:
        """One request message, its answer a stream: routed like a unary call until the first
        answer arrives (a copy or peer failing before then is tried no more and the request
        goes elsewhere, as nothing has reached the client yet), then relayed as it comes.
        `remaining_s` is the whole call's deadline (None: none); the caller bounds routing and
        the first answer itself (an LLM answer may run long). `direct`: how the caller streams
        a local copy's answer itself (open_direct); peers' copies are always relayed. A language
        model's call is routed by its engines' load and its `prefix` (decisions.placement.llm)."""
        deadline = _deadline_after(remaining_s)
        self.local.counters.requests += 1
        model_id = ids.model_id or await self.resolve_vmodel(ids.vmodel_id or "")
        if self.tracing is not None:
            self.tracing.note_model(model_id, ids.vmodel_id)
        stream = _Stream(self, spec, request, _no_more(), model_id, forward, deadline)
        return await self._serve_ids(ids, _Answered(stream, direct, prefix))

    async def _serve_ids(self, ids: RequestIds, attempt: Attempt[T]) -> T:
        if ids.vmodel_id is None:
            return await self._serve(attempt, ids.balanced)
        try:
            return await self._serve(attempt, ids.balanced)
        except NotFound:
            # The active model went away (an autoDelete switch) before this instance saw the
            # vmodel move: read the vmodel from etcd and try its new active model once.
            current = await self.resolve_vmodel(ids.vmodel_id, strong=True)
            if current == attempt.model_id:
                raise NotFound(
                    f"model {attempt.model_id!r} (active model of vmodel {ids.vmodel_id!r}) not found"
                ) from None
            return await self._serve(attempt.retarget(current), ids.balanced)

    async def resolve_vmodel(self, vmodel_id: str, strong: bool = False) -> str:
        vrec = None if strong else self.registry.vmodels.get(vmodel_id)
        if vrec is None:
            kv = await self.registry.vmodels.store.get(self.registry.vmodels.key(vmodel_id))
            if kv is None:
                raise NotFound(f"vmodel {vmodel_id!r} not found")
            try:
                vrec = VModelRecord.decode(kv.value)
            except RecordError as e:
                raise DataLoss(f"stored record for vmodel {vmodel_id!r} is corrupt: {e}") from None
        return vrec.active_model

    async def _serve(self, attempt: Attempt[T], balanced: bool) -> T:
        model_id = attempt.model_id
        entry = self.local.cache.get(model_id)
        llm = self.llm_routing and isinstance(attempt, _Answered) and not balanced  # chosen by load
        if entry is not None and entry.state is State.LOADED and not llm:  # the common case, kept short
            self.local.counters.hits += 1
            # A hit arrived here too: the load queue's popularity counts every arrival, as
            # the simulator does (a refused hit rerouted is not counted again in _route).
            self.local.popularity.count(model_id)
            self.local.cache.touch(model_id, self.local.clock())
            if self.local.bases:
                self._touch_base(model_id)
            try:
                return await attempt.local(entry)
            except Refused as e:
                # e.g. its runtime is down: do not ask it again
                excluded = {self.self_id} if e.exclude else set()
                tried = [f"{self.self_id} (serve): {e}"]
                return await self._route(model_id, balanced, excluded, int(e.busy), attempt, tried)
        return await self._route(model_id, balanced, set(), 0, attempt, [])

    async def _route(
        self, model_id: str, balanced: bool, excluded: set[str], busy: int, attempt: Attempt[T], tried: list[str]
    ) -> T:
        """Try copies (or loads) until one serves; `busy`: refusals for a full queue so far,
        `tried`: what was tried already (the local copy), for the final message."""
        record = await self.record(model_id)
        await self._after_release(model_id)
        if not tried:  # on arrival (a local hit was counted in _serve), not on a retry
            self.local.popularity.count(model_id)
            if self.noticed is not None:
                self.noticed(model_id)
        known: dict[str, int] = {}  # holders learnt from a load refused at max copies
        exhausted = 0  # loads refused for load capacity (the load queue's limits)
        exhausted_why = ""  # the last such refusal's reason
        refused_load: set[str] = set()  # peers excluded only for refusing a load at max copies
        failed_now: dict[str, str] = {}  # instances whose load failed for this request: why
        # Holders found unreachable that etcd says are alive, asked once more: a partition
        # that healed leaves its mark for a while, and a capped model has no other copy.
        retry: list[str] | None = None  # made only when a refusal names such holders
        retried: frozenset[str] = frozenset()
        offer = PriceOffer()  # placement by price, once per request
        for _ in range(MAX_ATTEMPTS):
            record = self.registry.get(model_id) or record
            view = self.cluster.view()
            now = view.now_ms
            entry = self.local.cache.get(model_id)
            local_loaded = entry is not None and entry.state is State.LOADED and self.self_id not in excluded
            # choose_copy itself ignores excluded and dead holders: no filtered copy here.
            copies = {**known, **record.instance_ids} if known else record.instance_ids
            assume = self.cluster.assume_loaded_ms(record.type)  # learnt from loads so far
            while retry and (retry[-1] in excluded or retry[-1] in view.lapsed):
                retry.pop()  # found gone, or refused, since it was queued for another try
            target = (
                retry.pop()
                if retry
                else self._llm_copy(view, model_id, copies, excluded, entry, local_loaded, attempt, assume)
                if self.llm_routing and isinstance(attempt, _Answered) and not balanced
                else choose_copy(
                    view,
                    copies,
                    self.inflight,
                    excluded,
                    assume,
                    local_loaded,
                    balanced,
                )
            )
            mode = "serve"
            price_limit: float | None = None
            if target is None:
                if busy:  # every copy is saturated: a new load would not answer in time
                    raise ResourceExhausted(f"model {model_id!r}: every copy is at its concurrency limit")
                expiry = self.failure_expiry_ms
                recent = recent_failures(record.failed_in, now, expiry)
                if len(recent) >= MAX_RECENT_FAILURES:
                    raise ModelLoadError(given_up_message(model_id, record, recent))
                avoid = frozenset(excluded | set(recent))
                placed = self._load_target(view, model_id, record, avoid, balanced, offer.ceiling)
                mode = "load"
                if placed is None:
                    if not load_here_as_last_resort(
                        view, excluded, self.labels, self.constraints.for_type(record.type)[0]
                    ):
                        break
                    target = self.self_id  # nothing better known (alone, or records not yet seen)
                else:
                    target = placed.target
                    price_limit = offer.limit_for(placed, self.self_id)
            try:
                if target == self.self_id:
                    return await attempt.here(record)
                self.forwarded += 1
                answer = await attempt.peer(target, mode, price_limit)
                if target in retried:
                    self.cluster.note_reachable(target)
                return answer
            except Refused as e:
                if e.repriced and price_limit is not None:
                    offer.refused(price_limit)
                # A load placed by price and refused for it is routine (records lag): not news.
                log.log(
                    logging.DEBUG if e.repriced else logging.INFO, "rerouting %s away from %s: %s", model_id, target, e
                )
                tried.append(f"{target} ({mode}): {e}")
                if e.load_failed:
                    failed_now[target] = str(e).removeprefix(f"{LOAD_FAILED}: ").removeprefix("meshd: ")
                if e.exclude:
                    excluded.add(target)
                if e.unreachable:
                    # Its record may be stale (killed, frozen) or this instance cut off from it:
                    # its copies are not tried for a while, and etcd is asked which it is
                    # (placement.liveness).
                    self.cluster.note_unreachable(target)
                if e.holders is not None:
                    # Another instance won the copy (its record write came first): serve
                    # there, as the mirror may not show it yet, even from a peer that refused
                    # to load it before it did.
                    holders = e.holders or await self._holders(model_id)
                    known.update(holders)
                    excluded -= refused_load & set(holders)
                    # Holders just found unreachable: whether they are gone or only cut off from
                    # here (etcd's word on their leases) decides whether a copy may load.
                    await self.cluster.settle(holders, SETTLE_WAIT_S)
                    settled = self.cluster.view()
                    if target != self.self_id and holders and set(holders) <= settled.unreachable:
                        # That peer counts a holder this instance found unreachable: do not ask
                        # it to load again; load where the evidence is (here, as a last resort).
                        excluded.add(target)
                        refused_load.add(target)
                    again = [
                        h
                        for h in holders
                        if h in settled.unreachable and h not in settled.lapsed and h not in retried | excluded
                    ]
                    if again:
                        retried = retried | set(again)
                        retry = [*(retry or ()), *again]
                if e.busy and EXHAUSTED_PREFIX in str(e):  # no loading thread in time there
                    exhausted += 1
                    exhausted_why = _exhausted_reason(str(e))
                    if exhausted > MAX_BUSY_RETRIES:
                        raise ResourceExhausted(f"model {model_id!r}: {exhausted_why}") from None
                elif e.busy:
                    busy += 1
                    if busy > MAX_BUSY_RETRIES:
                        message = f"model {model_id!r}: copies at their concurrency limit ({e})"
                        raise ResourceExhausted(message) from None
        record = self.registry.get(model_id) or record
        recent = recent_failures(record.failed_in, self.cluster.view().now_ms, self.failure_expiry_ms)
        given_up = failed_everywhere(model_id, excluded, record, recent, failed_now)
        if given_up is not None:  # every instance tried failed to load it (upstream: INTERNAL)
            raise ModelLoadError(given_up)
        if exhausted and exhausted == len(tried):
            # Fewer instances than attempts (a lone one, say), each refused for load capacity:
            # worth a retry later, not an unavailable model. Any other failure among them
            # (unreachable, runtime down) keeps UNAVAILABLE with every attempt's reason.
            raise ResourceExhausted(f"model {model_id!r}: {exhausted_why}")
        raise Unavailable(
            f"model {model_id!r}: no instance could serve it after {len(tried)} attempts: "
            + ("; ".join(tried) or "no live instance")
        )

    def _llm_copy(
        self,
        view: ClusterView,
        model_id: str,
        copies: dict[str, int],
        excluded: set[str],
        entry: CacheEntry | None,
        local_loaded: bool,
        attempt: _Answered,
        assume: int,
    ) -> str | None:
        """A language model's copy (decisions.placement.llm), remembered for its prefix."""
        inflight = {peer: n for (model, peer), n in self.forwarder.model_inflight.items() if model == model_id}
        inflight[self.self_id] = entry.inflight if entry is not None else 0
        loads = fresh(self.forwarder.engine_loads.get(model_id, {}), int(time.monotonic() * 1000), inflight)
        prefix = attempt.prefix
        owner = self.prefixes.get(model_id, prefix) if prefix is not None else None
        target = choose_llm_copy(view, copies, inflight, loads, excluded, assume, local_loaded, owner)
        if target is not None and prefix is not None:
            self.prefixes.served(model_id, prefix, target)
        return target

    def engine_load_here(self, model_id: str) -> Metadata:
        """This copy's load, for a peer that forwarded a language model's call: the calls in
        flight to it now, with its engine's reading when fresh, as of now (`meshd-engine-load`)."""
        inflight = self._local_inflight(model_id)
        reading = self.forwarder.engine_loads.get(model_id, {}).get(self.self_id)
        if reading is not None and int(time.monotonic() * 1000) - reading.at_ms <= FRESH_MS:
            load = load_now(reading, inflight)
        else:
            load = EngineLoad(inflight)
        return ((LOAD_HEADER, format_load(load)),)

    def _local_inflight(self, model_id: str) -> int:
        entry = self.local.cache.get(model_id)
        return entry.inflight if entry is not None else 0

    async def note_runtime_load(self, model_id: str, stream: ResponseStream) -> None:
        """The engine load the runtime sent with a call's first answer."""
        with contextlib.suppress(Exception):  # a call that ended: no reading
            metadata = await stream.call.initial_metadata()
            self.forwarder.note_engine_load(model_id, self.self_id, metadata, self._local_inflight(model_id))

    async def _after_release(self, model_id: str) -> None:
        """Wait while this runtime gives up a capped copy still in the model's record: until
        it is gone a load elsewhere is refused (max copies), and the request would spend its
        attempts on refusals."""
        releasing = self.local.releasing(model_id)
        if releasing is not None:
            # Bounded: the unload waits for the copy's requests in flight (long streams, too).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(releasing), RELEASE_WAIT_S)

    async def _holders(self, model_id: str) -> dict[str, int]:
        """The model's holders as etcd has them now (a strong read; none if unreadable)."""
        try:
            return dict((await self.registry.fetch(model_id)).instance_ids)
        except Unavailable:
            return {}

    def is_peer(self, instance_id: str) -> bool:
        """An instance of this mesh, live, departed moments ago, or gone less than 10 min ago
        (cut off from etcd, still forwarding): forwarded calls are accepted only from those
        (placement.liveness)."""
        return trusted_peer(self.cluster.view(), instance_id, self.cluster.gone_since_ms(instance_id))

    def _load_target(
        self,
        view: ClusterView,
        model_id: str,
        record: ModelRecord,
        exclude: frozenset[str],
        prefer_self: bool,
        price_ceiling: float | None = None,
    ) -> Placement | None:
        """Where a copy should load (placement's pick), remembered for the next picks;
        `price_ceiling`: the limit of a load placed by price that its target refused."""
        required, preferred = self.constraints.for_type(record.type)
        base = base_model_of(record.key)
        if base is not None:  # an adapter: where its base is loaded, when it is loaded anywhere
            base_record = self.registry.get(base)
            holders = frozenset(base_record.instance_ids) if base_record is not None else frozenset()
            exclude = adapter_exclusions(frozenset(view.instances), holders, exclude)
        size_units = self.local.initial_units(record)
        request = LoadRequest(
            model_id=model_id,
            model_type=record.type,
            size_units=size_units,
            exclude=exclude,
            required_labels=required,
            preferred_labels=preferred,
            prefer_self=prefer_self,
            recent_placements=self._placed.counts(view.now_ms),
            start_soonest=self.local.load_queue,
            price_ceiling=price_ceiling,
            # Issue 42: where records say the model's files are on an instance's disk tier, a
            # load there skips the pull (loading.ready_soonest); None when no record has a tier
            pull_ms=pull_estimate_ms((i.disk for i in view.instances.values()), size_units),
            mean_load_ms=self.local.queue.mean_load_ms,
        )
        loads = fresh_loads(self.forwarder.peer_loads, int(time.monotonic() * 1000))
        loads[self.self_id] = self.local.loads_in_progress
        cache = self.local.cache
        view = view.with_loads(loads).with_own_cache(cache.used_units, cache.victim_value())
        placed = choose_load(view, request, self.rng)
        if placed is not None:
            self._placed.add(view.now_ms, placed.target)
        return placed

    # ---- serving here ----------------------------------------------------------------
    async def ensure_here(self, model_id: str, record: ModelRecord, deadline: float | None = None) -> CacheEntry:
        """The local copy, loaded first if need be; a copy that cannot load here is Refused.
        `deadline`: when the request gives up (time.monotonic() seconds), for the load queue.

        The entry serves even if a concurrent load evicts it meanwhile: requests count as
        in flight, and the unload waits for them."""
        try:
            return await self._ensure(model_id, record, deadline)
        except CopiesFull as e:  # not loaded here: the holders serve it
            raise Refused(e.message, exclude=False, holders=e.holders) from None
        except LoadFailed as e:
            raise Refused(e.message, load_failed=True) from None
        except Unavailable as e:  # incl. NoRoom, and a runtime down for now
            raise Refused(e.message) from None
        except LoadWaitExpired:  # waited the load queue's limit here: answered, not rerouted
            raise
        except ResourceExhausted as e:  # the load queue could not take it: try elsewhere
            raise Refused(e.message, busy=True) from None

    async def _ensure(self, model_id: str, record: ModelRecord, deadline: float | None = None) -> CacheEntry:
        """`local.ensure`, in a `meshd.load` span when tracing and the copy is not loaded yet."""
        entry = self.local.cache.get(model_id)
        if self.tracing is None or (entry is not None and entry.state is State.LOADED):
            return await self.local.ensure(model_id, record, deadline=deadline)
        with self.tracing.span("meshd.load", {"meshd.model_id": model_id}):
            return await self.local.ensure(model_id, record, deadline=deadline)

    async def _enter(self, entry: CacheEntry) -> float:
        """Take a slot on the copy (its concurrency limit, if any): the start time, for service time.

        Counted in flight while queued too, so an eviction's unload waits for queued requests."""
        self.local.acquire(entry)
        gate = entry.gate
        if gate is not None:
            queued = time.perf_counter()
            try:
                if self.tracing is None:
                    await gate.enter()
                else:
                    with self.tracing.span("meshd.queue", {"meshd.model_id": entry.model_id}):
                        await gate.enter()
                self.metrics.req_queue_delay((time.perf_counter() - queued) * 1000, entry.model_id)
            except BaseException as e:
                self.local.release(entry)
                if isinstance(e, ResourceExhausted):
                    raise Refused(e.message, busy=True) from None
                raise
        return time.monotonic() if gate is not None else 0.0

    def _leave(self, entry: CacheEntry, started: float, timed: bool = True) -> None:
        """Give the slot back; `timed`: feed the service time to copy scaling (unary only: a
        stream's lifetime says nothing about how fast the copy serves)."""
        self.local.release(entry)
        if entry.gate is not None:
            entry.gate.leave((time.monotonic() - started) * 1000 if timed else None)

    def _count_served(self, entry: CacheEntry) -> None:
        self.local.counters.served += 1
        entry.served += 1

    async def _serve_entry(
        self,
        entry: CacheEntry,
        spec: MethodSpec,
        request: bytes,
        model_id: str,
        metadata: Metadata,
        remaining_s: float | None,
    ) -> bytes:
        """Forward to the runtime through a loaded local copy."""
        if spec.inject:
            request = inject_id(request, spec.inject, model_id)
        started = await self._enter(entry)
        self._count_served(entry)
        if self.note_served:
            SERVED.set((model_id, self.self_id))
        invoked = time.perf_counter()
        try:
            call = self.runtime_calls.unary(spec.path)
            response: bytes
            if self.tracing is None:
                response = await call(request, metadata=metadata, timeout=remaining_s)
            else:
                response = await self.tracing.call_unary(call, spec.path, request, metadata, remaining_s, _RUNTIME_HOP)
            self.metrics.invoke_model(spec.path, "OK", (time.perf_counter() - invoked) * 1000, model_id)
            return response
        except grpc.aio.AioRpcError as e:
            code = e.code()
            self.metrics.invoke_model(spec.path, code.name, (time.perf_counter() - invoked) * 1000, model_id)
            missing = means_model_missing(code, e.details() or "")
            if missing and await self.local.runtime.has_model(model_id) is False:
                # Confirmed lost (the runtime restarted): drop the copy and reroute; loading
                # here again is allowed. Any other "not found" (an unknown version, say) is
                # the runtime's own answer and goes to the client, the copy untouched.
                self.local.lost(model_id, entry)
                raise Refused(f"the runtime no longer has {model_id!r}", exclude=False) from None
            await self.runtime_refused(code, remaining_s)
            raise runtime_failure(code, e.details()) from None
        finally:
            self._leave(entry, started)

    async def runtime_refused(self, code: grpc.StatusCode, remaining_s: float | None) -> None:
        """The runtime answered UNAVAILABLE: have it probed now (`runtime_unreachable`), so
        that a dead runtime's copies leave the records before the request is rerouted; waited
        for at most `RUNTIME_CONFIRM_WAIT_S` and the request's time left."""
        if code != grpc.StatusCode.UNAVAILABLE or self.runtime_unreachable is None:
            return
        wait_s = RUNTIME_CONFIRM_WAIT_S if remaining_s is None else min(RUNTIME_CONFIRM_WAIT_S, remaining_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.runtime_unreachable()), max(0.0, wait_s))

    async def open_entry_stream(
        self,
        entry: CacheEntry,
        spec: MethodSpec,
        first: bytes | None,
        requests: AsyncIterator[bytes],
        model_id: str,
        metadata: Metadata,
        remaining_s: float | None,
    ) -> ResponseStream:
        """A stream to the runtime through a loaded local copy; it holds one slot while open.

        Each request message has the id spliced in (if the method asks) and counts as one
        request served. Once open, the runtime's answers go to the client as they are."""
        started = await self._enter(entry)
        if self.note_served:
            SERVED.set((model_id, self.self_id))

        def on_message(message: bytes) -> bytes:
            self._count_served(entry)
            return inject_id(message, spec.inject, model_id) if spec.inject else message

        relay = Relay(first, requests, on_message)
        if self.tracing is not None:  # a stream's span is its server span: pass its context on
            metadata = self.tracing.inject(metadata)
        try:
            call = self.runtime_calls.stream(spec.path)(relay, metadata=metadata, timeout=remaining_s)
        except BaseException:
            self._leave(entry, started, timed=False)
            raise

        def on_error(e: grpc.aio.AioRpcError) -> None:
            # grpc.aio reports INTERNAL "Internal error from Core" instead of the runtime's own
            # status when the runtime ended the stream while a message was on its way to it
            # (grpc/grpc#36066): the status is lost, so check the copy then too.
            masked = e.code() == grpc.StatusCode.INTERNAL and (e.details() or "") == GRPC_MASKED_STATUS
            if masked or means_model_missing(e.code(), e.details() or ""):
                self.local.check_lost(model_id, entry)  # confirmed in the background, then dropped

        return ResponseStream(call, relay, lambda: self._leave(entry, started, timed=False), on_error)

    async def open_entry_answer(
        self,
        entry: CacheEntry,
        spec: MethodSpec,
        request: bytes,
        model_id: str,
        metadata: Metadata,
        remaining_s: float | None,
    ) -> ResponseStream:
        """One request message to the runtime through a loaded local copy, its answers a stream
        (a unary-stream call: one message needs no request relay); holds one slot while open."""
        started = await self._enter(entry)
        try:
            self._count_served(entry)
            if self.note_served:
                SERVED.set((model_id, self.self_id))
            if spec.inject:
                request = inject_id(request, spec.inject, model_id)
            if self.tracing is not None:
                metadata = self.tracing.inject(metadata)
            call = self.runtime_calls.unary_stream(spec.path)(request, metadata=metadata, timeout=remaining_s)
        except BaseException:
            self._leave(entry, started, timed=False)
            raise
        return ResponseStream(call, Relay(None, _no_more(), None), lambda: self._leave(entry, started, timed=False))

    async def open_direct(
        self,
        entry: CacheEntry,
        spec: MethodSpec,
        model_id: str,
        metadata: Metadata,
        direct: DirectOpen,
        remaining_s: float | None,
    ) -> Answered | None:
        """A local copy's answer streamed by `direct` from where the runtime says it is served
        (an LLM engine's port), not relayed through the runtime; None when `direct` declines
        (nothing sent to the client: the runtime relays it instead). Holds one slot while open
        and counts as served, like open_entry_answer."""

        async def ask(request: bytes) -> bytes | None:
            call = self.runtime_calls.unary_stream(spec.path)(request, metadata=metadata, timeout=remaining_s)
            try:
                async for answer in call:
                    # The engine's load, as a relayed call's first answer brings it (note_runtime_load).
                    said = await call.initial_metadata()
                    self.forwarder.note_engine_load(model_id, self.self_id, said, entry.inflight)
                    return bytes(answer)
            except grpc.aio.AioRpcError:
                return None  # the relayed call meets the same refusal and handles it
            finally:
                call.cancel()
            return None

        started = await self._enter(entry)
        try:
            answered = await direct(entry, model_id, ask)
        except BaseException:
            self._leave(entry, started, timed=False)
            raise
        if answered is None:
            self._leave(entry, started, timed=False)
            return None
        self._count_served(entry)
        if self.note_served:
            SERVED.set((model_id, self.self_id))
        answered.on_close(lambda: self._leave(entry, started, timed=False))
        return answered

    # ---- calls forwarded by peers ------------------------------------------------------
    async def forwarded_entry(
        self, model_id: str, mode: str, deadline: float | None = None, price_limit: float | None = None
    ) -> CacheEntry:
        """The copy a peer's call is served from (loading it first in "load" mode; `deadline`:
        when the call gives up, time.monotonic() seconds, for the load queue; `price_limit`: a
        load placed by price, taken only if it `stays` here).

        Refusals carry `meshd-reason` in the trailing metadata so the peer reroutes."""
        self.local.counters.requests += 1
        if self.tracing is not None:
            self.tracing.note_model(model_id, None)
        if mode == "load":
            record = await self.record(model_id)
            if price_limit is not None and not self.local.takes_priced_load(model_id, record, price_limit):
                raise PeerRefusal(REPRICED, f"{self.self_id} would evict more for {model_id!r}, or queue it")
            try:
                return await self._ensure(model_id, record, deadline)  # served even if evicted since
            except LoadFailed as e:
                raise PeerRefusal(LOAD_FAILED, e.message) from None
            except CopiesFull as e:
                raise PeerRefusal(AT_MAX, e.message) from None
            except Unavailable as e:  # no room, or the runtime down for now
                raise PeerRefusal(NOT_HERE, e.message) from None
        entry = self.local.cache.get(model_id)
        pending = self.local.pending(model_id)
        if pending is not None:
            # The sender picked a copy still loading: wait for it here rather than have
            # the sender load yet another copy elsewhere.
            try:
                return await asyncio.shield(pending)
            except LoadFailed as e:
                raise PeerRefusal(LOAD_FAILED, e.message) from None
            except CopiesFull as e:
                raise PeerRefusal(AT_MAX, e.message) from None
            except MeshError as e:
                raise PeerRefusal(NOT_HERE, e.message) from None
        if entry is None or entry.state is not State.LOADED:
            await self._after_release(model_id)  # the sender may load it elsewhere once it is gone
            raise PeerRefusal(NOT_HERE, f"no loaded copy of {model_id!r} on {self.self_id}")
        self.local.counters.hits += 1
        self.local.cache.touch(model_id, self.local.clock())
        if self.local.bases:
            self._touch_base(model_id)
        return entry

    def _touch_base(self, model_id: str) -> None:
        """A LoRA adapter's use is its base's too: the base stays while its adapters are used."""
        base = self.local.bases.get(model_id)
        if base is not None:
            self.local.cache.touch(base, self.local.clock())

    async def serve_forwarded(
        self,
        spec: MethodSpec,
        request: bytes,
        model_id: str,
        mode: str,
        metadata: Metadata,
        remaining_s: float | None,
        price_limit: float | None = None,
    ) -> bytes:
        """A peer's unary call: serve from the local copy (loading first in "load" mode)."""
        deadline = _deadline_after(remaining_s)
        entry = await self.forwarded_entry(model_id, mode, deadline, price_limit)
        try:
            return await self._serve_entry(entry, spec, request, model_id, metadata, _left(deadline))
        except Refused as e:
            raise PeerRefusal(BUSY if e.busy else NOT_HERE, str(e)) from None

    async def open_forwarded_stream(
        self,
        spec: MethodSpec,
        requests: AsyncIterator[bytes],
        model_id: str,
        mode: str,
        metadata: Metadata,
        remaining_s: float | None,
        price_limit: float | None = None,
    ) -> ResponseStream:
        """A peer's stream, on the local copy; the caller accepts it, relays and closes it."""
        deadline = _deadline_after(remaining_s)
        entry = await self.forwarded_entry(model_id, mode, deadline, price_limit)
        try:
            return await self.open_entry_stream(entry, spec, None, requests, model_id, metadata, _left(deadline))
        except Refused as e:
            raise PeerRefusal(BUSY if e.busy else NOT_HERE, str(e)) from None


class _Unary:
    """One unary request's attempts: the local copy, here (loading first), or a peer."""

    __slots__ = ("deadline", "forward", "metadata", "model_id", "request", "router", "spec")

    def __init__(
        self,
        router: Router,
        spec: MethodSpec,
        request: bytes,
        model_id: str,
        forward: Metadata,
        deadline: float | None,
    ) -> None:
        self.router = router
        self.spec = spec
        self.request = request
        self.model_id = model_id
        self.forward = forward
        self.metadata = runtime_metadata(forward, model_id)
        self.deadline = deadline  # time.monotonic() seconds (None: none), taken on arrival

    def retarget(self, model_id: str) -> _Unary:
        return _Unary(self.router, self.spec, self.request, model_id, self.forward, self.deadline)

    async def local(self, entry: CacheEntry) -> bytes:
        return await self.router._serve_entry(
            entry, self.spec, self.request, self.model_id, self.metadata, _left(self.deadline)
        )

    async def here(self, record: ModelRecord) -> bytes:
        return await self.local(await self.router.ensure_here(self.model_id, record, self.deadline))

    async def peer(self, target: str, mode: str, price_limit: float | None = None) -> bytes:
        forward = self.router.forwarder.unary
        left = _left(self.deadline)
        return await forward(target, self.spec, self.request, self.model_id, self.metadata, left, mode, price_limit)


class _Stream:
    """One stream's attempts at opening: the local copy, here (loading first), or a peer."""

    __slots__ = ("deadline", "first", "forward", "metadata", "model_id", "requests", "router", "spec")

    def __init__(
        self,
        router: Router,
        spec: MethodSpec,
        first: bytes | None,
        requests: AsyncIterator[bytes],
        model_id: str,
        forward: Metadata,
        deadline: float | None,
    ) -> None:
        self.router = router
        self.spec = spec
        self.first = first
        self.requests = requests
        self.model_id = model_id
        self.forward = forward
        self.metadata = runtime_metadata(forward, model_id)
        self.deadline = deadline  # time.monotonic() seconds (None: none), taken on arrival

    def retarget(self, model_id: str) -> _Stream:
        return _Stream(self.router, self.spec, self.first, self.requests, model_id, self.forward, self.deadline)

    async def local(self, entry: CacheEntry) -> ResponseStream:
        return await self.router.open_entry_stream(
            entry, self.spec, self.first, self.requests, self.model_id, self.metadata, _left(self.deadline)
        )

    async def here(self, record: ModelRecord) -> ResponseStream:
        return await self.local(await self.router.ensure_here(self.model_id, record, self.deadline))

    async def peer(self, target: str, mode: str, price_limit: float | None = None) -> ResponseStream:
        r = self.router
        left = _left(self.deadline)
        return await r.forwarder.stream(
            target, self.spec, self.first, self.requests, self.model_id, self.metadata, left, mode, price_limit
        )


def _deadline_after(remaining_s: float | None) -> float | None:
    """The time.monotonic() at which a call with `remaining_s` left gives up (None: never)."""
    return None if remaining_s is None else time.monotonic() + remaining_s


def _left(deadline: float | None) -> float | None:
    """Seconds until `deadline` (time.monotonic()), for the next hop's timeout; None: none."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _exhausted_reason(refusal: str) -> str:
    """A load-capacity refusal's own text, without a peer's `busy: ` wrapping."""
    return refusal[refusal.index(EXHAUSTED_PREFIX) :]


class Closable(Protocol):
    def close(self) -> None: ...


class Sink(Protocol):
    """Where a spliced answer goes (Answered.splice): one write per read of its source."""

    def write(self, segments: list[bytes]) -> bool:
        """Send these bytes on; False: the receiver is gone."""

    def backlog(self) -> int:
        """Bytes written but not yet sent (the source pauses above a bound)."""


class Answered:
    """An opened stream whose first answer has come; `close()` exactly once when done.

    `splice`: a direct answer (Router.open_direct) hands the rest of its body's bytes to a
    sink as they come, instead of `rest` yielding response messages."""

    def __init__(
        self,
        first: bytes | None,
        rest: AsyncIterator[bytes],
        stream: Closable,
        splice: Callable[[Sink], Awaitable[None]] | None = None,
    ) -> None:
        self.first = first  # None: the stream ended without an answer
        self.rest = rest
        self.splice = splice
        self._stream = stream
        self._after: Callable[[], None] | None = None

    def on_close(self, after: Callable[[], None]) -> None:
        self._after = after

    def close(self) -> None:
        self._stream.close()
        after, self._after = self._after, None
        if after is not None:
            after()


# How a caller streams a local copy's answer itself: (the copy, its model id, a question to
# the runtime: one request message, its first answer or None) -> the answer, or None to
# have the runtime relay it.
DirectOpen = Callable[[CacheEntry, str, Callable[[bytes], Awaitable[bytes | None]]], Awaitable[Answered | None]]


async def _no_more() -> AsyncIterator[bytes]:
    return
    yield b""  # an async generator with nothing to send after the first message


class _Answered:
    """A stream's attempts until its first answer (`Router.open_answered`)."""

    __slots__ = ("direct", "model_id", "prefix", "stream")

    def __init__(self, stream: _Stream, direct: DirectOpen | None = None, prefix: str | None = None) -> None:
        self.stream = stream
        self.direct = direct
        self.model_id = stream.model_id
        self.prefix = prefix  # a language model's long prompt prefix (its hash)

    def retarget(self, model_id: str) -> _Answered:
        return _Answered(self.stream.retarget(model_id), self.direct, self.prefix)

    async def local(self, entry: CacheEntry) -> Answered:
        st = self.stream
        assert st.first is not None
        if self.direct is not None:
            answered = await st.router.open_direct(
                entry, st.spec, st.model_id, st.metadata, self.direct, _left(st.deadline)
            )
            if answered is not None:
                return answered
        opened = await st.router.open_entry_answer(
            entry, st.spec, st.first, st.model_id, st.metadata, _left(st.deadline)
        )
        try:
            answered = await _first_answer(opened)
            if st.spec.path == CALL_METHOD:  # whatever the routing: copy scaling reads the queue
                await st.router.note_runtime_load(self.model_id, opened)
            return answered
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details() or ""
            router = self.stream.router
            if means_model_missing(code, details) and await router.local.runtime.has_model(self.model_id) is False:
                router.local.lost(self.model_id, entry)
                raise Refused(f"the runtime no longer has {self.model_id!r}", exclude=False) from None
            await router.runtime_refused(code, _left(st.deadline))
            raise runtime_failure(code, details) from None

    async def here(self, record: ModelRecord) -> Answered:
        router = self.stream.router
        return await self.local(await router.ensure_here(self.model_id, record, self.stream.deadline))

    async def peer(self, target: str, mode: str, price_limit: float | None = None) -> Answered:
        opened = await self.stream.peer(target, mode, price_limit)
        try:
            return await _first_answer(opened)
        except grpc.aio.AioRpcError as e:
            # The peer accepted the stream, so it is reachable: its runtime's refusal reroutes.
            code, details = e.code(), e.details() or ""
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) or means_model_missing(code, details):
                raise Refused(f"{details or code.name}") from None
            raise peer_failure(code, details, e.trailing_metadata(), self.model_id) from None


async def _first_answer(opened: ResponseStream) -> Answered:
    """Wait for the stream's first answer; the stream is closed if none comes."""
    rest = aiter(opened)
    try:
        first: bytes | None = await anext(rest)
    except StopAsyncIteration:
        first = None
    except BaseException:
        opened.close()
        raise
    return Answered(first, rest, opened)
