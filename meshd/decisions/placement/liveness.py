"""Which instances a decision may trust to hold their copies, beyond what the instance
records say (pure: plain data and `now_ms`).

An instance record is the mesh's word that an instance is alive, but it lags the truth
both ways:

- A holder killed or frozen keeps its record until its lease runs out (the instance TTL,
  20 s by default). When this instance's data path has just found it unreachable (a
  refused connection, a failed keepalive), the holder is **unreachable** here for a while
  (`Expiring`): its copies are not tried. That alone does not tell a dead holder from one
  cut off from this instance only (a partition), so etcd is asked: an instance renews its
  lease every few seconds (`kv.lease`), and etcd tells how long ago it last did
  (`lease_verdict`). A holder whose lease is gone or has not been renewed for longer than
  its renewals allow has **lapsed**: its copies no longer count toward a model's max
  copies, so a capped model is loaded elsewhere at once instead of being unavailable
  until the lease expires. A holder that renewed its lease after it was found
  unreachable is alive beyond a partition: its copies still count, so a capped model is
  unavailable from this side of the partition rather than loaded beyond its max.
- When etcd stalls past the lease TTL every record expires at once and they come back
  one by one. An instance whose record went moments ago without the shutdown flag
  (`departed`), and that the data path has not found unreachable, is most likely still
  running: its copies still count toward max copies and still serve when no live copy
  does, and its forwarded calls are still accepted. Otherwise every instance would load
  every capped model for itself in that window.
- An instance cut off from etcd but not from its peers loses its record when its lease
  runs out, yet keeps serving and forwarding. Its forwarded calls are accepted for as long
  as upstream keeps a gone instance in the model records (10 min, `PEER_GONE_GRACE_MS`):
  accepting a call costs nothing, refusing it fails a request (found by tests/netfaults).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from meshd.decisions.placement.view import ClusterView, InstanceView

# How long the data path's evidence that a peer is unreachable is trusted over its
# record. A refused connection is re-learnt in milliseconds once it expires; a frozen
# peer costs one keepalive timeout (3-6 s) per period.
UNREACHABLE_MS = 10_000
# The least time a record that went (without the shutdown flag) is still trusted: records
# expired by an etcd stall return as their instances re-register, within a few seconds.
DEPARTED_MIN_MS = 10_000
# How long a peer whose record went (for any reason but a clean shutdown) still has its
# forwarded calls accepted: upstream's 10 min "instance gone" window.
PEER_GONE_GRACE_MS = 600_000


def departed_for_ms(instance_ttl_ms: int) -> int:
    """How long an instance whose record went is still counted (one lease TTL, at least
    `DEPARTED_MIN_MS`)."""
    return max(instance_ttl_ms, DEPARTED_MIN_MS)


class Expiring:
    """Instance ids, each remembered until a time (ms)."""

    def __init__(self) -> None:
        self._until: dict[str, int] = {}

    def note(self, instance_id: str, now_ms: int, for_ms: int) -> None:
        self._until[instance_id] = max(self._until.get(instance_id, 0), now_ms + for_ms)

    def forget(self, instance_id: str) -> None:
        self._until.pop(instance_id, None)

    def current(self, now_ms: int) -> frozenset[str]:
        """The ids still remembered at `now_ms` (the expired ones are dropped)."""
        if not self._until:
            return frozenset()
        gone = [iid for iid, until in self._until.items() if until <= now_ms]
        for iid in gone:
            del self._until[iid]
        return frozenset(self._until)


def recently_departed(
    departures: Mapping[str, tuple[int, InstanceView]], live: Mapping[str, InstanceView], now_ms: int, for_ms: int
) -> dict[str, InstanceView]:
    """Instances whose record went less than `for_ms` ago without the shutdown flag and is
    not back: `departures` maps an id to (when its record went, its last view)."""
    return {
        iid: inst
        for iid, (when, inst) in departures.items()
        if iid not in live and now_ms - when < for_ms and not inst.shutdown
    }


def counted_for_max_copies(view: ClusterView) -> frozenset[str]:
    """The instances whose copies count toward a model's max copies: live (shutting down
    too: a draining instance's runtime still holds its copies until it hands them over), or
    departed moments ago; in either case not lapsed (found unreachable here, and etcd
    confirms it stopped renewing its lease)."""
    return frozenset((set(view.instances) | set(view.departed)) - view.lapsed)


class LeaseVerdict(enum.Enum):
    LAPSED = "lapsed"  # gone, or not renewed for longer than its renewals allow
    ALIVE = "alive"  # renewed since it was found unreachable: cut off from here only
    UNKNOWN = "unknown"  # renewed lately, but maybe not since: ask again shortly


# etcd reports a lease's remaining TTL in whole seconds, rounded down, so the time since its
# last renewal read from it is up to 1 s too long; the rest is a renewal's own latency.
RENEWAL_SLACK_S = 1.5


def lease_verdict(
    remaining_s: int | None, granted_s: int, renew_every_s: float, noticed_ms: int, now_ms: int
) -> LeaseVerdict:
    """What etcd's word on an unreachable instance's lease means: `remaining_s` (None: the
    lease or the record is gone) of `granted_s`, renewed every `renew_every_s` by a live
    owner; `noticed_ms`: when this instance found it unreachable."""
    if remaining_s is None or remaining_s <= 0:
        return LeaseVerdict.LAPSED
    since_renewal_s = max(0, granted_s - remaining_s)  # an upper bound (rounding)
    if since_renewal_s > renew_every_s + RENEWAL_SLACK_S:
        return LeaseVerdict.LAPSED
    if since_renewal_s * 1000 < now_ms - noticed_ms:
        return LeaseVerdict.ALIVE
    return LeaseVerdict.UNKNOWN


def trusted_peer(view: ClusterView, instance_id: str, gone_since_ms: int | None = None) -> bool:
    """A call marked as forwarded by `instance_id` comes from the mesh: it is live here,
    departed moments ago (its record expired with everyone's in an etcd stall), or its
    record went less than `PEER_GONE_GRACE_MS` ago (`gone_since_ms`: when; None if it never
    went while this instance watched)."""
    if instance_id == view.self_id:
        return False
    if view.live(instance_id) or instance_id in view.departed:
        return True
    return gone_since_ms is not None and view.now_ms - gone_since_ms < PEER_GONE_GRACE_MS
