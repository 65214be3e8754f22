"""Routes one inference call to a copy of its model and forwards the raw bytes.

External calls (`unary`): a loaded local copy serves at once (each peer hop costs as much
as the first). Otherwise a live copy elsewhere serves, chosen by placement; with no copy
anywhere, placement picks where to load, here or on a peer asked to load and serve.
Failures reroute with the failing instance excluded, up to 8 attempts (upstream's
iteration count): a peer that is gone, a copy that is not there, a load that failed.
Exhausted attempts answer UNAVAILABLE naming the model and what was tried, never INTERNAL.

Forwarded calls (`serve_forwarded`) arrive on the internal port from a peer that chose
this instance: serve the local copy, or load it first when asked to.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc

from meshd._proto.meshd import peer_pb2, peer_pb2_grpc
from meshd.cache import CacheEntry, State
from meshd.cluster import Cluster
from meshd.errors import DataLoss, InvalidArgument, LoadFailed, MeshError, NotFound, RuntimeStatusError, Unavailable
from meshd.kv.records import ModelRecord, RecordError, VModelRecord
from meshd.local import LocalModels, NoRoom
from meshd.peers import Peers
from meshd.placement.constraints import TypeConstraints
from meshd.placement.rank import LoadRequest, choose_load_target, may_load_as_last_resort
from meshd.placement.serving import choose_copy
from meshd.placement.view import ClusterView
from meshd.proxy.headers import Metadata, RequestIds, runtime_metadata
from meshd.registry import Registry
from meshd.status import failure_expired

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 8  # upstream's routing iterations per request (SPEC §6)
MAX_RECENT_FAILURES = 3  # upstream gives up loading after 3 recent failures (SPEC §6)
MAX_CACHED_METHODS = 1024  # bounds memory when any method is allowed
RECENT_PLACEMENT_MS = 5_000  # longer than instance records take to show a load (>= 2 s)
PLACE_TIMEOUT_S = 10.0

# Internal metadata, only ever read on the internal port (the external one strips meshd-*).
HOP = "meshd-hop"  # instance id of the forwarding peer
MODE = "meshd-mode"  # "serve": only a loaded copy here; "load": load here first if needed
REASON = "meshd-reason"  # trailing metadata on a refusal: why, so the sender reroutes
NOT_HERE = "not-here"  # no loaded copy there (or it could not take the load): reroute
LOAD_FAILED = "load-failed"  # the load failed there (recorded): reroute
UNKNOWN_MODEL = "unknown-model"  # the model is not registered (any more)
PASSED_ON = "status"  # the runtime's (or meshd's) own answer: goes to the client as is

UnaryCall = Callable[..., Any]


class Refused(Exception):
    """An instance could not serve (gone, no copy, load failed): reroute.

    `exclude`: do not try that instance again for this request (False when retrying
    there may work, e.g. its runtime lost a copy and it can reload it).
    """

    def __init__(self, message: str, exclude: bool = True) -> None:
        super().__init__(message)
        self.exclude = exclude


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
    ) -> None:
        self.constraints = constraints or TypeConstraints()
        self.labels = labels
        self.local = local
        self.registry = registry
        self.channel = serving_channel
        self.cluster = cluster
        self.peers = peers
        self.failure_expiry_ms = failure_expiry_ms
        self.rng = rng or random.Random()
        self.self_id = local.instance_id
        self._unary: dict[str, UnaryCall] = {}
        self.inflight: dict[str, int] = {}  # requests this instance has in flight per peer
        self._placed: deque[tuple[int, str]] = deque()  # (ms, instance) of loads placed lately
        self.forwarded = 0  # external requests served by a peer (share of peer hops)

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
        failed = frozenset(i for i, ms in record.failed_in.items() if not failure_expired(ms, view.now_ms, expiry))
        target = self._load_target(view, model_id, record, exclude | holders | failed, prefer_self=False)
        if target is None:
            return None
        used = min(last_used_ms or record.last_used or view.now_ms, view.now_ms)
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

    async def record(self, model_id: str) -> ModelRecord:
        """The model's record; a strong read when the mirror has not seen it yet."""
        rec = self.registry.get(model_id)
        if rec is not None:
            return rec
        return await self.registry.fetch(model_id)

    def _runtime_call(self, method: str) -> UnaryCall:
        call = self._unary.get(method)
        if call is None:
            # Raw bytes both ways: no (de)serializer, the request is never parsed.
            call = self.channel.unary_unary(method, request_serializer=None, response_deserializer=None)
            if len(self._unary) < MAX_CACHED_METHODS:  # method names may be client-chosen
                self._unary[method] = call
        return call

    # ---- external calls ----------------------------------------------------------------
    async def unary(
        self, method: str, request: bytes, ids: RequestIds, forward: Metadata, remaining_s: float | None
    ) -> bytes:
        """Serve one external unary call; `remaining_s` is the client's deadline (None: none)."""
        self.local.counters.requests += 1
        if ids.model_id is not None:
            return await self._serve_model(method, request, ids.model_id, forward, remaining_s, ids.balanced)
        assert ids.vmodel_id is not None
        model_id = await self.resolve_vmodel(ids.vmodel_id)
        try:
            return await self._serve_model(method, request, model_id, forward, remaining_s, ids.balanced)
        except NotFound:
            # The active model went away (an autoDelete switch) before this instance saw the
            # vmodel move: read the vmodel from etcd and try its new active model once.
            current = await self.resolve_vmodel(ids.vmodel_id, strong=True)
            if current == model_id:
                raise
            return await self._serve_model(method, request, current, forward, remaining_s, ids.balanced)

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

    async def _serve_model(
        self,
        method: str,
        request: bytes,
        model_id: str,
        forward: Metadata,
        remaining_s: float | None,
        balanced: bool,
    ) -> bytes:
        metadata = runtime_metadata(forward, model_id)
        entry = self.local.cache.get(model_id)
        excluded: set[str] = set()
        if entry is not None and entry.state is State.LOADED:  # the common case, kept short
            self.local.counters.hits += 1
            self.local.cache.touch(model_id, self.local.clock())
            try:
                return await self._serve_entry(entry, method, request, model_id, metadata, remaining_s)
            except Refused as e:
                if e.exclude:
                    excluded.add(self.self_id)  # e.g. its runtime is down: do not ask it again
        record = await self.record(model_id)
        return await self._route(method, request, model_id, record, metadata, remaining_s, balanced, excluded)

    async def _route(
        self,
        method: str,
        request: bytes,
        model_id: str,
        record: ModelRecord,
        metadata: Metadata,
        remaining_s: float | None,
        balanced: bool,
        excluded: set[str],
    ) -> bytes:
        tried: list[str] = []
        for _ in range(MAX_ATTEMPTS):
            record = self.registry.get(model_id) or record
            view = self.cluster.view()
            now = view.now_ms
            entry = self.local.cache.get(model_id)
            local_loaded = entry is not None and entry.state is State.LOADED and self.self_id not in excluded
            copies = {
                iid: start
                for iid, start in record.instance_ids.items()
                if iid not in excluded and (iid == self.self_id or view.live(iid))
            }
            target = choose_copy(
                view,
                copies,
                self.inflight,
                excluded,
                self.cluster.assume_loaded_ms,
                local_loaded,
                balanced,
            )
            mode = "serve"
            if target is None:
                expiry = self.failure_expiry_ms
                recent = [i for i, ms in record.failed_in.items() if not failure_expired(ms, now, expiry)]
                if len(recent) >= MAX_RECENT_FAILURES:
                    raise Unavailable(self._given_up(model_id, record, recent))
                target = self._load_target(view, model_id, record, frozenset(excluded | set(recent)), balanced)
                mode = "load"
                if target is None:
                    if self.self_id in excluded or not may_load_as_last_resort(
                        view, self.labels, self.constraints.for_type(record.type)[0]
                    ):
                        break
                    target = self.self_id  # nothing better known (alone, or records not yet seen)
            try:
                if target == self.self_id:
                    return await self._load_and_serve_local(method, request, model_id, record, metadata, remaining_s)
                self.forwarded += 1
                return await self._forward(target, method, request, model_id, metadata, remaining_s, mode)
            except Refused as e:
                log.info("rerouting %s away from %s: %s", model_id, target, e)
                tried.append(f"{target} ({mode}): {e}")
                if e.exclude:
                    excluded.add(target)
        raise Unavailable(
            f"model {model_id!r}: no instance could serve it after {len(tried)} attempts: "
            + ("; ".join(tried) or "no live instance")
        )

    def is_peer(self, instance_id: str) -> bool:
        """A live instance of this mesh (forwarded calls are accepted only from those)."""
        return instance_id != self.self_id and self.cluster.view().live(instance_id)

    def _load_target(
        self, view: ClusterView, model_id: str, record: ModelRecord, exclude: frozenset[str], prefer_self: bool
    ) -> str | None:
        """Where a copy should load (placement's pick), remembered for the next picks."""
        required, preferred = self.constraints.for_type(record.type)
        request = LoadRequest(
            model_id=model_id,
            model_type=record.type,
            size_units=self.local.initial_units(record),
            exclude=exclude,
            required_labels=required,
            preferred_labels=preferred,
            prefer_self=prefer_self,
            recent_placements=self._recent_placements(view.now_ms),
        )
        target = choose_load_target(view, request, self.rng)
        if target is not None:
            self._placed.append((view.now_ms, target))
        return target

    def _recent_placements(self, now_ms: int) -> dict[str, int]:
        while self._placed and now_ms - self._placed[0][0] > RECENT_PLACEMENT_MS:
            self._placed.popleft()
        counts: dict[str, int] = {}
        for _, iid in self._placed:
            counts[iid] = counts.get(iid, 0) + 1
        return counts

    def _given_up(self, model_id: str, record: ModelRecord, recent: list[str]) -> str:
        msgs = "; ".join(f"{i}: {record.fails.get(i, {}).get('msg', 'load failed')}" for i in recent)
        return f"model {model_id!r} failed to load on {len(recent)} instances recently ({msgs})"

    # ---- serving here ----------------------------------------------------------------
    async def _load_and_serve_local(
        self,
        method: str,
        request: bytes,
        model_id: str,
        record: ModelRecord,
        metadata: Metadata,
        remaining_s: float | None,
    ) -> bytes:
        try:
            entry = await self.local.ensure(model_id, record)
        except (LoadFailed, NoRoom) as e:
            raise Refused(e.message) from None
        # Serve through this entry even if a concurrent load evicted it meanwhile: the
        # request counts as in flight, and the unload waits for in-flight requests.
        return await self._serve_entry(entry, method, request, model_id, metadata, remaining_s)

    async def _serve_entry(
        self,
        entry: CacheEntry,
        method: str,
        request: bytes,
        model_id: str,
        metadata: Metadata,
        remaining_s: float | None,
    ) -> bytes:
        """Forward to the runtime through a loaded local copy."""
        self.local.acquire(entry)
        self.local.counters.served += 1
        entry.served += 1
        try:
            response: bytes = await self._runtime_call(method)(request, metadata=metadata, timeout=remaining_s)
            return response
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == grpc.StatusCode.NOT_FOUND and await self.local.runtime.has_model(model_id) is False:
                # Confirmed lost (the runtime restarted): drop the copy and reroute; loading
                # here again is allowed. Any other NOT_FOUND (an unknown version, say) is the
                # runtime's own answer and goes to the client, the copy untouched.
                self.local.lost(model_id, entry)
                raise Refused(f"the runtime no longer has {model_id!r}", exclude=False) from None
            if code == grpc.StatusCode.UNAVAILABLE:
                # The runtime is down or overloaded: try another copy (SPEC: UNAVAILABLE ->
                # another copy); if none can serve, the client gets UNAVAILABLE with the reasons.
                raise Refused(f"the runtime is unavailable: {e.details()}") from None
            if code == grpc.StatusCode.INTERNAL and "deserializ" in (e.details() or "").lower():
                raise InvalidArgument(f"the runtime could not parse the request: {e.details()}") from None
            raise RuntimeStatusError(code, e.details() or code.name) from None
        finally:
            self.local.release(entry)

    # ---- peers -----------------------------------------------------------------------
    async def _forward(
        self,
        target: str,
        method: str,
        request: bytes,
        model_id: str,
        metadata: Metadata,
        remaining_s: float | None,
        mode: str,
    ) -> bytes:
        inst = self.cluster.view().get(target)
        if inst is None or not inst.location:
            raise Refused(f"{target} is not live")
        call = self.peers.get(target, inst.location).unary(method)
        md = (*metadata, (HOP, self.self_id), (MODE, mode))
        self.inflight[target] = self.inflight.get(target, 0) + 1
        try:
            response: bytes = await call(request, metadata=md, timeout=remaining_s)
            return response
        except grpc.aio.AioRpcError as e:
            reason = _reason(e)
            if reason in (NOT_HERE, LOAD_FAILED):
                raise Refused(f"{reason}: {e.details()}") from None
            if reason == UNKNOWN_MODEL:
                raise NotFound(e.details() or f"model {model_id!r} not found") from None
            if reason is None and e.code() == grpc.StatusCode.UNAVAILABLE:
                raise Refused(f"unreachable: {e.details()}") from None  # gRPC's own: the peer is gone
            raise RuntimeStatusError(e.code(), e.details() or e.code().name) from None
        finally:
            self.inflight[target] -= 1

    async def serve_forwarded(
        self, method: str, request: bytes, model_id: str, mode: str, metadata: Metadata, remaining_s: float | None
    ) -> bytes:
        """A peer's call: serve from the local copy (loading first in "load" mode).

        Refusals carry `meshd-reason` in the trailing metadata so the peer reroutes.
        """
        self.local.counters.requests += 1
        entry: CacheEntry | None
        if mode == "load":
            record = await self.record(model_id)
            try:
                entry = await self.local.ensure(model_id, record)  # served even if evicted since
            except LoadFailed as e:
                raise PeerRefusal(LOAD_FAILED, e.message) from None
            except NoRoom as e:
                raise PeerRefusal(NOT_HERE, e.message) from None
        else:
            entry = self.local.cache.get(model_id)
            pending = self.local.pending(model_id)
            if pending is not None:
                # The sender picked a copy still loading: wait for it here rather than have
                # the sender load yet another copy elsewhere.
                try:
                    entry = await asyncio.shield(pending)
                except LoadFailed as e:
                    raise PeerRefusal(LOAD_FAILED, e.message) from None
                except MeshError as e:
                    raise PeerRefusal(NOT_HERE, e.message) from None
            elif entry is None or entry.state is not State.LOADED:
                raise PeerRefusal(NOT_HERE, f"no loaded copy of {model_id!r} on {self.self_id}")
            else:
                self.local.counters.hits += 1
                self.local.cache.touch(model_id, self.local.clock())
        assert entry is not None
        try:
            return await self._serve_entry(entry, method, request, model_id, metadata, remaining_s)
        except Refused as e:
            raise PeerRefusal(NOT_HERE, str(e)) from None


class PeerRefusal(MeshError):
    """Answered to a peer: UNAVAILABLE with the reason in trailing metadata."""

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"meshd: {message}")
        self.reason = reason


def _reason(e: grpc.aio.AioRpcError) -> str | None:
    for key, value in e.trailing_metadata() or ():
        if key == REASON:
            return value if isinstance(value, str) else value.decode()
    return None
