"""Which existing copy of a model serves a request: upstream's ForwardingLB, local first.

Owns the cache-hit routing decision (`choose_copy`) and the "probably loaded by now"
horizon (`assume_loaded_ms`, learnt per model type by `AssumeLoaded`). Pure: plain mappings
in, an instance id out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from meshd.decisions.placement.view import ClusterView

# ModelMesh.initialize(): defaultAssumeLoadedAfterMs = max(3000, loadTimeoutMs / 3), then
# learnt per model type from this instance's load times (TimeStats; `LoadTimes` below).
MAX_ATTEMPTS = 8  # upstream's routing iterations per request (SPEC §6)
MAX_BUSY_RETRIES = 2  # upstream retries RESOURCE_EXHAUSTED at most twice, on other copies
ASSUME_LOADED_MIN_MS = 3_000
ASSUME_LOADED_TIMEOUT_DIVISOR = 3


def assume_loaded_ms(loading_timeout_ms: int) -> int:
    """How long after its load started a copy is assumed loaded: max(3 s, timeout/3)."""
    return max(ASSUME_LOADED_MIN_MS, loading_timeout_ms // ASSUME_LOADED_TIMEOUT_DIVISOR)


# Upstream's TimeStats: the horizon is set from the statistics at every 4th load; before the
# 4th, each load pulls the default a third of the way to the mean (a default far off is
# corrected early); few samples get a wider margin.
LEARN_EVERY = 4
FEW_LOADS = 20
SIGMAS_FEW = 5.0
SIGMAS_MANY = 3.0


@dataclass(frozen=True, slots=True)
class LoadTimes:
    """Load times seen for one model type (running mean and variance, Welford) and the
    "assume loaded" horizon learnt from them; `recorded` gives the next state."""

    assume_ms: int
    count: int = 0
    mean_ms: float = 0.0
    sq_dev: float = 0.0  # sum of squared deviations from the mean

    def recorded(self, took_ms: float) -> LoadTimes:
        count = self.count + 1
        delta = took_ms - self.mean_ms
        mean = self.mean_ms + delta / count
        sq_dev = self.sq_dev + delta * (took_ms - mean)
        if count % LEARN_EVERY == 0:
            sigmas = SIGMAS_FEW if count <= FEW_LOADS else SIGMAS_MANY
            assume = int(mean + sigmas * math.sqrt(sq_dev / count))
        elif count < LEARN_EVERY:
            assume = int((2 * self.assume_ms + mean) / 3)
        else:
            assume = self.assume_ms
        return LoadTimes(assume, count, mean, sq_dev)


class AssumeLoaded:
    """An instance's "assume loaded" horizon per model type, learnt from the loads that
    finished there (upstream keeps one TimeStats per type and instance, none shared)."""

    def __init__(self, default_ms: int) -> None:
        self.default_ms = default_ms
        self.types: dict[str, LoadTimes] = {}

    def record(self, model_type: str, took_ms: float) -> None:
        """A load of `model_type` finished here in `took_ms` (a failed load is not counted)."""
        self.types[model_type] = self.types.get(model_type, LoadTimes(self.default_ms)).recorded(took_ms)

    def ms(self, model_type: str) -> int:
        """How long after its load started a copy of `model_type` is assumed loaded."""
        times = self.types.get(model_type)
        return self.default_ms if times is None else times.assume_ms


def choose_copy(
    view: ClusterView,
    copies: Mapping[str, int],
    inflight: Mapping[str, int],
    exclude: AbstractSet[str],
    assume_loaded_ms: int,
    local_loaded: bool,
    balanced: bool,
) -> str | None:
    """The instance whose copy should serve, or None when there is no usable copy.

    `copies`: the model record's instance ids -> load start (ms); ids that are excluded or
    not live in `view` (other than this instance) are ignored. `inflight`: requests this
    instance has forwarded to each peer and not yet seen answered.

    1. A loaded local copy (`local_loaded`) serves, unless this instance is excluded: each
       peer hop costs about as much as the first (DESIGN.md "Measuring"). This holds even
       if the record does not list this instance yet.
    2. `balanced` (the client spread its requests itself): a local copy still loading
       serves when no other copy started loading earlier, i.e. none is further along;
       waiting here beats a hop to a copy that is no more ready.
    3. Otherwise, among the other copies whose load started more than `assume_loaded_ms`
       ago (probably loaded), the one with the fewest in-flight forwarded requests; ties go
       to the instance with the oldest LRU (least recently used), then the smallest id.
    4. If every copy is probably still loading, the one that started loading first
       (a tie prefers this instance, then the smallest id).
    Holders this instance found unreachable lately (`view.unreachable`) are skipped.
    """
    me = view.self_id
    if local_loaded and me not in exclude:
        return me
    unreachable = view.unreachable
    usable = {
        iid: started
        for iid, started in copies.items()
        if iid not in exclude and (iid == me or (view.live(iid) and iid not in unreachable))
    }
    if not usable and view.departed:
        # 5. No live copy: one on an instance whose record went moments ago (an etcd stall
        #    expires every lease at once) rather than a new copy (placement.liveness).
        usable = {iid: t for iid, t in copies.items() if iid in view.departed and iid not in exclude | unreachable}
    if not usable:
        return None
    if me in usable and balanced and usable[me] <= min(usable.values()):
        return me
    cutoff = view.now_ms - assume_loaded_ms
    # A local copy that is not loaded is known to be loading, whatever its start time says.
    ready = [iid for iid, started in usable.items() if started < cutoff and iid != me]
    if ready:
        return min(ready, key=lambda iid: (inflight.get(iid, 0), _lru(view, iid), iid))
    return min(usable, key=lambda iid: (usable[iid], iid != me, iid))


def _lru(view: ClusterView, instance_id: str) -> int:
    inst = view.get(instance_id)
    return inst.lru_time if inst is not None else 0
