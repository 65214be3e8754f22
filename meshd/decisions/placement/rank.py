"""Where a cache miss should load: upstream's PLACEMENT_ORDER and CacheMissForwardingLB.

Owns the ranking of instances as load targets (`placement_key`, `is_full`) and the choice
of one target for a model that is loaded nowhere usable (`choose_load_target`). Pure: it
reads a `ClusterView` snapshot and a `LoadRequest`, takes randomness only from the
`random.Random` it is given, and does nothing.

The choice, as upstream makes it (notes in /work/shared/reference/upstream-modelmesh.md §3):

1. Filter: not shutting down, not excluded, carries every required label, big enough for
   the model at all (capacity >= size).
2. Rank by `placement_key` and keep the best plus its *near-best* neighbours: when the best
   is full, those whose LRU is within 45 s (or 10 % of the best's cache age) of its LRU;
   when not full, non-full ones with more than a quarter of its free space and not many
   more models than it holds.
3. Honour preferred labels: when some candidate carries one, keep only those (see
   `_shortlist` for exactly how, following upstream's two cases).
4. If the caller prefers itself and it is in that shortlist, choose it (no hop).
5. Drop instances that are *hot* relative to the least-loaded shortlisted one (`hot_factor`).
6. Pick uniformly at random among what remains, so that concurrent cold loads arriving at
   many instances with the same stale view spread out instead of piling onto one pod.

meshd's own rule (`LoadRequest.start_soonest`, with its value load queue) replaces step 2:
every eligible instance is a candidate, and before step 5 only those whose load queue is
shortest stay (the deciding instance's own queue as it is now, `ClusterView.with_own_loads`),
after it the ones with a quarter of their capacity free when any has it (for a model of a
quarter of an instance or more: where it leaves the least room unused, `pack`), then those
this instance sent the fewest loads to lately. With a disk tier the shortest queue is the
soonest ready: an instance whose disk holds the model's files skips the pull
(`loading.ready_soonest`). Where instance records publish what each one's
next victim is worth (RATE and LRFU eviction), the last two steps give way to placement by
price (`cheapest`): one of the three where the load evicts least, on condition that it still
does when it arrives there (`stays`, checked by the target: `Placement.price_limit`).
"""

from __future__ import annotations

import functools
import math
import random
from collections import deque
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from meshd.decisions.placement.loading import DEFAULT_MEAN_LOAD_MS, ready_soonest
from meshd.decisions.placement.serving import assume_loaded_ms
from meshd.decisions.placement.view import ClusterView, InstanceView

# --- "full" ------------------------------------------------------------------------------
# ModelMesh.initialize(): minSpaceUnits = max(default x (1 | 2), min(default x loadThreads, cap/20)),
# where the factor is 1 when the runtime unloads explicitly (an unload buffer is reserved)
# or has a single loading thread, else 2.
FULL_CAPACITY_DIVISOR = 20  # upstream: cap/20 (5 % of capacity)

# --- churn guard, used by the version rule of the ordering --------------------------------
# ModelMesh: minChurnAgeMs = 10 x defaultAssumeLoadedAfterMs (= 10 x max(3 s, timeout/3)).
MIN_CHURN_AGE_FACTOR = 10
# ModelMesh PLACEMENT_ORDER: a newer version is preferred unless it is full with an LRU
# younger than 2 x minChurnAgeMs (i.e. it is saturated and would be churning its cache).
SATURATED_CHURN_MULTIPLE = 2
DEFAULT_LOADING_TIMEOUT_MS = 90_000  # meshd.runtime.client's default when a runtime reports 0

# --- near-best shortlist (CacheMissForwardingLB) --------------------------------------------
NEAR_BEST_LRU_WINDOW_MS = 45_000  # upstream: full best -> keep LRU within 45 s of the best's ...
NEAR_BEST_LRU_AGE_DIVISOR = 10  # ... or within 10 % of the best's cache age
NEAR_BEST_FREE_DIVISOR = 4  # upstream: non-full best -> keep free >= best free / 4 (best >> 2)
NEAR_BEST_COUNT_ANY_BELOW = 10  # upstream: a model count below 10 never disqualifies ...
NEAR_BEST_COUNT_SLACK_DIVISOR = 4  # ... else count <= best count x 1.25 (best + best >> 2)
PREFERRED_LRU_WINDOW_MS = 120_000  # upstream: full best -> preferred ones within 120 s ...
PREFERRED_LRU_AGE_DIVISOR = 4  # ... or 25 % of the best's cache age

