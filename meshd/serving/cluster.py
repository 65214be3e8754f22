"""The cluster as this instance sees it: a `ClusterView` snapshot from the instances mirror.

The per-instance views are rebuilt only when the mirror's revision changes; each call
gets a fresh `now`. Peer channels of instances whose records disappear are closed. Beside
the records it keeps what the records lag behind (`decisions.placement.liveness`): the
instances whose record went moments ago (`departed`) and those the data path has just
found unreachable (`note_unreachable`).

Records written by upstream (Java) ModelMesh instances (`InstanceRecord.upstream`) are left
out of the view: their peer protocol is not meshd's, so nothing is forwarded or placed
there. Each is logged once (an error: the two cannot share a mesh) and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from meshd.core.clock import Clock, wall_ms
from meshd.core.records import InstanceRecord
from meshd.decisions.placement.liveness import (
    DEPARTED_MIN_MS,
    PEER_GONE_GRACE_MS,
    UNREACHABLE_MS,
    Expiring,
    recently_departed,
)
from meshd.decisions.placement.view import ClusterView, InstanceView
from meshd.kv.table import Table
from meshd.serving.peers import Peers

log = logging.getLogger(__name__)


class Cluster:
    def __init__(
        self,
        self_id: str,
        instances: Table[InstanceRecord],
        peers: Peers,
        assume_loaded_ms: int,
        default_units: int,
        clock: Clock = wall_ms,
        departed_ms: int = DEPARTED_MIN_MS,
    ) -> None:
        self.self_id = self_id
        self.instances = instances
        self.peers = peers
        self.assume_loaded_ms = assume_loaded_ms
        self.default_units = default_units
        self.clock = clock
        self.departed_ms = departed_ms
        self._views: Mapping[str, InstanceView] = {}
        self._revision = -1
        self._departures: dict[str, tuple[int, InstanceView]] = {}  # id -> (when its record went, last view)
        self._unreachable = Expiring()
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
        record is not trusted for a while (placement.liveness)."""
        if instance_id != self.self_id:
            self._unreachable.note(instance_id, self.clock(), for_ms)

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
        if not self._departures:
            unreachable = self._unreachable.current(now)
            if not unreachable:
                return ClusterView(self.self_id, now, self._views)
            return ClusterView(self.self_id, now, self._views, unreachable=unreachable)
        departed = recently_departed(self._departures, self._views, now, self.departed_ms)
        if len(departed) < len(self._departures):
            self._departures = {iid: d for iid, d in self._departures.items() if iid in departed}
        return ClusterView(self.self_id, now, self._views, departed, self._unreachable.current(now))
