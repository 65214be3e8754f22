"""What the operator listings report: models with their copies, sizes and last use, and
instances as their records say (`meshd.admin.MeshAdmin`, `meshd models|instances`).

Model records name a copy from the moment its load starts and never carry a size, so the
holders are asked for their own cache entries (peer `InstanceStats` with copies, a short
timeout each, all at once). The summaries are decided by pure functions over the records
and those answers; `Inventory` only gathers them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import grpc

from meshd._proto.meshd import peer_pb2, peer_pb2_grpc
from meshd.core.clock import Clock, wall_ms
from meshd.core.records import InstanceRecord, ModelRecord, never_used
from meshd.decisions.cache import UNIT_BYTES, State, WeightedLRU
from meshd.decisions.status import ModelStatus, failure_expired
from meshd.registry.models import Registry
from meshd.serving.cluster import Cluster
from meshd.serving.local import LocalModels
from meshd.serving.peers import Peers

log = logging.getLogger(__name__)

HOLDER_TIMEOUT_S = 2.0  # an unreachable holder costs a listing this much, once

# Mesh-wide status: the best state any copy is in (UNKNOWN above a failure: an unreachable
# holder may well be serving).
_RANK = (ModelStatus.LOADED, ModelStatus.LOADING, ModelStatus.UNKNOWN, ModelStatus.LOADING_FAILED)
_STATES = {State.LOADING: ModelStatus.LOADING, State.LOADED: ModelStatus.LOADED}


@dataclass(frozen=True, slots=True)
class HeldCopy:
    """One cache entry as its holder reports it."""

    state: State
    size_bytes: int
    last_used_ms: int
    since_ms: int


# instance id -> its cache entries by model id; None: the instance did not answer.
Reports = Mapping[str, Mapping[str, HeldCopy] | None]


@dataclass(frozen=True, slots=True)
class CopySummary:
    instance_id: str
    state: ModelStatus
    since_ms: int
    size_bytes: int | None = None
    last_used_ms: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class ModelSummary:
    model_id: str
    type: str
    path: str
    status: ModelStatus
    copies: tuple[CopySummary, ...]
    size_bytes: int | None
    last_used_ms: int  # 0: never used since its registration (REGISTERED_LU)
    refs: int
    auto_delete: bool
    errors: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class InstanceSummary:
    instance_id: str
    record: InstanceRecord
    leader: bool

    @property
    def capacity_bytes(self) -> int:
        return self.record.capacity * UNIT_BYTES

    @property
    def used_bytes(self) -> int:
        return self.record.used * UNIT_BYTES


def held_copies(cache: WeightedLRU, model_ids: Collection[str] = ()) -> dict[str, HeldCopy]:
    """This instance's cache entries (only `model_ids` when given)."""
    wanted = set(model_ids)
    return {
        e.model_id: HeldCopy(e.state, e.units * UNIT_BYTES, e.last_used_ms, e.since_ms)
        for e in cache.entries()
        if not wanted or e.model_id in wanted
    }


def model_summary(
    model_id: str,
    record: ModelRecord,
    reports: Reports,
    live: AbstractSet[str],
    now_ms: int,
    failure_expiry_ms: int,
) -> ModelSummary:
    """The model as the records and its holders describe it.

    A holder that answered is believed about its own cache (a record entry it does not
    confirm is stale and left out; a load it has begun counts even before the record names
    it). A live holder that did not answer: state UNKNOWN, size unknown. Copies of instances
    without a record (gone) are left out, like getModelStatus does. Unexpired failures count.
    """
    copies: dict[str, CopySummary] = {}
    for iid, start_ms in record.instance_ids.items():
        if iid in live and reports.get(iid) is None:
            copies[iid] = CopySummary(iid, ModelStatus.UNKNOWN, start_ms)
    for iid, held in reports.items():
        entry = held.get(model_id) if held is not None else None
        if entry is None or entry.state not in _STATES:
            continue  # failures come from the record, as getModelStatus reports them
        loaded = entry.state is State.LOADED
        copies[iid] = CopySummary(
            iid, _STATES[entry.state], entry.since_ms, entry.size_bytes if loaded else None, entry.last_used_ms
        )
    errors: list[str] = []
    for iid, failed_ms in record.failed_in.items():
        if failure_expired(failed_ms, now_ms, failure_expiry_ms) or iid in copies:
            continue
        msg = str(record.fails.get(iid, {}).get("msg", "load failed"))
        copies[iid] = CopySummary(iid, ModelStatus.LOADING_FAILED, failed_ms, error=msg)
        errors.append(f"{iid}: {msg}")
    ordered = sorted(copies.values(), key=lambda c: (-c.since_ms, c.instance_id))
    states = {c.state for c in ordered}
    status = next((s for s in _RANK if s in states), ModelStatus.NOT_LOADED)
    sizes = [c.size_bytes for c in ordered if c.size_bytes is not None]
    newest = max([record.last_used, *(c.last_used_ms for c in ordered)])
    return ModelSummary(
        model_id=model_id,
        type=record.type,
        path=record.path,
        status=status,
        copies=tuple(ordered),
        size_bytes=max(sizes) if sizes else None,
        last_used_ms=0 if never_used(record.extra, newest) else newest,
        refs=record.refs,
        auto_delete=record.auto_delete,
        errors=tuple(errors),
    )


