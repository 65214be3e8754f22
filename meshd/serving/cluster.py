"""The cluster as this instance sees it: a `ClusterView` snapshot from the instances mirror.

The per-instance views are rebuilt only when the mirror's revision changes; each call
gets a fresh `now`. Peer channels of instances whose records disappear are closed.

Records written by upstream (Java) ModelMesh instances (`InstanceRecord.upstream`) are left
out of the view: their peer protocol is not meshd's, so nothing is forwarded or placed
there. Each is logged once (an error: the two cannot share a mesh) and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from meshd.core.clock import Clock, wall_ms
from meshd.core.records import InstanceRecord
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
    ) -> None:
        self.self_id = self_id
        self.instances = instances
        self.peers = peers
        self.assume_loaded_ms = assume_loaded_ms
        self.default_units = default_units
        self.clock = clock
        self._views: Mapping[str, InstanceView] = {}
        self._revision = -1
        self._upstream_logged: set[str] = set()
        instances.listeners.append(self._on_change)

    def _on_change(self, instance_id: str, old: InstanceRecord | None, new: InstanceRecord | None) -> None:
        if new is None:
            self.peers.forget(instance_id)
        else:
            self._note(instance_id, new)

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
        return ClusterView(self.self_id, self.clock(), self._views)