# --- meshd's placement (LoadRequest.start_soonest) -----------------------------------------
ROOMY_DIVISOR = 4  # an instance with a quarter of its capacity free takes loads first
# A model of this share of an instance's capacity or more is placed to pack (`pack`): where it
# leaves the least unusable room, so big models do not strand the fleet's capacity in holes.
PACK_DIVISOR = 4

# Placement by price (with RATE or LRFU eviction, whose records publish what each instance's
# next victim is worth): a load goes to one of the PRICED_CHOICES instances, of those where it
# starts soonest, whose next victim is worth least (`cheapest`); the one chosen takes it only
# if, as it is now, it would evict no more than the dearest of those and has a thread free
# (`stays`), else the sender places it once more among those at most that price, with no
# condition. Records are up to 2 s old: the cheapest alone drew every sender's loads (queued,
# p99 up 20-70 %); a random one of three, checked live, kept the p99 and saved up to 1.6
# points of loads on the presets (docs/simulator.md). Not with 3 candidates or fewer.
PRICED_CHOICES = 3

# --- recent placements ----------------------------------------------------------------------
RECENT_PLACEMENT_MS = 5_000  # longer than instance records take to show a load (>= 2 s)

# --- hot instances (CacheMissForwardingLB's final filter) -----------------------------------
HOT_RPM_FLOOR = 100  # upstream: instances under 100 rpm are never hot; the baseline is >= 100
SCALE_UP_HOT_FACTOR = 1.1  # upstream: load-triggered scale-up -> rpm > 1.1 x min is hot
JUST_USED_MS = 5_000  # upstream: model used in the last 5 s ...
JUST_USED_HOT_FACTOR = 1.5  # ... -> rpm > 1.5 x min is hot
RECENTLY_USED_MS = 12 * 60_000  # upstream: used in the last 12 min ...
RECENTLY_USED_HOT_FACTOR = 3.0  # ... -> rpm > 3 x min is hot
USED_TODAY_MS = 24 * 3_600_000  # upstream: used in the last day ...
USED_TODAY_HOT_FACTOR = 4.0  # ... -> rpm > 4 x min is hot; older models are not filtered


def min_churn_age_ms(loading_timeout_ms: int) -> int:
    """Upstream's default minimum cache turnover age: 10 x max(3 s, timeout/3)."""
    return MIN_CHURN_AGE_FACTOR * assume_loaded_ms(loading_timeout_ms)


DEFAULT_MIN_CHURN_AGE_MS = min_churn_age_ms(DEFAULT_LOADING_TIMEOUT_MS)


def full_threshold_units(inst: InstanceView, default_model_units: int, *, explicit_unload: bool = True) -> int:
    """Free units below which `inst` counts as full.

    Reading of upstream's "Full = free < max(default x (1|2), min(default x loadThreads,
    cap/20))": the factor is 1 when the runtime unloads explicitly or loads one model at
    a time, otherwise 2. meshd always unloads explicitly (the runtime SPI has
    `unloadModel`), so the factor is 1 unless a caller says otherwise. Upstream computes the
    threshold once from the *local* instance's parameters and applies it to every record;
    meshd computes it from each instance's own record (capacity, loading threads), which
    agrees for homogeneous pods and is fairer for mixed ones.
    """
    return _full_threshold(max(1, default_model_units), inst.loading_threads, inst.capacity, explicit_unload)