def corrupt_summary(model_id: str, reason: str) -> ModelSummary:
    """A record that cannot be decoded is listed, not hidden, with the reason."""
    return ModelSummary(model_id, "", "", ModelStatus.UNKNOWN, (), None, 0, 0, False, (f"corrupt record: {reason}",))


def instance_summaries(records: Iterable[tuple[str, InstanceRecord]], leader_id: str | None) -> list[InstanceSummary]:
    return [InstanceSummary(iid, rec, iid == leader_id) for iid, rec in sorted(records, key=lambda x: x[0])]


class Inventory:
    """Gathers what the listings need: records from this instance's mirrors, cache entries
    from this instance directly and from every other live instance over the peer port."""

    def __init__(
        self,
        registry: Registry,
        cluster: Cluster,
        local: LocalModels,
        peers: Peers,
        failure_expiry_ms: int,
        clock: Clock = wall_ms,
    ) -> None:
        self.registry = registry
        self.cluster = cluster
        self.local = local
        self.peers = peers
        self.failure_expiry_ms = failure_expiry_ms
        self.clock = clock
        # Listings under way, by the models they ask about: concurrent callers share one
        # round of peer calls instead of each sending one to every instance.
        self._asking: dict[tuple[str, ...], asyncio.Future[dict[str, dict[str, HeldCopy] | None]]] = {}

    async def models(self, model_ids: Collection[str] = ()) -> tuple[list[ModelSummary], list[str]]:
        """Summaries sorted by id (only `model_ids` when given; each must be registered,
        else NOT_FOUND), and the live instances that did not answer."""
        records = {mid: self.registry.require(mid) for mid in model_ids}
        corrupt: dict[str, str] = {}
        if not model_ids:
            records = dict(self.registry.models.items())
            corrupt = dict(self.registry.models.corrupt)
        view = self.cluster.view()
        reports = await self._reports(view.instances, list(model_ids))
        now = self.clock()
        live = set(view.instances) | {self.local.instance_id}
        out = [model_summary(mid, rec, reports, live, now, self.failure_expiry_ms) for mid, rec in records.items()]
        out += [corrupt_summary(mid, why) for mid, why in corrupt.items() if mid not in records]
        out.sort(key=lambda s: s.model_id)
        return out, sorted(iid for iid, r in reports.items() if r is None)

    async def _reports(
        self, instances: Mapping[str, object], model_ids: list[str]
    ) -> dict[str, dict[str, HeldCopy] | None]:
        key = tuple(sorted(model_ids))
        asking = self._asking.get(key)
        if asking is None:
            asking = self._asking[key] = asyncio.ensure_future(self._ask_all(instances, model_ids))
            asking.add_done_callback(lambda _: self._asking.pop(key, None))
        return await asyncio.shield(asking)  # one caller going away does not cancel the others'

    async def _ask_all(
        self, instances: Mapping[str, object], model_ids: list[str]
    ) -> dict[str, dict[str, HeldCopy] | None]:
        me = self.local.instance_id
        others = [iid for iid in instances if iid != me]
        answers = await asyncio.gather(*(self._ask(iid, model_ids) for iid in others))
        reports: dict[str, dict[str, HeldCopy] | None] = dict(zip(others, answers, strict=True))
        reports[me] = held_copies(self.local.cache, model_ids)
        return reports

    async def _ask(self, instance_id: str, model_ids: list[str]) -> dict[str, HeldCopy] | None:
        inst = self.cluster.view().get(instance_id)
        if inst is None:
            return None
        stub = peer_pb2_grpc.MeshPeerStub(self.peers.get(instance_id, inst.location).channel)
        req = peer_pb2.InstanceStatsRequest(withCopies=True, modelIds=model_ids)
        try:
            resp = await stub.InstanceStats(req, timeout=HOLDER_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.info("instance %s did not report its copies: %s", instance_id, e.details())
            return None
        if not resp.copiesIncluded:  # an older meshd ignores withCopies: it has not answered
            return None
        return {
            c.modelId: HeldCopy(_PEER_STATES.get(c.state, State.FAILED), c.sizeBytes, c.lastUsed, c.since)
            for c in resp.copies
        }


_PEER_STATES = {
    peer_pb2.InternalOpResponse.LOADING: State.LOADING,
    peer_pb2.InternalOpResponse.LOADED: State.LOADED,
    peer_pb2.InternalOpResponse.FAILED: State.FAILED,
}
