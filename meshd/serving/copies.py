"""How many loaded copies a model has across the mesh, asked of the holders themselves.

Model records list a copy from the moment its load starts, so a record alone cannot say
"loaded". Where that matters (a vmodel may switch only once its target is really loaded)
the holders are asked over the peer port; the answers are kept until the next refresh.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import grpc

from meshd._proto.meshd import peer_pb2, peer_pb2_grpc
from meshd.decisions.cache import State
from meshd.decisions.status import CopyState
from meshd.registry.models import Registry
from meshd.serving.cluster import Cluster
from meshd.serving.local import LocalModels
from meshd.serving.peers import Peers

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0
_COPY_STATES: dict[int | None, CopyState] = {
    peer_pb2.InternalOpResponse.LOADING: CopyState.LOADING,
    peer_pb2.InternalOpResponse.LOADED: CopyState.LOADED,
    peer_pb2.InternalOpResponse.FAILED: CopyState.FAILED,
    peer_pb2.InternalOpResponse.NOT_HERE: CopyState.GONE,
}


class CopyCounter:
    def __init__(self, registry: Registry, cluster: Cluster, local: LocalModels, peers: Peers) -> None:
        self.registry = registry
        self.cluster = cluster
        self.local = local
        self.peers = peers
        self.counts: dict[str, int] = {}

    def __call__(self, model_id: str) -> int:
        return self.counts.get(model_id, 0)

    async def refresh(self, model_ids: Iterable[str]) -> None:
        ids = list(dict.fromkeys(model_ids))
        results = await asyncio.gather(*(self._count(mid) for mid in ids))
        self.counts.update(zip(ids, results, strict=True))  # merge: concurrent refreshes share it

    async def _count(self, model_id: str) -> int:
        record = self.registry.get(model_id)
        if record is None:
            return 0
        view = self.cluster.view()
        probes = []
        count = 0
        for iid in record.instance_ids:
            if iid == self.local.instance_id:
                entry = self.local.cache.get(model_id)
                count += entry is not None and entry.state is State.LOADED
            elif (inst := view.get(iid)) is not None:
                probes.append(self._probe(iid, inst.location, model_id))
        return count + sum(await asyncio.gather(*probes))

    async def _probe(self, iid: str, location: str, model_id: str) -> int:
        return int(await self._state(iid, location, model_id) == peer_pb2.InternalOpResponse.LOADED)

    async def _state(self, iid: str, location: str, model_id: str) -> int | None:
        """The holder's answer (`InternalOpResponse.State`), None when it did not answer."""
        stub = peer_pb2_grpc.MeshPeerStub(self.peers.get(iid, location).channel)
        try:
            resp = await stub.InternalOperation(peer_pb2.InternalOpRequest(modelId=model_id), timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.debug("copy probe of %s on %s failed: %s", model_id, iid, e.details())
            return None
        return int(resp.state)

    async def peer_states(self, model_id: str) -> dict[str, CopyState]:
        """What each live peer holding the model says of its copy (getModelStatus asks the
        holders, as upstream does: a record lists a copy from the moment its load starts)."""
        record = self.registry.get(model_id)
        if record is None:
            return {}
        view = self.cluster.view()
        peers = [
            (iid, inst.location)
            for iid in record.instance_ids
            if iid != self.local.instance_id and (inst := view.get(iid)) is not None
        ]
        answers = await asyncio.gather(*(self._state(iid, loc, model_id) for iid, loc in peers))
        return {iid: _COPY_STATES.get(a, CopyState.UNKNOWN) for (iid, _), a in zip(peers, answers, strict=True)}
