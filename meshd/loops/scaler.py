"""Copy scaling, applied by each instance to the copies it holds (SPEC §6 cadence).

Every rate-check interval: a copy serving more than the per-copy threshold asks for more
copies, as does a language model's copy whose engine kept requests waiting while no other copy
of it was loading (decisions.placement.llm.queue_stays_deep), unless another copy's load began
within two intervals and twice the model type's assume-loaded time (upstream's hold,
`scaling.loaded_recently`); a model used regularly (again
7-40 min after an earlier spell) gets a second copy; a model below its `min_copies` gets
copies placed; an idle extra copy is dropped when the cluster is nearly full and this instance
is the worst holder; a model above its `max_copies` loses the worst holder's copy. The rules are
`meshd.decisions.placement.scaling` (pure); this module samples rates, asks them and carries
out the answers.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from meshd.decisions.cache import State
from meshd.decisions.placement import scaling
from meshd.decisions.placement.llm import copies_loading, queue_stays_deep
from meshd.decisions.placement.modelkey import policy_from_key
from meshd.decisions.placement.scaling import ModelPolicy, QueueSample
from meshd.decisions.placement.view import ClusterView
from meshd.registry.models import Registry
from meshd.serving.cluster import Cluster
from meshd.serving.local import LocalModels
from meshd.serving.router import Router

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScalerConfig:
    interval_ms: int = scaling.RATE_CHECK_INTERVAL_MS
    threshold_rpm: int = scaling.DEFAULT_SCALE_UP_RPM_THRESHOLD
    idle_ms: int | None = None  # None: upstream's min(10 h, 10 % of the cache age)
    bandwidth_pct: int = scaling.DEFAULT_CONC_SCALEUP_BANDWIDTH_PCT  # copies with concurrency limits


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
        depths, self.router.forwarder.queue_depths = self.router.forwarder.queue_depths, {}
        for entry in self.local.cache.entries():
            if entry.state is not State.LOADED:
                continue
            served_now[entry.model_id] = entry.served
            sample: QueueSample | None = None
            if entry.gate is not None:
                g = entry.gate
                sums = gates_now[entry.model_id] = QueueSample(
                    g.limit, g.completed, g.service_ms, g.queued_requests, g.queue_ms
                )
                sample = sums.since(self._gates.get(entry.model_id))
            record = self.registry.get(entry.model_id)
            if record is None:
                continue
            try:
                policy = policy_from_key(record.key)
            except ValueError:
                policy = scaling.DEFAULT_POLICY
            holders = {i: t for i, t in record.instance_ids.items() if i == view.self_id or view.live(i)}
            rpm = scaling.copy_rpm(
                entry.served, self._served.get(entry.model_id, entry.served), self.config.interval_ms
            )
            rpm, threshold = scaling.gated_rate(rpm, self.config.threshold_rpm, sample, self.config.bandwidth_pct)
            assume_ms = self.cluster.assume_loaded_ms(record.type)
            depth = depths.get(entry.model_id)
            if depth is not None:  # a language model's engine: a queue kept, no copy on its way
                loading = copies_loading(holders, view.self_id, view.now_ms, assume_ms)
                if queue_stays_deep(*depth, loading):
                    rpm = max(rpm, threshold)
            recent_ms = scaling.recent_load_window_ms(self.config.interval_ms, assume_ms)
            try:  # one model's failure must neither stop the others nor skew the next rates
                await self._apply(
                    view,
                    entry.model_id,
                    policy,
                    holders,
                    rpm,
                    threshold,
                    entry.last_used_ms,
                    entry.prior_use_ms,
                    recent_ms,
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
        recent_load_ms: int,
    ) -> None:
        decision = scaling.decide_copies(
            view,
            holders=holders,
            policy=policy,
            rpm=rpm,
            threshold_rpm=threshold_rpm,
            last_used_ms=last_used_ms,
            prior_use_ms=prior_use_ms,
            default_model_units=self.cluster.default_units,
            recent_load_ms=recent_load_ms,
            idle_ms=self.config.idle_ms,
        )
        if decision.drop:
            log.info("dropping a copy of %s: %s", model_id, decision.reason)
            self.local.shed(model_id)
        elif decision.add:
            log.info(
                "adding %d copies of %s (%s; %d copies, %d rpm per copy)",
                decision.add,
                model_id,
                decision.reason,
                len(holders),
                rpm,
            )
            placed: set[str] = set()
            for _ in range(decision.add):
                target = await self.router.place(model_id, exclude=frozenset(placed))
                if target is None:
                    break
                placed.add(target)