@functools.lru_cache(maxsize=1024)
def _full_threshold(default: int, loading_threads: int, capacity: int, explicit_unload: bool) -> int:
    # Memoised: placement builds a key for every instance per load, and fleets are uniform.
    factor = 1 if explicit_unload or loading_threads <= 1 else 2
    target = min(default * max(1, loading_threads), capacity // FULL_CAPACITY_DIVISOR)
    return max(default * factor, target)


def is_full(inst: InstanceView, default_model_units: int, *, explicit_unload: bool = True) -> bool:
    """Whether `inst` has less free room than `full_threshold_units` (see there)."""
    return inst.free < full_threshold_units(inst, default_model_units, explicit_unload=explicit_unload)


def is_saturated(inst: InstanceView, now_ms: int, default_model_units: int, min_churn_age_ms: int) -> bool:
    """Full, and its least recently used model is younger than 2 x the churn age."""
    young = now_ms - inst.lru_time < SATURATED_CHURN_MULTIPLE * min_churn_age_ms
    return young and is_full(inst, default_model_units)


PlacementKey = tuple[bool, bool, int, bool, int, int, int, int, int, int, int, int, str]


def placement_key(
    inst: InstanceView,
    now_ms: int,
    newest_version: int,
    *,
    default_model_units: int,
    min_churn_age_ms: int = DEFAULT_MIN_CHURN_AGE_MS,
) -> PlacementKey:
    """Sort key: smaller is a better place to load a model (upstream's PLACEMENT_ORDER).

    In order: not shutting down; newer version, unless the instance is saturated (full
    with an LRU younger than 2 x `min_churn_age_ms`), in which case its version does not
    count; not full; when both are full, older LRU; fewer models; more free units; when
    both are not full, older LRU; more idle loading threads; fewer loads in progress;
    bigger capacity; lower request rate; then the instance id, so the order is total.

    Upstream compares versions pairwise ("prefer the newer unless it is saturated"); as a
    key that becomes (saturated, versions behind the newest, or 0 when saturated), which
    agrees with the pairwise rule in every case: a saturated instance loses to any
    unsaturated one anyway, through the fullness or LRU comparisons that follow.
    (Upstream's own check compares the absolute lruTime with a duration, so it always
    prefers the newer version; meshd implements what the comment there says.)
    """
    full = is_full(inst, default_model_units)
    # is_saturated, with `full` computed once (this key is built for every instance per load)
    saturated = full and now_ms - inst.lru_time < SATURATED_CHURN_MULTIPLE * min_churn_age_ms
    versions_behind = 0 if saturated else max(0, newest_version - inst.version)
    return (
        inst.shutdown,
        saturated,
        versions_behind,
        full,
        inst.lru_time if full else 0,  # both full: older LRU first
        inst.count,
        -inst.free,
        inst.lru_time if not full else 0,  # both not full: older LRU first
        -(inst.loading_threads - inst.loading_in_progress),
        inst.loading_in_progress,
        -inst.capacity,
        inst.rpm,
        inst.instance_id,
    )


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """What a cache miss needs placed.

    `exclude`: instances already tried, already holding a copy, or that failed to load it
    recently. `prefer_self`: the client balanced its own load (mm-balanced) or the request
    arrived here; this instance is then chosen when it is among the near-best.
    `default_model_units`: the runtime's default model size, which sets the "full"
    threshold (None: use `size_units`). `last_used_ms`: when the model was last used
    (None: now, the usual case for a request-triggered miss); it sets how strictly hot
    instances are avoided. `scale_up`: the load adds a copy because of request load, which
    avoids even mildly busier instances. `min_churn_age_ms`: see `min_churn_age_ms()`.
    `recent_placements`: loads the deciding instance sent to each instance in the last few
    seconds (newer than the records it sees); the pick favours the fewest.
    """

    model_id: str
    model_type: str
    size_units: int
    exclude: frozenset[str] = frozenset()
    required_labels: frozenset[str] = frozenset()
    preferred_labels: frozenset[str] = frozenset()
    prefer_self: bool = False
    default_model_units: int | None = None
    last_used_ms: int | None = None
    scale_up: bool = False
    min_churn_age_ms: int = DEFAULT_MIN_CHURN_AGE_MS
    recent_placements: Mapping[str, int] = field(default_factory=dict)
    # meshd's placement (its value load queue): every instance is a candidate, and of them
    # those whose load queue is shortest (choose_load_target); False: upstream's near-best
    start_soonest: bool = False
    # With start_soonest: place by price where records publish one (`cheapest`); False: the
    # simulator's `meshd-unpriced`, meshd's placement before it
    by_price: bool = True
    # A load placed by price that its target refused (`stays`) is placed once more among the
    # instances whose price is at most the limit it carried, without a limit this time
    price_ceiling: float | None = None
    # With start_soonest: what pulling the model's files would take (None: not known, or no
    # instance has a disk tier), and the mean load time that a place in a queue costs; a load
    # goes where the files are on disk when it is ready sooner there (loading.ready_soonest)
    pull_ms: float | None = None
    mean_load_ms: float = DEFAULT_MEAN_LOAD_MS


def hot_factor(last_used_ago_ms: int, scale_up: bool) -> float | None:
    """How many times the least-loaded candidate's rate makes an instance hot; None: no filter.

    Upstream's ladder, by how recently the model was used: a load-triggered scale-up
    1.1x; used in the last 5 s 1.5x; 12 min 3x; a day 4x; older models are not filtered
    (an instance busy with other models is a fine home for a model nobody is waiting for).
    """
    if scale_up:
        return SCALE_UP_HOT_FACTOR
    if last_used_ago_ms < JUST_USED_MS:
        return JUST_USED_HOT_FACTOR
    if last_used_ago_ms < RECENTLY_USED_MS:
        return RECENTLY_USED_HOT_FACTOR
    if last_used_ago_ms < USED_TODAY_MS:
        return USED_TODAY_HOT_FACTOR
    return None


def drop_hot(candidates: Sequence[InstanceView], factor: float | None) -> list[InstanceView]:
    """Candidates without the hot ones: rpm >= 100 and rpm > factor x max(100, min rpm).

    The least-loaded candidate is never hot, so the result is never empty (when the input
    is not).
    """
    if factor is None or len(candidates) < 2:
        return list(candidates)
    baseline = max(HOT_RPM_FLOOR, min(c.rpm for c in candidates))
    limit = factor * baseline
    return [c for c in candidates if c.rpm < HOT_RPM_FLOOR or c.rpm <= limit]


def is_large(candidates: Sequence[InstanceView], size_units: int) -> bool:
    """Whether a model of `size_units` is big enough to place by packing: a `PACK_DIVISOR`th of
    the largest candidate's capacity or more (PACK_DIVISOR 0: never)."""
    return PACK_DIVISOR > 0 and bool(candidates) and size_units * PACK_DIVISOR >= max(c.capacity for c in candidates)


def pack(candidates: Sequence[InstanceView], size_units: int) -> list[InstanceView]:
    """The candidates where a big model wastes the least room: where it fits in free room, those
    it leaves the least free room on (best fit: the bigger holes stay whole for the next big
    model); where it fits nowhere, those with the most free room (the least to evict). Within
    a `PACK_DIVISOR`th of the model's size of the best, so near-equal instances still share."""
    slack = size_units // max(1, PACK_DIVISOR)
    fits = [c for c in candidates if c.free >= size_units]
    if fits:
        least = min(c.free for c in fits)
        return [c for c in fits if c.free <= least + slack]
    most = max(c.free for c in candidates)
    return [c for c in candidates if c.free >= most - slack]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a load goes. `price_limit` (placement by price): the target takes it only if it
    `stays` there; None: unconditionally."""

    target: str
    price_limit: float | None = None


def load_price(free_units: int, victim_value: float | None, size_units: int) -> float | None:
    """What a load of `size_units` costs an instance (log2 worth of what it evicts first): -inf
    where it fits in free room; else its next victim's value (None: not known)."""
    return -math.inf if free_units >= size_units else victim_value


def price(inst: InstanceView, size_units: int) -> float | None:
    """`load_price` on an instance's record (None where the record publishes no value)."""
    return load_price(inst.free, inst.victim_value, size_units)


def cheapest(
    candidates: Sequence[InstanceView], size_units: int, rng: random.Random
) -> tuple[list[InstanceView], float | None]:
    """The `PRICED_CHOICES` candidates where the load costs least (ties in random order) and the
    dearest price among them. The candidates as given and None when there are no more than
    `PRICED_CHOICES` (the price would choose nothing, and its check at the target would only
    add calls: measured on the peers bench's three instances), when one has no price (an
    instance under LRU or GDSF eviction, or an older meshd, without room for it), or when none
    publishes one (a fleet that does not price: its own rules apply even where all have room)."""
    if len(candidates) <= PRICED_CHOICES or all(c.victim_value is None for c in candidates):
        return list(candidates), None
    priced: list[tuple[float, InstanceView]] = []
    for c in candidates:
        p = price(c, size_units)
        if p is None:
            return list(candidates), None
        priced.append((p, c))
    rng.shuffle(priced)
    priced.sort(key=lambda pc: pc[0])  # stable: equal prices stay in random order
    top = priced[:PRICED_CHOICES]
    return [c for _, c in top], top[-1][0]


@dataclass(slots=True)
class PriceOffer:
    """One request's placement by price, as the router and the simulator follow it: the first
    load sent to a peer carries its price limit; once that peer refuses it (`stays` false), the
    limit is the ceiling of the next pick (`LoadRequest.price_ceiling`), which carries none."""

    offered: bool = False
    ceiling: float | None = None

    def limit_for(self, placed: Placement, self_id: str) -> float | None:
        """The limit to send with `placed` (None: none; a load here needs none)."""
        if self.offered or placed.target == self_id or placed.price_limit is None:
            return None
        self.offered = True
        return placed.price_limit

    def refused(self, price_limit: float) -> None:
        """The target of the load sent with `price_limit` refused it."""
        self.ceiling = price_limit


def under_ceiling(candidates: Sequence[InstanceView], size_units: int, ceiling: float) -> list[InstanceView]:
    """The candidates whose price for the load is known and at most `ceiling`."""
    return [c for c in candidates if (p := price(c, size_units)) is not None and p <= ceiling]


def stays(own_price: float | None, price_limit: float | None, loads_in_progress: int, loading_threads: int) -> bool:
    """Whether a load placed by price stays on the instance it was sent to: what it would evict
    now (`own_price`, None: nothing it could evict) is worth no more than `price_limit`, and
    a loading thread is free. The sender's prices were read from records up to 2 s old."""
    if price_limit is None:
        return True
    return own_price is not None and own_price <= price_limit and loads_in_progress < loading_threads


def eligible(view: ClusterView, req: LoadRequest) -> list[InstanceView]:
    """Instances that may take the load at all (step 1), in no particular order."""
    return [
        inst
        for inst in view.instances.values()
        if not inst.shutdown
        and inst.instance_id not in req.exclude
        and req.required_labels <= inst.labels
        and inst.capacity >= req.size_units
    ]


def rank(
    instances: Sequence[InstanceView],
    now_ms: int,
    *,
    default_model_units: int,
    min_churn_age_ms: int = DEFAULT_MIN_CHURN_AGE_MS,
) -> list[InstanceView]:
    """`instances` best first by `placement_key` (versions judged against the newest among them)."""
    newest = max((i.version for i in instances), default=0)
    return sorted(
        instances,
        key=lambda i: placement_key(
            i, now_ms, newest, default_model_units=default_model_units, min_churn_age_ms=min_churn_age_ms
        ),
    )


def _near(inst: InstanceView, best: InstanceView, best_full: bool, now_ms: int, default_units: int) -> bool:
    """Whether `inst` is close enough to `best` to share the random pick."""
    if best_full:
        diff = inst.lru_time - best.lru_time
        age = max(0, now_ms - best.lru_time)
        return diff <= NEAR_BEST_LRU_WINDOW_MS or diff <= age // NEAR_BEST_LRU_AGE_DIVISOR
    if is_full(inst, default_units) or inst.free < best.free // NEAR_BEST_FREE_DIVISOR:
        return False
    return (
        inst.count < NEAR_BEST_COUNT_ANY_BELOW or inst.count <= best.count + best.count // NEAR_BEST_COUNT_SLACK_DIVISOR
    )


def _shortlist(ranked: list[InstanceView], req: LoadRequest, now_ms: int, default_units: int) -> list[InstanceView]:
    """The best candidate plus its near-best neighbours, honouring preferred labels.

    Preferred labels (an instance is preferred if it carries any of them) follow upstream's
    cases. No candidate preferred, or the best is preferred: the usual near-best set,
    treating preference as required when there is one. Best not full but not preferred:
    the best-ranked non-full preferred candidate becomes the reference and only preferred
    candidates near it are kept (none non-full: ignore the preference). Best full and not
    preferred: preferred candidates whose LRU is within 120 s or 25 % of the best's cache
    age (none: ignore the preference).

    Unlike upstream, which walks the ordering and stops at the first instance out of
    range, every candidate is tested, so an instance a secondary criterion ranked lower
    still qualifies when it is in range.
    """
    best = ranked[0]
    best_full = is_full(best, default_units)
    preferred = [i for i in ranked if i.labels & req.preferred_labels] if req.preferred_labels else []
    pool = ranked
    reference = best
    if preferred and not best.labels & req.preferred_labels:
        if not best_full:
            open_preferred = [i for i in preferred if not is_full(i, default_units)]
            if open_preferred:
                reference, pool = open_preferred[0], preferred
        else:
            age = max(0, now_ms - best.lru_time)
            window = [
                i
                for i in preferred
                if i.lru_time - best.lru_time <= PREFERRED_LRU_WINDOW_MS
                or i.lru_time - best.lru_time <= age // PREFERRED_LRU_AGE_DIVISOR
            ]
            if window:
                return window
    elif preferred:
        pool = preferred
    reference_full = is_full(reference, default_units)
    return [reference] + [
        i for i in pool if i is not reference and _near(i, reference, reference_full, now_ms, default_units)
    ]


def _every_candidate(candidates: list[InstanceView], req: LoadRequest) -> list[InstanceView]:
    """meshd's candidates (`LoadRequest.start_soonest`): every eligible instance, only the
    preferred ones when some carry a preferred label. No near-best window on cache age:
    see `choose_load_target`."""
    pool = [i for i in candidates if i.labels & req.preferred_labels] if req.preferred_labels else []
    return pool or candidates


def newest_version_first(
    candidates: list[InstanceView], now_ms: int, default_model_units: int, min_churn_age_ms: int
) -> list[InstanceView]:
    """Upstream's version rule for meshd's placement: during a rolling update, loads go to
    instances of the newest version, unless every one of those is saturated (full, with an
    LRU younger than 2 x the churn age), when the version does not count (PLACEMENT_ORDER).
    Older pods are about to go: a copy loaded there is a copy to load again."""
    versions = {c.version for c in candidates}
    if len(versions) < 2:  # the usual case: one version
        return candidates
    newest = max(versions)
    newer = [c for c in candidates if c.version == newest]
    if all(is_saturated(c, now_ms, default_model_units, min_churn_age_ms) for c in newer):
        return candidates
    return newer


def shortlist(view: ClusterView, req: LoadRequest) -> list[InstanceView]:
    """Steps 1-3: the candidates the random pick chooses among (best first, but in no order with
    `start_soonest`); empty if none."""
    default_units = req.default_model_units if req.default_model_units is not None else req.size_units
    default_units = max(1, default_units)
    candidates = eligible(view, req)
    if not candidates:
        return []
    if req.start_soonest:
        # No ranking: every candidate stays in, and the pick among those left is random.
        # (Sorting them was a fifth of the simulator's time, for the order of a random pick.)
        pool = _every_candidate(candidates, req)
        return newest_version_first(pool, view.now_ms, default_units, req.min_churn_age_ms)
    ranked = rank(candidates, view.now_ms, default_model_units=default_units, min_churn_age_ms=req.min_churn_age_ms)
    return _shortlist(ranked, req, view.now_ms, default_units)


def may_load_as_last_resort(view: ClusterView, own_labels: frozenset[str], required: frozenset[str]) -> bool:
    """Whether `view.self_id` may load a model placement found no instance for: only when
    it is not shutting down and carries the labels the model's type requires (its record
    when published, else its configured labels)."""
    me = view.get(view.self_id)
    if me is None:
        return required <= own_labels
    return not me.shutdown and required <= me.labels


def load_here_as_last_resort(
    view: ClusterView, excluded: AbstractSet[str], own_labels: frozenset[str], required: frozenset[str]
) -> bool:
    """Placement found no instance: whether the request's own instance loads it anyway (not
    when it was already tried for this request, or may not load it at all)."""
    return view.self_id not in excluded and may_load_as_last_resort(view, own_labels, required)


def background_load_used_ms(requested_ms: int | None, record_last_used_ms: int, now_ms: int) -> int:
    """The last-used time a background load (a new copy) is admitted at: the one asked for,
    else the model's record's, never in the future. A copy dated at the model's real last
    use evicts only what is older, not whatever happens to be loaded."""
    return min(requested_ms or record_last_used_ms or now_ms, now_ms)


def adapter_exclusions(
    instances: frozenset[str], base_holders: frozenset[str], exclude: frozenset[str]
) -> frozenset[str]:
    """Where a LoRA adapter may not load: beside no copy of its base while one is held by an
    instance it may use (it loads into the base's engine; elsewhere the base loads first)."""
    usable = (base_holders & instances) - exclude
    return exclude | (instances - usable) if usable else exclude


def choose_load_target(view: ClusterView, req: LoadRequest, rng: random.Random) -> str | None:
    """The instance that should load `req.model_id`, or None when no instance qualifies."""
    placed = choose_load(view, req, rng)
    return None if placed is None else placed.target


def choose_load(view: ClusterView, req: LoadRequest, rng: random.Random) -> Placement | None:
    """Where `req.model_id` should load, and on what condition; None when no instance qualifies."""
    near = shortlist(view, req)
    if not near:
        return None
    if req.prefer_self and not req.start_soonest and any(i.instance_id == view.self_id for i in near):
        return Placement(view.self_id)
    last_used_ago = 0 if req.last_used_ms is None else view.now_ms - req.last_used_ms
    if req.start_soonest:
        # meshd's rule: a load goes where it can start soonest, among all instances, not
        # only among those whose cache age is near the oldest. Each
        # instance evicts well by itself (GDSF's victim is not its oldest copy, so cache
        # ages differ widely and the near-best window kept one or two instances), while
        # loads piled on those queued for a thread: in the simulator (zipf, 10 instances,
        # 2 threads) this cut queued loads from 24 % to 1 % and the added p99 by 25-65 %,
        # with the same hit ratio (docs/simulator.md). The queue comes before the hot filter:
        # filtered first, the instance serving the most requests took no loads while its
        # thread was idle and the others' queued (bench/peers.py, one thread per runtime:
        # loads 479 / 685 / 655, 49 req/s; queue first: 610 / 613 / 632, 71 req/s).
        # With a disk tier: where it is ready soonest, the pull skipped where the files are (issue 42).
        near = ready_soonest(near, req.model_id, req.pull_ms, req.mean_load_ms)
    remaining = drop_hot(near, hot_factor(last_used_ago, req.scale_up))
    if req.start_soonest:
        if req.prefer_self and any(i.instance_id == view.self_id for i in remaining):
            return Placement(view.self_id)  # mm-balanced: the client spread its requests; load where it asked
        if is_large(remaining, req.size_units):
            remaining = pack(remaining, req.size_units)
        elif req.price_ceiling is not None and (under := under_ceiling(remaining, req.size_units, req.price_ceiling)):
            return Placement(under[rng.randrange(len(under))].instance_id)
        elif req.by_price and (priced := cheapest(remaining, req.size_units, rng))[1] is not None:
            choices, limit = priced
            return Placement(choices[rng.randrange(len(choices))].instance_id, limit)
        else:
            # Room is worth a pile-up only when it is plenty (an instance just started): an
            # instance a little under "full" (as most are, between evictions) would take every
            # load until its record caught up, and queue them (measured: added p99 +12-13 %).
            roomy = [i for i in remaining if i.free >= i.capacity // ROOMY_DIVISOR]
            remaining = roomy or remaining
    # Instance records lag loads by seconds, so a burst of cold misses sees one picture.
    # Among the near-best, favour those this instance has sent the fewest loads to lately
    # (its own placements, which it knows at once): each instance spreads its own burst,
    # and the random pick spreads the bursts of different instances.
    if req.recent_placements:
        fewest = min(req.recent_placements.get(i.instance_id, 0) for i in remaining)
        remaining = [i for i in remaining if req.recent_placements.get(i.instance_id, 0) == fewest]
    return Placement(remaining[rng.randrange(len(remaining))].instance_id)


class RecentPlacements:
    """The loads one instance placed in the last `RECENT_PLACEMENT_MS` (for `LoadRequest`)."""

    def __init__(self, window_ms: int = RECENT_PLACEMENT_MS) -> None:
        self.window_ms = window_ms
        self._placed: deque[tuple[int, str]] = deque()  # (ms, instance)

    def add(self, now_ms: int, instance_id: str) -> None:
        self._placed.append((now_ms, instance_id))

    def counts(self, now_ms: int) -> dict[str, int]:
        """Loads placed on each instance within the window before `now_ms`."""
        while self._placed and now_ms - self._placed[0][0] > self.window_ms:
            self._placed.popleft()
        counts: dict[str, int] = {}
        for _, iid in self._placed:
            counts[iid] = counts.get(iid, 0) + 1
        return counts
