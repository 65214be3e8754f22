"""The cluster as this instance sees it: a `ClusterView` snapshot from the instances mirror.

The per-instance views are rebuilt only when the mirror's revision changes; each call
gets a fresh `now`. Peer channels of instances whose records disappear are closed.
"""

from __future__ import annotations

from collections.abc import Mapping

from meshd.clock import Clock, wall_ms
from meshd.kv.records import InstanceRecord
from meshd.kv.table import Table
from meshd.peers import Peers
from meshd.placement.view import ClusterView, InstanceView

# A peer whose instance record went (lease lost: it may be merely cut off from etcd, still
# serving and forwarding) keeps its forwarded calls accepted this long; upstream keeps a gone
# instance in the model records as long (its 10 min "instance gone" window).
PEER_GONE_GRACE_MS = 600_000


def accepts_calls_from(live: bool, gone_since_ms: int | None, now_ms: int, grace_ms: int = PEER_GONE_GRACE_MS) -> bool:
    """Whether the internal port takes forwarded calls from an instance: live, or live until
    less than `grace_ms` ago (seen by this instance; one never seen is refused)."""
    return live or (gone_since_ms is not None and now_ms - gone_since_ms < grace_ms)


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
        self._gone_ms: dict[str, int] = {}  # instance id -> when its record went
        instances.listeners.append(self._on_change)

    def _on_change(self, instance_id: str, old: InstanceRecord | None, new: InstanceRecord | None) -> None:
        if new is None:
            self.peers.forget(instance_id)
            if old is not None:
                self._gone_ms[instance_id] = self.clock()
        else:
            self._gone_ms.pop(instance_id, None)

    def accepts_calls_from(self, instance_id: str) -> bool:
        """A peer live now, or until recently (see `accepts_calls_from`)."""
        now = self.clock()
        for iid, since in list(self._gone_ms.items()):  # forget the long gone
            if now - since >= PEER_GONE_GRACE_MS:
                del self._gone_ms[iid]
        return accepts_calls_from(self.view().live(instance_id), self._gone_ms.get(instance_id), now)

    def view(self) -> ClusterView:
        if self._revision != self.instances.revision:
            self._views = {iid: InstanceView.from_record(iid, rec) for iid, rec in self.instances.items()}
            self._revision = self.instances.revision
        return ClusterView(self.self_id, self.clock(), self._views)
