"""Calls to peers: a request forwarded, as its original method and bytes, to the instance the
router chose, marked as a peer call (`meshd-hop`, `meshd-mode`) and counted in flight per peer
(placement prefers less busy copies). A refusal comes back as `Refused`, to reroute.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from meshd.decisions.placement.llm import LOAD_HEADER, Reading, parse_load
from meshd.observability.tracing import Tracing
from meshd.serving.cluster import Cluster
from meshd.serving.invocations import SERVED
from meshd.serving.peer_protocol import (
    ACCEPTED,
    HOP,
    MODE,
    PRICE_LIMIT,
    Refused,
    peer_failure,
    price_header,
    reported_loads,
)
from meshd.serving.peers import PeerChannel, Peers
from meshd.serving.proxy.headers import Metadata
from meshd.serving.proxy.methods import MethodSpec
from meshd.serving.proxy.streams import Relay, ResponseStream


class Forwarder:
    def __init__(
        self, self_id: str, cluster: Cluster, peers: Peers, tracing: Tracing | None, note_served: bool
    ) -> None:
        self.self_id = self_id
        self.cluster = cluster
        self.peers = peers
        self.tracing = tracing
        self.note_served = note_served  # see Router.note_served
        self.inflight: dict[str, int] = {}  # requests this instance has in flight per peer
        self.model_inflight: dict[tuple[str, str], int] = {}  # the same per (model, peer)
        # Each peer's loads in progress as its last unary answer said (`meshd-loads`), and when
        # (monotonic ms): placement reads them where they are fresher than the peer's record.
        self.peer_loads: dict[str, tuple[int, int]] = {}
        # Language models: each copy's engine load as its runtime or its instance last said
        # (`meshd-engine-load`), when (monotonic ms), and this instance's calls to the copy
        # then (placement.llm.load_now): model -> instance -> reading.
        self.engine_loads: dict[str, dict[str, Reading]] = {}
        # This instance's copies: readings of their engines' queue since the scaler last looked,
        # and the fewest requests waiting in any (model -> (readings, least waiting)).
        self.queue_depths: dict[str, tuple[int, int]] = {}

    def note_engine_load(self, model_id: str, instance_id: str, metadata: Any, own: int) -> None:
        """Remember a copy's engine load from a call's initial metadata, if it carries one;
        `own`: this instance's calls in flight to that copy now (the load counts them)."""
        for key, value in metadata or ():
            if key == LOAD_HEADER:
                load = parse_load(value)
                if load is not None:
                    now = int(time.monotonic() * 1000)
                    self.engine_loads.setdefault(model_id, {})[instance_id] = Reading(load, now, own)
                    if instance_id == self.self_id and load.waiting >= 0:
                        readings, least = self.queue_depths.get(model_id, (0, load.waiting))
                        self.queue_depths[model_id] = (readings + 1, min(least, load.waiting))
                return

    async def unary(
        self,
        target: str,
        spec: MethodSpec,
        request: bytes,
        model_id: str,
        metadata: Metadata,
        remaining_s: float | None,
        mode: str,
        price_limit: float | None = None,
    ) -> bytes:
        peer = self.channel(target)
        md = _peer_metadata(metadata, self.self_id, mode, price_limit)
        if self.note_served:
            SERVED.set((model_id, target))
        self._count(model_id, target, 1)
        raw = peer.unary(spec.path)
        try:
            # Kept to its end even if the peer leaves the mesh (it may still be running it);
            # a frozen peer's keepalive fails it with UNAVAILABLE, rerouted below.
            if self.tracing is None:
                made = peer.track(raw(request, metadata=md, timeout=remaining_s))
                response: bytes = await made
            else:
                made, response = await self._traced(peer, raw, spec, request, md, remaining_s, target, mode)
            self._note_loads(target, await made.trailing_metadata())
            return response
        except grpc.aio.AioRpcError as e:
            self._note_loads(target, e.trailing_metadata())
            raise peer_failure(e.code(), e.details(), e.trailing_metadata(), model_id) from None
        finally:
            self._count(model_id, target, -1)

    async def _traced(
        self,
        peer: PeerChannel,
        raw: Any,
        spec: MethodSpec,
        request: bytes,
        md: Metadata,
        remaining_s: float | None,
        target: str,
        mode: str,
    ) -> tuple[Any, bytes]:
        """The call in a CLIENT span: (the call, for its trailers; its answer)."""
        assert self.tracing is not None
        made: list[Any] = []

        def call(*args: Any, **kwargs: Any) -> Any:
            made.append(peer.track(raw(*args, **kwargs)))
            return made[-1]

        hop = {"meshd.hop": "peer", "meshd.peer": target, "meshd.mode": mode}
        response: bytes = await self.tracing.call_unary(call, spec.path, request, md, remaining_s, hop)
        return made[-1], response

    def _note_loads(self, target: str, trailers: Any) -> None:
        """Remember a peer's `meshd-loads` and when (placement: `loading.fresh_loads`)."""
        loads = reported_loads(trailers)
        if loads is not None:
            self.peer_loads[target] = (loads, int(time.monotonic() * 1000))

    async def stream(
        self,
        target: str,
        spec: MethodSpec,
        first: bytes | None,
        requests: AsyncIterator[bytes],
        model_id: str,
        metadata: Metadata,
        remaining_s: float | None,
        mode: str,
        price_limit: float | None = None,
    ) -> ResponseStream:
        """Open the stream on a peer. No request message leaves before the peer accepts
        (initial metadata `meshd-accepted`), so a refusal reroutes with nothing lost."""
        peer = self.channel(target)
        md = _peer_metadata(metadata, self.self_id, mode, price_limit)
        if self.note_served:
            SERVED.set((model_id, target))
        if self.tracing is not None:
            md = self.tracing.inject(md)
        relay = Relay(first, requests, None, hold=True)
        call = peer.track(peer.stream(spec.path)(relay, metadata=md, timeout=remaining_s))
        relay.call = call
        self._count(model_id, target, 1)
        try:
            initial = await call.initial_metadata()
            accepted = any(k == ACCEPTED for k, _ in initial or ())
            if accepted:
                self.note_engine_load(model_id, target, initial, self.model_inflight[model_id, target])
            else:  # the call ended without the peer taking it
                code = await call.code()
                raise peer_failure(code, await call.details(), await call.trailing_metadata(), model_id)
        except grpc.aio.AioRpcError as e:
            self._count(model_id, target, -1)
            relay.close()
            raise peer_failure(e.code(), e.details(), e.trailing_metadata(), model_id) from None
        except BaseException:
            self._count(model_id, target, -1)
            call.cancel()
            relay.close()
            raise
        relay.release()

        def closed() -> None:
            self._count(model_id, target, -1)

        return ResponseStream(call, relay, closed)

    def _count(self, model_id: str, target: str, change: int) -> None:
        """A call to a peer sent (1) or ended (-1)."""
        self.inflight[target] = self.inflight.get(target, 0) + change
        key = (model_id, target)
        left = self.model_inflight.get(key, 0) + change
        if left:
            self.model_inflight[key] = left
        else:
            self.model_inflight.pop(key, None)  # not kept for every model ever forwarded

    def channel(self, target: str) -> PeerChannel:
        view = self.cluster.view()
        inst = view.get(target) or view.departed.get(target)  # departed: placement.liveness
        if inst is None or not inst.location:
            raise Refused(f"{target} is not live")
        return self.peers.get(target, inst.location)


def _peer_metadata(metadata: Metadata, self_id: str, mode: str, price_limit: float | None) -> Metadata:
    """A forwarded call's metadata: the client's, then this instance's marks (`meshd-*`)."""
    md = (*metadata, (HOP, self_id), (MODE, mode))
    return md if price_limit is None else (*md, (PRICE_LIMIT, price_header(price_limit)))
