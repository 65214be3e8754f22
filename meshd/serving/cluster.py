"""The cluster as this instance sees it: a `ClusterView` snapshot from the instances mirror.

The per-instance views are rebuilt only when the mirror's revision changes; each call
gets a fresh `now`. Peer channels of instances whose records disappear are closed.
"""

from __future__ import annotations

from collections.abc import Mapping

from meshd.core.clock import Clock, wall_ms
from meshd.core.records import InstanceRecord
from meshd.decisions.placement.view import ClusterView, InstanceView
from meshd.kv.table import Table
from meshd.serving.peers import Peers


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
        instances.listeners.append(self._on_change)

    def _on_change(self, instance_id: str, old: InstanceRecord | None, new: InstanceRecord | None) -> None:
        if new is None:
            self.peers.forget(instance_id)

    def view(self) -> ClusterView:
        if self._revision != self.instances.revision:
            self._views = {iid: InstanceView.from_record(iid, rec) for iid, rec in self.instances.items()}
            self._revision = self.instances.revision
        return ClusterView(self.self_id, self.clock(), self._views)
