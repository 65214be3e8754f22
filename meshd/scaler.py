"""Copy scaling, applied by each instance to the copies it holds (SPEC §6 cadence).

Every rate-check interval: a copy serving more than the per-copy threshold asks for more
copies; a model used regularly (again 7-40 min after an earlier spell) gets a second copy;
a model below its `min_copies` gets copies placed; an idle extra copy is dropped when the
cluster is nearly full and this instance is the worst holder; a model above its
`max_copies` loses the worst holder's copy. The rules are `meshd.placement.scaling`
(pure); this module samples rates, asks them and carries out the answers.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from meshd.cache import State
from meshd.cluster import Cluster
from meshd.local import LocalModels
from meshd.placement import scaling
from meshd.placement.modelkey import policy_from_key
from meshd.placement.scaling import ModelPolicy, QueueSample
from meshd.placement.view import ClusterView
from meshd.registry import Registry
from meshd.router import Router

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScalerConfig:
    interval_ms: int = scaling.RATE_CHECK_INTERVAL_MS
    threshold_rpm: int = scaling.DEFAULT_SCALE_UP_RPM_THRESHOLD
    idle_ms: int | None = None  # None: upstream's min(10 h, 10 % of the cache age)
    bandwidth_pct: int = 90  # MM_CONC_SCALEUP_BANDWIDTH_PCT (copies with concurrency limits)


class Scaler:
    def __init__(
        self, config: ScalerConfig, local: LocalModels, registry: Registry, cluster: Cluster, router: Router
    ) -> None:
        self.config = config
        self.local = local
        self.registry = registry
        self.cluster = cluster
        self.router = router
        self._served: dict[str, int] = {}  # model -> served count at the last check
        self._gates: dict[str, QueueSample] = {}  # model -> its gate's sums at the last check

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_ms / 1000)
            try:
                await self.check()
            except Exception:
                log.exception("copy scaling check failed")

    async def check(self) -> None:
        view = self.cluster.view()
        me = view.get(view.self_id)
        if me is None or me.shutdown:
            return
        served_now: dict[str, int] = {}
        gates_now: dict[str, QueueSample] = {}
        for entry in self.local.cache.entries():
            if entry.state is not State.LOADED:
                continue
            served_now[entry.model_id] = entry.served
            threshold = self.config.threshold_rpm
            saturated = False
            if entry.gate is not None:
                g = entry.gate
                sums = gates_now[entry.model_id] = QueueSample(
                    g.limit, g.completed, g.service_ms, g.queued_requests, g.queue_ms
                )
                sample = sums.since(self._gates.get(entry.model_id))
                threshold = scaling.load_threshold_rpm(threshold, sample, self.config.bandwidth_pct)
                saturated = scaling.saturated(sample)
            record = self.registry.get(entry.model_id)
            if record is None:
                continue
            try:
                policy = policy_from_key(record.key)
            except ValueError:
                policy = scaling.DEFAULT_POLICY
            holders = {i: t for i, t in record.instance_ids.items() if i == view.self_id or view.live(i)}
            rpm = (entry.served - self._served.get(entry.model_id, entry.served)) * 60_000 // self.config.interval_ms
            if saturated:  # queueing as long as serving: at capacity, whatever the estimate says
                rpm = max(rpm, threshold)
            try:  # one model's failure must neither stop the others nor skew the next rates
                await self._apply(
                    view, entry.model_id, policy, holders, rpm, threshold, entry.last_used_ms, entry.prior_use_ms
                )
            except Exception:
                log.exception("copy scaling of %s failed", entry.model_id)
        self._served = served_now
        self._gates = gates_now

    async def _apply(
        self,
        view: ClusterView,
        model_id: str,
        policy: ModelPolicy,
        holders: dict[str, int],
        rpm: int,
        threshold_rpm: int,
        last_used_ms: int,
        prior_use_ms: int | None,
    ) -> None:
        live = [i for i in view.instances.values() if not i.shutdown]
        candidates = sum(1 for i in live if i.instance_id not in holders)
        copies = len(holders)
        limit = policy.copy_limit(len(live))
        if copies > limit and self._worst_holder(view, holders):
            log.info("dropping a copy of %s: %d copies, max %d", model_id, copies, limit)
            self.local.shed(model_id)
            return
        add = scaling.extra_copies_for_load(
            rpm, copies, threshold_rpm, candidates, len(live), policy
        ) or scaling.missing_copies(copies, policy, len(live))
        if not add and scaling.want_second_copy(
            view,
            copies=copies,
            last_used_ms=last_used_ms,
            prior_use_ms=prior_use_ms,
            candidates=candidates,
            policy=policy,
        ):
            add = 1
        if add:
            log.info("adding %d copies of %s (%d copies, %d rpm per copy)", add, model_id, copies, rpm)
            placed: set[str] = set()
            for _ in range(add):
                target = await self.router.place(model_id, exclude=frozenset(placed))
                if target is None:
                    break
                placed.add(target)
            return
        if scaling.should_drop_copy(
            view,
            copies=holders,
            last_used_ms=last_used_ms,
            default_model_units=self.cluster.default_units,
            policy=policy,
            idle_ms=self.config.idle_ms,
        ):
            log.info("dropping an idle copy of %s (cluster nearly full)", model_id)
            self.local.shed(model_id)

    def _worst_holder(self, view: ClusterView, holders: dict[str, int]) -> bool:
        """Whether this instance is the one that should give a copy up (only one per round)."""
        live = [h for i in holders if (h := view.get(i)) is not None]
        return scaling.worst_holder(view, live, self.cluster.default_units) == view.self_id
