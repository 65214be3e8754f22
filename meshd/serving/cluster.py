"""The cluster as this instance sees it: a `ClusterView` snapshot from the instances mirror.

The per-instance views are rebuilt only when the mirror's revision changes; each call
gets a fresh `now`. Peer channels of instances whose records disappear are closed. Beside
the records it keeps what the records lag behind (`decisions.placement.liveness`): the
instances whose record went moments ago (`departed`), those the data path has just
found unreachable (`note_unreachable`), and of those the ones etcd confirms stopped
renewing their lease (`lapsed`: one probe task per unreachable instance asks etcd until it
can tell; `settle` lets a request wait for that word).

Records written by upstream (Java) ModelMesh instances (`InstanceRecord.upstream`) are left
out of the view: their peer protocol is not meshd's, so nothing is forwarded or placed
there. Each is logged once (an error: the two cannot share a mesh) and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping

from meshd.core.clock import Clock, wall_ms
from meshd.core.records import InstanceRecord
from meshd.decisions.placement.liveness import (
    DEPARTED_MIN_MS,
    PEER_GONE_GRACE_MS,
    UNREACHABLE_MS,
    Expiring,
    LeaseVerdict,
    lease_verdict,
    recently_departed,
)
from meshd.decisions.placement.view import ClusterView, InstanceView
from meshd.kv.lease import renew_every_s
from meshd.kv.store import StoreError
from meshd.kv.table import Table
from meshd.serving.peers import Peers

log = logging.getLogger(__name__)

# How often etcd is asked about an unreachable instance's lease until it can tell: a live
# owner renews every 2 s at most (kv.lease), so a verdict comes within a few probes.
PROBE_EVERY_S = 0.5


class Cluster:
    def __init__(
        self,
        self_id: str,
        instances: Table[InstanceRecord],
        peers: Peers,
        assume_loaded_ms: Callable[[str], int],
        default_units: int,
        clock: Clock = wall_ms,
        departed_ms: int = DEPARTED_MIN_MS,
    ) -> None:
        self.self_id = self_id
        self.instances = instances
        self.peers = peers
        self.assume_loaded_ms = assume_loaded_ms  # model type -> horizon now (LoadQueue.assume_loaded)
        self.default_units = default_units
        self.clock = clock
        self.departed_ms = departed_ms
        self._views: Mapping[str, InstanceView] = {}
        self._revision = -1
        self._departures: dict[str, tuple[int, InstanceView]] = {}  # id -> (when its record went, last view)
        self._unreachable = Expiring()
        self._lapsed = Expiring()  # unreachable, and etcd says its lease is not renewed
        self._probes: dict[str, asyncio.Task[None]] = {}
        self._upstream_logged: set[str] = set()
        self._gone_ms: dict[str, int] = {}  # id -> when its record went (no shutdown flag)
        instances.listeners.append(self._on_change)

    def _on_change(self, instance_id: str, old: InstanceRecord | None, new: InstanceRecord | None) -> None:
        if new is None:
            self.peers.forget(instance_id)
            if old is not None and not old.upstream and instance_id != self.self_id:
                now = self.clock()
                self._departures[instance_id] = (now, InstanceView.from_record(instance_id, old))
                if not old.shutdown:  # cut off from etcd, maybe, and still forwarding to us
                    self._gone_ms[instance_id] = now
        else:
            self._departures.pop(instance_id, None)
            self._gone_ms.pop(instance_id, None)
            self._note(instance_id, new)

    def gone_since_ms(self, instance_id: str) -> int | None:
        """When `instance_id`'s record went without the shutdown flag (None: it did not, or
        longer ago than forwarded calls are accepted for)."""
        since = self._gone_ms.get(instance_id)
        if since is not None and self.clock() - since >= PEER_GONE_GRACE_MS:
            del self._gone_ms[instance_id]
            return None
        return since

    def note_unreachable(self, instance_id: str, for_ms: int = UNREACHABLE_MS) -> None:
        """The data path found `instance_id` unreachable (refused, keepalive failed): its
        copies are not tried for a while, and etcd is asked whether it is gone or only cut
        off from here (placement.liveness)."""
        if instance_id == self.self_id:
            return
        now = self.clock()
        self._unreachable.note(instance_id, now, for_ms)
        if instance_id not in self._probes:  # lapsed already: asked again, it says so at once
            task = asyncio.get_running_loop().create_task(
                self._probe(instance_id, now, for_ms), name=f"lease probe {instance_id}"
            )
            self._probes[instance_id] = task
            task.add_done_callback(self._probe_done)

    def note_reachable(self, instance_id: str) -> None:
        """A call to `instance_id` just succeeded: it is reachable again, whatever was noted."""
        self._unreachable.forget(instance_id)
        self._lapsed.forget(instance_id)

    def _probe_done(self, task: asyncio.Task[None]) -> None:
        for iid, t in list(self._probes.items()):
            if t is task:
                del self._probes[iid]
        if not task.cancelled() and task.exception() is not None:
            log.error("lease probe failed", exc_info=task.exception())

    async def _probe(self, instance_id: str, noticed_ms: int, for_ms: int) -> None:
        """Ask etcd about `instance_id`'s lease until it tells lapsed or alive, or until the
        evidence of it being unreachable runs out."""
        key = self.instances.key(instance_id)
        store = self.instances.store
        while self.clock() - noticed_ms < for_ms:
            try:
                kv = await store.get(key)
                ttl = await store.lease_ttl(kv.lease) if kv is not None and kv.lease else None
            except StoreError as e:
                # Without etcd's word its copies keep counting: better unavailable than over max.
                log.debug("lease probe of %s: %s", instance_id, e)
            else:
                verdict = lease_verdict(
                    None if ttl is None else ttl.remaining_s,
                    0 if ttl is None else ttl.granted_s,
                    renew_every_s(0 if ttl is None else ttl.granted_s),
                    noticed_ms,
                    self.clock(),
                )
                if verdict is LeaseVerdict.LAPSED:
                    log.info("%s is unreachable and stopped renewing its lease: its copies do not count", instance_id)
                    self._lapsed.note(instance_id, self.clock(), for_ms)
                    return
                if verdict is LeaseVerdict.ALIVE:
                    log.warning(
                        "%s is unreachable from here but renews its lease: cut off from this instance "
                        "only, its copies still count toward max copies",
                        instance_id,
                    )
                    return
            await asyncio.sleep(PROBE_EVERY_S)

    def probing(self, instance_ids: Iterable[str]) -> list[asyncio.Task[None]]:
        """The lease probes still asking about any of `instance_ids`."""
        return [t for iid in instance_ids if (t := self._probes.get(iid)) is not None]

    async def settle(self, instance_ids: Iterable[str], timeout_s: float) -> bool:
        """Wait up to `timeout_s` for etcd's word on those of `instance_ids` being probed;
        False if there was nothing to wait for."""
        probes = self.probing(instance_ids)
        if not probes:
            return False
        await asyncio.wait(probes, timeout=timeout_s)
        return True

    async def close(self) -> None:
        for task in list(self._probes.values()):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._probes.values(), return_exceptions=True)

    def _note(self, instance_id: str, rec: InstanceRecord) -> None:
        if rec.upstream and instance_id not in self._upstream_logged:
            self._upstream_logged.add(instance_id)
            log.error(
                "instance %s (%s) is an upstream (Java) ModelMesh instance in this mesh's registry: meshd "
                "never routes to it and never rewrites its record; upstream and meshd instances cannot "
                "share a mesh (replace every pod of the ServingRuntime at once)",
                instance_id,
                rec.location or "no location",
            )

    def upstream_ids(self) -> list[str]:
        """Live upstream (Java) instances in the registry, sorted."""
        return sorted(iid for iid, rec in self.instances.items() if rec.upstream)

    def view(self) -> ClusterView:
        if self._revision != self.instances.revision:
            views = {}
            for iid, rec in self.instances.items():
                self._note(iid, rec)  # records listed at start-up reach no listener
                if not rec.upstream:
                    views[iid] = InstanceView.from_record(iid, rec)
            self._views = views
            self._revision = self.instances.revision
        now = self.clock()
        unreachable = self._unreachable.current(now)
        lapsed = self._lapsed.current(now) & unreachable if unreachable else frozenset()
        if not self._departures:
            if not unreachable:
                return ClusterView(self.self_id, now, self._views)
            return ClusterView(self.self_id, now, self._views, unreachable=unreachable, lapsed=lapsed)
        departed = recently_departed(self._departures, self._views, now, self.departed_ms)
        if len(departed) < len(self._departures):
            self._departures = {iid: d for iid, d in self._departures.items() if iid in departed}
        return ClusterView(self.self_id, now, self._views, departed, unreachable, lapsed)
