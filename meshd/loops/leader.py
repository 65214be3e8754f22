"""The leader's duties (one instance at a time, elected on etcd under `leader/`).

- prune instance ids that have been missing from `instances/` for 10 min (upstream) from
  model records, so dead copies stop appearing in records;
- complete vmodel transitions (each switch is a CAS, so a stale leader cannot corrupt them);
- preload recently used models with no copy when the cluster has room (upstream's reaper:
  most recent first, filling about half the free space above a 12.5 % reserve);
- compute the cluster gauges (models managed, loaded, with failures) it serves to operators.
`prune_plan`, `preload_plan` and `cluster_gauges` are pure.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

from meshd.core.records import ModelRecord
from meshd.decisions.placement.scaling import global_lru_ms
from meshd.decisions.placement.view import ClusterView
from meshd.decisions.status import recent_failures
from meshd.kv.election import Election
from meshd.kv.table import KEEP, Keep
from meshd.registry.models import Registry

log = logging.getLogger(__name__)

DEAD_INSTANCE_PRUNE_MS = 600_000  # upstream: dead instance pruned from model records after 10 min
LEADER_SWEEP_MS = 420_000  # upstream: leader sweep every 7 min
PRELOAD_RESERVE_RATIO = 0.125  # upstream keeps 12.5 % of the cluster free when preloading
PRELOAD_FILL_RATIO = 0.5  # ... and fills about half of the free space above it per sweep
PRELOAD_MAX_FAILURES = 2  # upstream preloads only models with fewer than 2 failures


@dataclass
class MissingInstances:
    """When each instance id named in records was first seen without an instance record."""

    since: dict[str, int] = field(default_factory=dict)

    def observe(self, named: Iterable[str], live: Iterable[str], now_ms: int) -> None:
        live_set = set(live)
        missing = set(named) - live_set
        for iid in missing:
            self.since.setdefault(iid, now_ms)
        for iid in list(self.since):
            if iid not in missing:
                del self.since[iid]


def prune_plan(missing: MissingInstances, now_ms: int, after_ms: int) -> set[str]:
    """Instance ids missing for at least `after_ms`: their copies leave the records."""
    return {iid for iid, since in missing.since.items() if now_ms - since >= after_ms}


def preload_plan(
    view: ClusterView,
    records: Mapping[str, ModelRecord],
    model_units: Callable[[ModelRecord], int],
    failure_expiry_ms: int,
) -> list[str]:
    """Models to load now: no live copy, used more recently than the cluster's LRU, few
    recent failures; most recent first, within half the free space above the reserve."""
    serving = [i for i in view.instances.values() if not i.shutdown]
    capacity = sum(i.capacity for i in serving)
    free = sum(max(0, i.free) for i in serving)
    budget = int((free - capacity * PRELOAD_RESERVE_RATIO) * PRELOAD_FILL_RATIO)
    if budget <= 0:
        return []
    lru = global_lru_ms(view)
    wanted: list[tuple[int, str, int]] = []
    for mid, rec in records.items():
        if any(view.live(i) for i in rec.instance_ids) or rec.last_used <= lru:
            continue
        if len(recent_failures(rec.failed_in, view.now_ms, failure_expiry_ms)) >= PRELOAD_MAX_FAILURES:
            continue
        wanted.append((rec.last_used, mid, model_units(rec)))
    plan: list[str] = []
    for _, mid, units in sorted(wanted, reverse=True):
        if units > budget:
            break
        plan.append(mid)
        budget -= units
    return plan


@dataclass(frozen=True, slots=True)
class ClusterGauges:
    """Upstream's leader-published gauges (SPEC §8 names in the comments)."""

    models_managed: int = 0  # modelmesh_models_managed_total: registered models
    models_loaded: int = 0  # modelmesh_models_loaded_total: with a copy on a live instance
    models_with_failure: int = 0  # modelmesh_models_with_failure_total: unexpired load failures


def cluster_gauges(view: ClusterView, records: Mapping[str, ModelRecord], failure_expiry_ms: int) -> ClusterGauges:
    loaded = failed = 0
    for rec in records.values():
        loaded += any(view.live(i) for i in rec.instance_ids)
        failed += bool(recent_failures(rec.failed_in, view.now_ms, failure_expiry_ms))
    return ClusterGauges(len(records), loaded, failed)


class LeaderDuties:
    def __init__(
        self,
        election: Election,
        registry: Registry,
        view: Callable[[], ClusterView],
        place: Callable[[str], Awaitable[object]],
        model_units: Callable[[ModelRecord], int],
        failure_expiry_ms: int,
        sweep_ms: int = LEADER_SWEEP_MS,
        prune_after_ms: int = DEAD_INSTANCE_PRUNE_MS,
        upstream_ids: Callable[[], Iterable[str]] = lambda: (),
    ) -> None:
        self.election = election
        # Live upstream (Java) instances: left out of the view, but alive, so their ids in
        # model records are never pruned (meshd does not rewrite what they own).
        self.upstream_ids = upstream_ids
        self.registry = registry
        self.view = view
        self.place = place
        self.model_units = model_units
        self.failure_expiry_ms = failure_expiry_ms
        self.sweep_ms = sweep_ms
        self.prune_after_ms = prune_after_ms
        self.missing = MissingInstances()
        self.gauges: ClusterGauges | None = None  # None unless this instance leads

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_ms / 1000)
            if not self.election.is_leader:
                self.missing = MissingInstances()  # a new leader starts its clocks afresh
                self.gauges = None
                continue
            try:
                await self.sweep()
            except Exception:
                log.exception("leader sweep failed")

    async def sweep(self) -> None:
        view = self.view()
        records = dict(self.registry.models.items())
        self.gauges = cluster_gauges(view, records, self.failure_expiry_ms)
        named = {iid for rec in records.values() for iid in rec.instance_ids}
        self.missing.observe(named, {*view.instances.keys(), *self.upstream_ids()}, view.now_ms)
        dead = prune_plan(self.missing, view.now_ms, self.prune_after_ms)
        for mid, rec in records.items():
            if dead & rec.instance_ids.keys():
                await self._prune(mid, dead)
        for mid in preload_plan(view, records, self.model_units, self.failure_expiry_ms):
            if not self.election.is_leader:
                return
            log.info("leader preloading %s", mid)
            await self.place(mid)

    async def _prune(self, model_id: str, dead: set[str]) -> None:
        def fn(rec: ModelRecord | None) -> ModelRecord | Keep:
            if rec is None or not dead & rec.instance_ids.keys():
                return KEEP
            for iid in dead:
                rec.instance_ids.pop(iid, None)
            return rec

        try:
            await self.registry.models.update(model_id, fn)
            log.info("pruned dead instances %s from %s", sorted(dead), model_id)
        except Exception as e:
            log.warning("could not prune %s: %s", model_id, e)
