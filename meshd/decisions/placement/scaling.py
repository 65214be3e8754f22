"""Copy scaling: when a model should gain or lose copies. Decisions only; nothing is done here.

Each instance evaluates these periodically for the copies it holds (upstream: the rate
check every 10 s for scale-up, the janitor every 6 min for scale-down) and acts on the
answers through the mechanisms. Owns `ModelPolicy` (meshd's per-model min/max copies and
size override, beyond upstream), the cluster-wide free ratio and LRU helpers, and the rules:

- `want_second_copy`: 1 -> 2 when a model is used again 7-40 min after an earlier use and
  the cluster has room (upstream's "regular use" heuristic, SPEC §6).
- `extra_copies_for_load`: more copies when each copy serves more than the scale-up
  threshold (MM_SCALEUP_RPM_THRESHOLD, 2000 rpm).
- `loaded_recently` / `recent_load_window_ms`: no copies for load while another copy's load began
  too recently for the measured rate to show what it serves (upstream's hold).
- `should_drop_copy`: give a copy back when the cluster is nearly full (<= 5 % free), the
  model is idle, and this holder is the worse placement.
- `missing_copies`: copies to add to honour a policy's min_copies.
- `decide_copies`: the rules above in upstream's order, for one copy at one check.
- `max_reached`: whether one more holder would exceed a policy's max_copies (checked
  inside the registry's compare-and-set, and by the janitor for copies held here).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from meshd.decisions.placement.rank import DEFAULT_MIN_CHURN_AGE_MS, placement_key
from meshd.decisions.placement.view import ClusterView, InstanceView

# ModelMesh SECOND_COPY_MIN_AGE_SECS / SECOND_COPY_MAX_AGE_SECS (mm.min/max_second_copy_age_secs):
# a single-copy model used now that was also used 7-40 min ago gets a second copy.
SECOND_COPY_MIN_AGE_MS = 420_000  # 7 min
SECOND_COPY_MAX_AGE_MS = 2_400_000  # 40 min
# ModelMesh rateTrackingTask: "used now" means requests since the last rate check (every 10 s).
RATE_CHECK_INTERVAL_MS = 10_000
# ModelMesh scale-up: only when the cluster is >= 10 % free, or its global LRU is older than 20 h
# (so the extra copy evicts nothing anyone used recently).
SCALE_UP_MIN_FREE_RATIO = 0.10
SCALE_UP_MIN_GLOBAL_LRU_AGE_MS = 20 * 3_600_000
# ModelMesh DEFAULT_SCALEUP_RPM / MM_SCALEUP_RPM_THRESHOLD: per-copy rate above which copies are added.
DEFAULT_SCALE_UP_RPM_THRESHOLD = 2000
# ModelMesh MM_CONC_SCALEUP_BANDWIDTH_PCT: a concurrency-limited copy asks for more copies above
# this share of its estimated capacity.
DEFAULT_CONC_SCALEUP_BANDWIDTH_PCT = 90
# ModelMesh scale-up: at most max(2, instances/3) copies added per step.
SCALE_UP_MIN_STEP = 2
SCALE_UP_STEP_DIVISOR = 3
# ModelMesh janitor: scale down only when the instance set is <= 5 % free.
SCALE_DOWN_MAX_FREE_RATIO = 0.05
# ModelMesh SECOND_COPY_REMOVE_MAX_AGE_MS: a second copy idle for min(10 h, 10 % of the cache
# age) is removed.
SCALE_DOWN_MAX_IDLE_MS = 10 * 3_600_000
SCALE_DOWN_IDLE_AGE_DIVISOR = 10


@dataclass(frozen=True, slots=True)
class ModelPolicy:
    """meshd's per-model copy policy (upstream has none: one copy per pod at most).

    `min_copies`: copies kept while the model is loaded at all (scale-down never goes
    below it; `missing_copies` tops up to it). `max_copies`: 0 means one per instance.
    `declared_size_bytes`: the model's memory size as the user declared it (meshd key
    `size_bytes`); `disk_size_bytes`: upstream's `disk_size_bytes` key field, a weaker hint.
    """

    min_copies: int = 1
    max_copies: int = 0
    declared_size_bytes: int | None = None
    disk_size_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.min_copies < 0:
            raise ValueError(f"min_copies must be >= 0, got {self.min_copies}")
        if self.max_copies < 0:
            raise ValueError(f"max_copies must be >= 0 (0 = one per instance), got {self.max_copies}")
        if self.max_copies and self.min_copies > self.max_copies:
            raise ValueError(f"min_copies ({self.min_copies}) exceeds max_copies ({self.max_copies})")
        for name, value in (("size_bytes", self.declared_size_bytes), ("disk_size_bytes", self.disk_size_bytes)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")

    @property
    def size_hint_bytes(self) -> int | None:
        """The best size hint: the declared size, else the disk size, else None."""
        return self.declared_size_bytes if self.declared_size_bytes is not None else self.disk_size_bytes

    def copy_limit(self, instances: int) -> int:
        """Most copies allowed with `instances` live instances (never more than one each)."""
        return instances if self.max_copies == 0 else min(self.max_copies, instances)


DEFAULT_POLICY = ModelPolicy()


def max_reached(policy: ModelPolicy, holders: Iterable[str], self_id: str, serving: AbstractSet[str]) -> bool:
    """Whether the holders other than `self_id` already reach the policy's copy limit.

    Only holders in `serving` count: live instances (a record present) that are not
    shutting down. A gone holder's id may linger in a model record until the leader prunes
    it, and a draining holder's copy is about to go: counting either would leave the model
    with no copy once they are gone."""
    elsewhere = sum(1 for iid in holders if iid != self_id and iid in serving)
    return elsewhere >= policy.copy_limit(len(serving | {self_id}))


# ---- cluster-wide figures -------------------------------------------------------------------
def _serving(view: ClusterView) -> tuple[InstanceView, ...]:
    return view.serving


def cluster_free_ratio(view: ClusterView) -> float:
    """Free units over capacity across live instances that are not shutting down (0 if none)."""
    return view.free_ratio  # computed once per view: the scaler asks once per copy


def global_lru_ms(view: ClusterView) -> int:
    """Oldest LRU time across live instances (now when none reports one)."""
    return view.oldest_lru_ms


def cache_age_ms(view: ClusterView) -> int:
    """How long ago the least recently used loaded model anywhere was used."""
    return max(0, view.now_ms - global_lru_ms(view))


def cluster_has_room(view: ClusterView) -> bool:
    """Room for an extra copy: >= 10 % free, or nothing used in the last 20 h would be evicted."""
    return cluster_free_ratio(view) >= SCALE_UP_MIN_FREE_RATIO or cache_age_ms(view) > SCALE_UP_MIN_GLOBAL_LRU_AGE_MS


def _live_copies(view: ClusterView, copies: Mapping[str, int]) -> list[InstanceView]:
    """Holders that are live and not shutting down (a leaving holder's copy is going away)."""
    out: list[InstanceView] = []
    for iid in copies:
        inst = view.get(iid)
        if inst is not None and not inst.shutdown:
            out.append(inst)
    return out


# ---- scale-up -------------------------------------------------------------------------------
def want_second_copy(
    view: ClusterView,
    *,
    copies: int,
    last_used_ms: int,
    prior_use_ms: int | None,
    candidates: int,
    policy: ModelPolicy = DEFAULT_POLICY,
) -> bool:
    """Upstream's 1 -> 2 rule: used now, and also used 7-40 min ago, and there is room.

    `copies`: live copies now (the rule only applies at exactly one). `last_used_ms`: the
    latest use; "now" means within the last rate-check interval (10 s). `prior_use_ms`: the
    use before the current spell of use (None: never used before), which must be 7-40 min
    ago: a one-off or a short burst does not earn a second copy, regular use does.
    `candidates`: instances that could take the copy (live, not holding it, allowed by
    type constraints). Also needs the policy to allow two copies and the cluster to have
    room (`cluster_has_room`).
    """
    now = view.now_ms
    if copies != 1 or candidates < 1 or prior_use_ms is None:
        return False
    if policy.copy_limit(len(_serving(view))) < 2:
        return False
    if now - last_used_ms > RATE_CHECK_INTERVAL_MS:
        return False
    if not SECOND_COPY_MIN_AGE_MS <= now - prior_use_ms <= SECOND_COPY_MAX_AGE_MS:
        return False
    return cluster_has_room(view)


def extra_copies_for_load(
    rpm_per_copy: int,
    copies: int,
    threshold_rpm: int,
    candidates: int,
    instances_total: int,
    policy: ModelPolicy = DEFAULT_POLICY,
) -> int:
    """Copies to add because each copy serves more than `threshold_rpm` (0 if none).

    Upstream: at or above the threshold, add min(rpm / threshold, candidates) copies,
    at most max(2, instances / 3) in one step; meshd also stops at the policy's max copies.
    """
    if threshold_rpm <= 0 or rpm_per_copy < threshold_rpm or copies < 1:
        return 0
    wanted = min(rpm_per_copy // threshold_rpm, candidates)
    step = max(SCALE_UP_MIN_STEP, instances_total // SCALE_UP_STEP_DIVISOR)
    room = policy.copy_limit(instances_total) - copies
    return max(0, min(wanted, step, room))


def recent_load_window_ms(interval_ms: int, assume_loaded_ms: int) -> int:
    """How far back a copy's load start holds back copies for load: two check intervals and
    twice the time a load of the model's type is assumed to take (`AssumeLoaded`).

    Upstream (ModelMesh.rateTrackingTask) takes the time since the last check plus the
    check interval plus twice the type's assume-loaded time: a copy loaded that recently
    served for part of the measured interval at most, so the rate overstates what the
    copies serve. meshd's rates are over the configured interval (`copy_rpm`), so the time
    since the last check is that interval here too."""
    return 2 * interval_ms + 2 * assume_loaded_ms


def loaded_recently(holders: Mapping[str, int], self_id: str, now_ms: int, window_ms: int) -> bool:
    """Whether a copy other than this instance's began loading less than `window_ms` ago
    (`holders`: instance -> its load's start, the record's `instanceIds`; a start exactly
    `window_ms` ago no longer counts). This instance's own load is left out, as upstream
    does: the rate was measured on it, so it does not overstate the load."""
    cutoff = now_ms - window_ms
    return any(started > cutoff for iid, started in holders.items() if iid != self_id)


@dataclass(frozen=True, slots=True)
class QueueSample:
    """A concurrency-limited copy over one rate-check interval (from its gate)."""

    max_concurrency: int
    completed: int  # requests that finished
    service_ms: float  # their summed time on the runtime
    queued: int  # requests that had to wait for a slot
    queue_ms: float  # their summed wait

    def since(self, before: QueueSample | None) -> QueueSample:
        """The interval's figures from two samples of the running sums (all of them if none
        before, or if the sums went back: the copy was reloaded meanwhile)."""
        if before is None or self.completed < before.completed or self.queued < before.queued:
            return self
        return QueueSample(
            self.max_concurrency,
            self.completed - before.completed,
            self.service_ms - before.service_ms,
            self.queued - before.queued,
            self.queue_ms - before.queue_ms,
        )


def latency_threshold_rpm(sample: QueueSample, bandwidth_pct: int) -> int | None:
    """Upstream's latency mode: a copy running `max_concurrency` requests at a time, each
    taking the mean service time, serves at most conc x 60000 / mean_ms per minute; copies
    are added above `bandwidth_pct` % of that (MM_CONC_SCALEUP_BANDWIDTH_PCT). None
    without completed requests to estimate from."""
    if sample.completed < 1 or sample.service_ms <= 0:
        return None
    mean_ms = sample.service_ms / sample.completed
    return max(1, int(sample.max_concurrency * 60_000 / mean_ms * bandwidth_pct / 100))


def saturated(sample: QueueSample) -> bool:
    """Requests waited for a slot, on average, at least as long as they then ran: the copy
    is at capacity whatever the rate says (queue delay feeds the scaling decision)."""
    if sample.queued < 1 or sample.completed < 1:
        return False
    mean_wait = sample.queue_ms / max(sample.completed, sample.queued)
    return mean_wait >= sample.service_ms / sample.completed


def load_threshold_rpm(configured_rpm: int, sample: QueueSample | None, bandwidth_pct: int) -> int:
    """The per-copy rate above which copies are added: the latency estimate for a copy
    whose runtime limits its concurrency (upstream), else the configured threshold."""
    if sample is None:
        return configured_rpm
    estimate = latency_threshold_rpm(sample, bandwidth_pct)
    return configured_rpm if estimate is None else estimate


def copy_rpm(served_now: int, served_at_last_check: int, interval_ms: int) -> int:
    """A copy's requests per minute over the last rate-check interval."""
    return (served_now - served_at_last_check) * 60_000 // interval_ms


def gated_rate(rpm: int, configured_rpm: int, sample: QueueSample | None, bandwidth_pct: int) -> tuple[int, int]:
    """The (rate, threshold) copy scaling compares for one copy: the threshold from
    `load_threshold_rpm`; a `saturated` copy counts as at least at the threshold, whatever
    its rate (queue delay feeds the decision). `sample`: None for a copy without a gate."""
    threshold = load_threshold_rpm(configured_rpm, sample, bandwidth_pct)
    if sample is not None and saturated(sample):
        rpm = max(rpm, threshold)
    return rpm, threshold


# ---- scale-down -----------------------------------------------------------------------------
def idle_before_drop_ms(view: ClusterView) -> int:
    """Upstream's idle time before an extra copy goes: min(10 h, 10 % of the cache age)."""
    return min(SCALE_DOWN_MAX_IDLE_MS, cache_age_ms(view) // SCALE_DOWN_IDLE_AGE_DIVISOR)


def should_drop_copy(
    view: ClusterView,
    *,
    copies: Mapping[str, int],
    last_used_ms: int,
    default_model_units: int,
    policy: ModelPolicy = DEFAULT_POLICY,
    idle_ms: int | None = None,
    min_churn_age_ms: int = DEFAULT_MIN_CHURN_AGE_MS,
) -> bool:
    """Whether this instance (`view.self_id`) should unload its copy of an idle model.

    All of: this instance holds a copy (in `copies`, the record's instance ids) and is not
    shutting down (drain handles that); the cluster is <= 5 % free; the model has not been
    used for `idle_ms` (None: upstream's min(10 h, 10 % of the cache age)); more live
    copies than max(1, min_copies), so the result never goes below min_copies and the last
    copy is left to eviction; and this instance is the worst placement among the live
    holders by `placement_key` (upstream's 2 -> 1 rule, applied to any count: only one
    holder, the worst, drops per evaluation round, so holders do not all drop at once).
    """
    if len(copies) <= max(1, policy.min_copies):  # live holders are fewer still (most copies: one)
        return False
    me = view.get(view.self_id)
    if me is None or me.shutdown or view.self_id not in copies:
        return False
    holders = _live_copies(view, copies)
    if len(holders) <= max(1, policy.min_copies):
        return False
    if cluster_free_ratio(view) > SCALE_DOWN_MAX_FREE_RATIO:
        return False
    threshold = idle_before_drop_ms(view) if idle_ms is None else idle_ms
    if view.now_ms - last_used_ms < threshold:
        return False
    return worst_holder(view, holders, default_model_units, min_churn_age_ms) == view.self_id


def worst_holder(
    view: ClusterView,
    holders: Sequence[InstanceView],
    default_model_units: int,
    min_churn_age_ms: int = DEFAULT_MIN_CHURN_AGE_MS,
) -> str | None:
    """The holder that should give its copy up first: the worst by `placement_key`."""
    if not holders:
        return None
    newest = max(h.version for h in holders)
    worst = max(
        holders,
        key=lambda h: placement_key(
            h, view.now_ms, newest, default_model_units=default_model_units, min_churn_age_ms=min_churn_age_ms
        ),
    )
    return worst.instance_id


# ---- policy floor ---------------------------------------------------------------------------
def missing_copies(copies: int, policy: ModelPolicy, live_instances: int) -> int:
    """Copies to add so a model has min(min_copies, live instances) copies (beyond upstream).

    A model with no copy and a floor of one (the default) is left alone: models load on
    demand, as upstream's do, so the default policy never loads every registered model.
    A floor above one is kept even from zero copies (the user asked for it explicitly).
    """
    if copies <= 0 and policy.min_copies <= 1:
        return 0
    target = min(policy.min_copies, policy.copy_limit(live_instances), live_instances)
    return max(0, target - max(0, copies))


# ---- one check ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CopyDecision:
    """What this instance should do about its copy: add `add` copies elsewhere, or drop its own."""

    add: int = 0
    drop: bool = False
    reason: str = ""


KEEP = CopyDecision()


def idle_single_copy(
    view: ClusterView,
    holders: Mapping[str, int],
    policy: ModelPolicy,
    rpm: int,
    threshold_rpm: int,
    last_used_ms: int,
) -> bool:
    """Whether no rule of `decide_copies` can act: the only copy, idle since the last check,
    below the rate threshold, some instance serving (no max-copies drop from one copy while
    an instance serves, no load or floor copies, no second copy without a use now, no idle
    drop of the last copy). Most copies at most checks: evaluating each rule for them was
    most of the simulator's check time. A property test holds the shortcut equal to the rules."""
    return (
        len(holders) == 1
        and policy.min_copies <= 1
        and rpm < threshold_rpm
        and view.now_ms - last_used_ms > RATE_CHECK_INTERVAL_MS
        and bool(_serving(view))
    )


def decide_copies(
    view: ClusterView,
    *,
    holders: Mapping[str, int],
    policy: ModelPolicy,
    rpm: int,
    threshold_rpm: int,
    last_used_ms: int,
    prior_use_ms: int | None,
    default_model_units: int,
    recent_load_ms: int,
    idle_ms: int | None = None,
) -> CopyDecision:
    """The copy-scaling decision for this instance's copy of one model at one rate check.

    `holders`: live holders (record instance ids -> load start), this instance included.
    `rpm`: requests per minute this copy served since the last check. In order: above the
    policy's max copies, the worst holder drops; copies for load (`extra_copies_for_load`),
    unless another holder's load began within `recent_load_ms` (`loaded_recently`; the
    window from `recent_load_window_ms`), or for the policy floor (`missing_copies`); a second
    copy for regular use (`want_second_copy`); an idle extra copy in a nearly full cluster
    (`should_drop_copy`).
    """
    if idle_single_copy(view, holders, policy, rpm, threshold_rpm, last_used_ms):
        return KEEP
    live = _serving(view)
    # Serving instances without a copy, counted over the (few) holders, not every instance.
    candidates = len(live)
    for i in holders:
        h = view.get(i)
        if h is not None and not h.shutdown:
            candidates -= 1
    copies = len(holders)
    if copies > policy.copy_limit(len(live)):
        holding = [h for i in holders if (h := view.get(i)) is not None]
        if worst_holder(view, holding, default_model_units) == view.self_id:  # one holder drops per round
            return CopyDecision(drop=True, reason="above max copies")
    add = extra_copies_for_load(rpm, copies, threshold_rpm, candidates, len(live), policy)
    if add and not loaded_recently(holders, view.self_id, view.now_ms, recent_load_ms):
        return CopyDecision(add=add, reason="load")
    add = missing_copies(copies, policy, len(live)) if copies < policy.min_copies else 0  # else none missing
    if add:
        return CopyDecision(add=add, reason="min copies")
    if want_second_copy(
        view, copies=copies, last_used_ms=last_used_ms, prior_use_ms=prior_use_ms, candidates=candidates, policy=policy
    ):
        return CopyDecision(add=1, reason="regular use")
    if should_drop_copy(
        view,
        copies=holders,
        last_used_ms=last_used_ms,
        default_model_units=default_model_units,
        policy=policy,
        idle_ms=idle_ms,
    ):
        return CopyDecision(drop=True, reason="idle extra copy, cluster nearly full")
    return KEEP
