"""The local cache decision: a size-weighted cache of models in 8 KiB units.

Pure: no I/O, no asyncio; time comes in as arguments (ms). The mechanism that owns the
runtime (`meshd.serving.local`) asks it what to admit and what to evict, then does the loads and
unloads. The simulator drives exactly this class.

Six eviction orders (`Eviction`), one switch:
- `LRU` (upstream's): by each entry's last-used time, which may be set "in
  the past" (a model registered without a recent use must not push out models in active use).
- `RATE` (meshd's; the daemon's default until 2026-11-30): an entry's value is its request rate x its load time
  per unit, the rate estimated from the cache's clock at its last 8 uses (the densest run of
  them that ends at the last use, with a prior of 2 uses over 8 turnovers, so a model used once
  or twice is not taken for a hot one), halved every 4 turnovers without a use. A steadily
  used model is judged by its rate over its last 8 uses, however long ago they began, rather
  than by how recently it was used; one that goes quiet still ages out. On one cache it misses
  less than LRFU on every simulator preset; in the fleet it loads less on four and as much on
  the fifth (docs/simulator.md).
- `CAPPED` (`rate-capped`, the daemon's default): RATE, its value weighed by the odds that the model's rate still
  holds after its silence. Rates end at random, at a hazard of one per `RATE_HOLD_TURNOVERS`
  turnovers; a Poisson process of rate r is silent for a span g with probability exp(-r g);
  so after a silence g the rate still holds with probability 1 / (1 + h g exp(r g)), h the
  hazard (in the cache's clock). A model in use at its rate keeps its value; a hot one that
  went quiet loses it within a few of its own intervals rather than some turnovers later; a
  cold one, whose silences are long anyway, is barely touched. `overruled` says how often its
  victim is not RATE's (the `meshd_eviction_odds_overruled` gauge). Within 0.1-0.5 points of
  RATE's hit ratio where popularity holds, above it where the hot set moves (docs/policies.md,
  "A capped rate"). Its order changes as silences lengthen, so it has no heap: the next victim is
  found by a scan, kept until the clock moves or an entry changes.
- `LRFU` (meshd's default before RATE): each use counts, and each count halves every time
  the cache has evicted twice its capacity (a clock that runs with the cache's turnover, not
  with wall time, so the memory fits a busy instance and a quiet one alike); an entry's value is
  its decayed uses x its load time per unit. It keeps what is used often *lately*, per unit of
  memory and second of reload: frequency for steady popularity, decay for popularity that
  moves (new models arriving hot, a ranking re-dealt). In the simulator's fleet (10-30 % capacity) it
  loads less than GDSF on every preset; with small caches of steady popularity it trails
  GDSF (0.4-1.5 points of hit ratio in the simulator at ~10 models per instance, 1-3 on one
  cache of 1-5 % of 10,000 equal models, 0.5-3.5 on a real mesh at 4) (docs/simulator.md).
  Keys are stored as logs at a common clock, so two entries keep their order while neither
  is used and a heap holds the order.
- `GDSF`: Greedy-Dual-Size-Frequency with the load time as the cost. An entry's
  priority is L + uses x load_ms / units, where L (the "inflation") is the priority of the
  last victim, so entries not used for a while age out. Its counts never decay while a copy
  is held, which costs it where popularity moves.
- `ADAPTIVE` (issue 44): RATE's order or recency's, whichever the fleet regrets less
  (`meshd.decisions.regret`): each eviction notes which order chose its victim, a reload of
  that model anywhere within a turnover charges that order, the fleet's tallies are summed
  from the instances' records, and every cache follows the order with the lower regret per
  eviction (recency once 20 % lower beyond a standard error); one admission in 200 evicts by
  the other order, to keep learning about it. While it follows recency its key is RATE's clock of the last use alone,
  so use histories keep being kept and a switch back loses nothing. `frequency_weight` says
  which (1 RATE, 0 recency; the `meshd_eviction_frequency_weight` gauge).
The counting orders keep the copies whose reloads would cost the most time per unit of
memory they hold, and, unlike LRU, do not let a model used once push out one used a hundred
times (the scan resistance that S3-FIFO and SIEVE get from quick demotion). Evicted models
leave a ghost (id and count, up to 4 per cached model), so a model that returns resumes it.
Their reload cost is smoothed: halfway between a load's own time and what the cache's fit of
load time against size expects (`LoadTimeFit`), since one load's time is noisy.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from meshd.core.records import newer_history
from meshd.decisions.gate import Gate
from meshd.decisions.regret import RATE, RECENCY, Regret

UNIT_BYTES = 8192  # upstream ModelMesh's 8 KiB cache unit (SPEC §6)
USE_SPELL_GAP_MS = 10_000  # uses further apart than upstream's rate-check interval are separate spells


def to_units(nbytes: int) -> int:
    """Whole 8 KiB units for `nbytes`, at least one (an entry always weighs something)."""
    return max(1, -(-nbytes // UNIT_BYTES))


class Eviction(enum.Enum):
    LRU = "lru"
    GDSF = "gdsf"
    LRFU = "lrfu"
    RATE = "rate"
    ADAPTIVE = "adaptive"
    CAPPED = "rate-capped"


GHOSTS_MIN = 64  # GDSF and LRFU remember at least this many evicted models' uses
GHOSTS_PER_ENTRY = 4  # ... and up to this many per cached model (the ghosts are small: an id and a count)
DEFAULT_LOAD_MS_PER_UNIT = 1.0  # GDSF cost of a copy whose load time is not known: its size
# LRFU: a use counts half once the cache has evicted this many times its capacity. Measured on
# the simulator's five presets (docs/simulator.md): longer memories win on steady popularity and
# lose badly where it moves (new models arriving hot); 2 loses least where either is wrong.
LRFU_HALF_LIFE_TURNOVERS = 2.0
# RATE: a copy's request rate from its last RATE_USES_KEPT uses, the densest recent run of them
# with a prior of RATE_PRIOR_USES uses over RATE_PRIOR_TURNOVERS turnovers (so one or two uses
# close together do not look hot), halved every RATE_HALF_LIFE_TURNOVERS turnovers without a use.
# The prior bounds a rate between 2 and 9 uses per 8 turnovers on purpose: it tells apart the
# models near the margin of the cache; hot ones, never near it, are ordered by recency and cost.
# Measured on the simulator's five presets (docs/simulator.md): fewer misses than LRFU on each on
# one cache; in the fleet fewer loads on four and level on the fifth (shifting); 8 turnovers
# instead of 4 miss less on one cache and load 1-3 % more in the fleet where popularity moves.
RATE_USES_KEPT = 8
RATE_PRIOR_USES = 2.0
RATE_PRIOR_TURNOVERS = 8.0
RATE_HALF_LIFE_TURNOVERS = 4.0
# CAPPED: a model's rate is taken to end at random, at a hazard of one per this many turnovers
# of the cache (its value is weighed by the odds the rate still holds after its silence).
# Swept over 16-128 on the peers replay and three presets (seed 1) and set at 64; checked on
# seeds 2-3 and the Azure windows (docs/policies.md, "A capped rate").
RATE_HOLD_TURNOVERS = 64.0
_LN2 = math.log(2)
_SCAN_SLACK = 1e-6  # CAPPED's scan skips an entry only this far above the least (float rounding)
OVERRULED_EVICTIONS = 64  # CAPPED's `overruled`: a moving average over about this many evictions
# MESHD_LATENCY_TARGET_MS (opt-in): a copy whose reload would take longer than the target is
# worth this many times its value to RATE and LRFU, so the misses that break the target are
# the ones avoided first. The trade-off (more loads of the fast-loading models) is in
# docs/policies.md, "A latency target".
LATENCY_TARGET_WEIGHT = 4.0
_LRFU_REBASE = 1 << 20  # half-lives of clock after which every clock is rebased (float precision)
# A copy's reload cost is its load time, and one load's time is noisy (storage, contention):
# once the fit below has LOAD_FIT_MIN_LOADS loads, the cost is the geometric mean of the load's
# own time and the time the fit expects for its size. Measured (docs/simulator.md): with load
# times jittered by a log-normal 0.25, using the load's own time cost the fleet 0.3-1.6 points
# of loads against upstream on every preset.
LOAD_FIT_MIN_LOADS = 8
# A load timed under this counts as this long: below it the time is the RPC's jitter (a first
# call's connection, a scheduler tick), not the model's, and a 1 ms against a 4 ms load would
# otherwise make one copy worth 4x another (seen: a cold copy kept over a hot one).
MIN_LOAD_COST_MS = 10.0
LOAD_FIT_MEMORY = 0.99  # each load's weight in the fit, per later load (about the last 100 loads)


class State(enum.Enum):
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"  # kept at weight 1 as a negative cache until evicted or expired


@dataclass(slots=True)
class CacheEntry:
    model_id: str
    units: int
    last_used_ms: int
    state: State = State.LOADING
    since_ms: int = 0  # when it entered its current state
    inflight: int = 0  # requests being served from this copy
    served: int = 0  # requests served from this copy (the scaler samples it for rates)
    prior_use_ms: int | None = None  # last use before the current spell of use
    gate: Gate | None = None  # the copy's concurrency limit, when the runtime asks for one
    uses: int = 1  # GDSF: uses since admission (the load's own request counts)
    load_ms: float = 0.0  # the reload cost: its load's time, smoothed by the cache's fit (0: unknown)
    measured_ms: float = 0.0  # how long its load took (0: unknown)
    priority: float = 0.0  # GDSF: L at last use + uses x cost per unit
    score: float = 1.0  # LRFU: uses, each halved per half-life of the cache's clock since; RATE: the rate
    clock: float = 0.0  # LRFU, RATE: the cache's clock (units evicted) at the last use
    uses_at: tuple[float, ...] = ()  # RATE: the clock at each of the last RATE_USES_KEPT uses
    seq: int = 0  # admission order (ties in the eviction order go to the earlier admitted)
    evicted_by: int = -1  # ADAPTIVE: the order that chose it as a victim (regret.RATE or RECENCY; -1: none)
    evicted_clock: float = 0.0  # the cache's clock once it was evicted


@dataclass(frozen=True, slots=True)
class Admission:
    admitted: bool
    evicted: tuple[CacheEntry, ...] = ()
    reason: str = ""
    retryable: bool = False  # room may appear once loads in progress finish


class WeightedLRU:
    """The cache; named for upstream's order, its default here (the daemon configures RATE by default)."""

    def __init__(self, capacity_units: int, eviction: Eviction = Eviction.LRU, latency_target_ms: float = 0.0) -> None:
        """`latency_target_ms` (RATE, LRFU, ADAPTIVE, CAPPED; 0: none): copies whose reload would take longer
        are worth `LATENCY_TARGET_WEIGHT` times as much (`MESHD_LATENCY_TARGET_MS`)."""
        if capacity_units < 1:
            raise ValueError("cache capacity must be at least one unit")
        if not latency_target_ms >= 0:
            raise ValueError("a latency target must be 0 (none) or more milliseconds")
        self.latency_target_ms = latency_target_ms
        self.capacity_units = capacity_units
        self.used_units = 0
        self.eviction = eviction
        self.inflation = 0.0  # GDSF's L: the priority of the last victim
        self.clock = 0.0  # LRFU's and RATE's clock: units of loaded copies evicted (since the last rebase)
        # In a fleet (`follow_fleet`): the clock counts the whole fleet's evictions per instance,
        # own ones at once and peers' as their records say, so values and use histories from
        # any instance are on one scale. 1: the cache's own turnover alone.
        self.fleet_size = 1
        self.evicted_units = 0  # units of loaded copies this cache has evicted, ever (its record says)
        # RATE's use histories and key, ADAPTIVE's and CAPPED's too
        self._rates = eviction in (Eviction.RATE, Eviction.ADAPTIVE, Eviction.CAPPED)
        turnovers = RATE_HALF_LIFE_TURNOVERS if self._rates else LRFU_HALF_LIFE_TURNOVERS
        self._half_life = turnovers * capacity_units
        self._prior_span = RATE_PRIOR_TURNOVERS * capacity_units
        self._hold_span = RATE_HOLD_TURNOVERS * capacity_units  # CAPPED: one over the hazard
        # CAPPED has no heap of its own order (it moves with the clock; its heap holds RATE's,
        # for `overruled`) but keeps each entry's RATE key and its next victim with the clock it
        # was found at, kept while no entry's key or state changes against it: placement asks
        # every instance for it on each miss (`victim_value`), and a scan per ask made the
        # 1M-request simulation 3x slower.
        self._rate_keys: dict[str, float] = {}
        # ... and, for the scan, each loaded entry's (RATE key, clock at its last use, rate, entry):
        # the scan reads tuples, not attributes and a dict per entry (40 % of its time).
        self._worth_parts: dict[str, tuple[float, float, float, CacheEntry]] = {}
        self._victim: tuple[float, CacheEntry, tuple[float, int, int]] | None = None
        self._last_victim: CacheEntry | None = None  # the last scan's, whatever became of it since
        self._failed = 0  # entries in State.FAILED (CAPPED's plan takes its next victim alone when none)
        # CAPPED: the share of its recent evictions (a moving average over about
        # `OVERRULED_EVICTIONS`) whose victim was not RATE's next one: copies the odds judged
        # gone quiet, which RATE alone would have kept (what it has learnt of the traffic: the
        # `meshd_eviction_odds_overruled` gauge). RATE's order is kept in the heap for it.
        self.overruled = 0.0 if eviction is Eviction.CAPPED else None
        self.load_fit = LoadTimeFit()
        self._loaded = 0  # entries in State.LOADED
        self._entries: dict[str, CacheEntry] = {}
        # Eviction order without a sort per admission: (order key, seq, id) pushed whenever an
        # entry's key changes; stale items (older keys, entries gone) are skipped when popped.
        self._heap: list[tuple[tuple[float, ...], int, str]] = []
        self._seq = 0
        # GDSF, LRFU and RATE: uses of recently evicted models (at most GHOSTS_MIN, or
        # GHOSTS_PER_ENTRY per cached model; LRFU's with the clock of their last use, RATE's the
        # clocks of its last uses), so a model that comes back resumes its count instead of
        # starting as a stranger.
        self._ghosts: dict[str, tuple[float, float, tuple[float, ...]]] = {}
        # ADAPTIVE: the order it follows (`frequency_weight`: 1 RATE's, 0 recency's) and its
        # part of the fleet's regret (None: another order).
        self.frequency_weight = 1.0
        self.regret = Regret() if eviction is Eviction.ADAPTIVE else None

    # ---- reads ---------------------------------------------------------------------
    def get(self, model_id: str) -> CacheEntry | None:
        return self._entries.get(model_id)

    def __contains__(self, model_id: str) -> bool:
        return model_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[CacheEntry]:
        return list(self._entries.values())

    @property
    def free_units(self) -> int:
        return self.capacity_units - self.used_units

    def lru_ms(self, now_ms: int) -> int:
        """The last-used time of the loaded entry evicted next (now when there are none).

        Under LRU that is the oldest last use; under GDSF it is the next victim's, which
        can be recent: placement reads this as the instance's cache age, and an instance
        whose oldest entry GDSF keeps on purpose must not look like the best place forever.
        """
        return self.loaded_summary(now_ms)[1]

    def loaded_summary(self, now_ms: int) -> tuple[int, int]:
        """(loaded copies, `lru_ms`) in one pass: an instance record needs both, each publish."""
        victim = self._next_victim()
        return self._loaded, now_ms if victim is None else victim.last_used_ms

    def victim_value(self) -> float | None:
        """RATE and LRFU: log2 of what the copy evicted next is worth now (its use score x reload
        cost per unit, decayed to the cache's clock); None under LRU and GDSF, whose orders have
        no such scale, and when nothing is loaded. On the fleet clock, instances' values compare:
        placement sends a load where it evicts the least (`rank.cheapest`). Exactly so between
        instances of one capacity; with mixed capacities each value decays on its own
        half-life (turnovers of its own capacity), a bias not measured."""
        if not self._rates and self.eviction is not Eviction.LRFU:
            return None
        victim = self._next_victim()
        if victim is None:
            return None
        if self._victim is not None:  # CAPPED: its worth, found with it
            return self._victim[2][0]
        return self._log_value(victim) + (victim.clock - self.clock) / self._half_life

    def _next_victim(self) -> CacheEntry | None:
        """The first loaded entry in eviction order (None: nothing loaded)."""
        if not self._loaded:
            return None
        if self.eviction is Eviction.CAPPED:
            if self._victim is None or self._victim[0] != self.clock:
                self._victim = self._scan_victim()
            return self._victim[1]
        return self._heap_top()

    def _scan_victim(self) -> tuple[float, CacheEntry, tuple[float, int, int]]:
        """CAPPED: (clock, the loaded entry of least `_worth_key`, that key): `_log_worth` inlined,
        to the same arithmetic, over `_worth_parts`, skipping an entry whose worth is surely above
        the least found so far (below). This scan is most of the order's cost (`bench/sim_speed.py`)."""
        clock = self.clock
        shift = clock / self._half_life
        span = self._hold_span
        log, log1p, exp = math.log, math.log1p, math.exp
        found: CacheEntry | None = None
        least = math.inf
        parts = self._worth_parts
        seed = self._last_victim  # most often the victim again: its worth first makes the bound bite
        if seed is not None and (row := parts.get(seed.model_id)) is not None and row[3] is seed:
            found, least = seed, self._log_worth(seed)
        for key, used_at, rate, e in parts.values():
            worth = key - shift
            silence = clock - used_at
            if silence > 0:
                # The odds' penalty is softplus(odds) / ln 2, odds = ln(u) + v with u = g / span and
                # v = r g; softplus(x) <= e^x = u e^v <= u / (1 - v) for v < 1, and <= ln 2 + max(x, 0)
                # with x <= u - 1 + v (ln y <= y - 1): an entry whose worth is above the least even
                # with that much penalty needs no log or exp.
                u = silence / span
                v = rate * silence
                most = u + v - 1.0
                most = _LN2 + most if most > 0 else _LN2
                if v < 1.0 and u < most * (1.0 - v):
                    most = u / (1.0 - v)
                if worth - most / _LN2 > least + _SCAN_SLACK:
                    continue
                odds = log(silence / span) + rate * silence
                if odds > 0:
                    worth = worth - (odds + log1p(exp(-odds))) / _LN2
                else:
                    worth = worth - log1p(exp(odds)) / _LN2
            if worth <= least and (
                worth < least or found is None or (e.last_used_ms, e.seq) < (found.last_used_ms, found.seq)
            ):
                found, least = e, worth
        assert found is not None  # called only with a loaded entry
        self._last_victim = found
        return (clock, found, (least, found.last_used_ms, found.seq))

    def _heap_top(self) -> CacheEntry | None:
        """The heap's top, past stale items (dropped here for good) and loads in progress
        (pushed back). No scan of every entry."""
        heap = self._heap
        kept: list[tuple[tuple[float, ...], int, str]] = []
        found: CacheEntry | None = None
        while heap and found is None:
            item = heapq.heappop(heap)
            entry = self._entries.get(item[2])
            if entry is None or entry.seq != item[1] or self._key(entry) != item[0]:
                continue
            kept.append(item)
            if entry.state is State.LOADED:
                found = entry
        for item in kept:
            heapq.heappush(heap, item)
        return found

    # ---- decisions -----------------------------------------------------------------
    def touch(self, model_id: str, now_ms: int, uses: int = 1) -> None:
        """`uses` requests of `model_id` at `now_ms` (several when counted in bulk: the native
        data plane's counters)."""
        entry = self._entries.get(model_id)
        if entry is None or uses < 1:
            return
        counted = self.eviction is not Eviction.LRU  # a use changes the key
        if self.eviction is Eviction.GDSF:
            entry.uses += uses
            entry.priority = self.inflation + entry.uses * _cost_per_unit(entry)
        elif self._rates:
            at = entry.uses_at
            if len(at) < RATE_USES_KEPT or at[0] != self.clock:  # else every use it keeps is now: no change
                self._record_uses(entry, at, uses)
        elif counted:
            entry.score = uses + self._decayed(entry.score, entry.clock)
            entry.clock = self.clock
        if entry.last_used_ms < now_ms:
            if now_ms - entry.last_used_ms > USE_SPELL_GAP_MS:
                entry.prior_use_ms = entry.last_used_ms  # a new spell of use begins
            entry.last_used_ms = now_ms
        elif not counted:
            return  # its key did not change
        self._push(entry)

    def admit(
        self,
        model_id: str,
        units: int,
        last_used_ms: int,
        now_ms: int,
        keep: frozenset[str] = frozenset(),
        history: Sequence[float] = (),
        evicted_by: tuple[int, float] | None = None,
    ) -> Admission:
        """Reserve `units` for a new LOADING entry, evicting least-recently-used ones (never
        those in `keep`: a LoRA adapter's base, which it loads into). `history` (RATE): the
        model's recent uses on the fleet clock as its record keeps them, where the last
        instance to evict it wrote them; the newer of it and this cache's own ghost counts.
        `evicted_by` (ADAPTIVE): the order that evicted it last and the fleet clock then, as its
        record notes them; that order is charged for this reload (`regret.Regret.reloaded`).

        Nothing changes when it is refused: too big for the whole cache, or only entries
        that are still loading (or used more recently than the newcomer) could make room.
        """
        if model_id in self._entries:
            return Admission(False, reason="already in the cache")
        if units > self.capacity_units:
            return Admission(False, reason=f"needs {units} units, the cache holds {self.capacity_units}")
        needed = units - self.free_units
        order = RATE if self.frequency_weight else RECENCY
        if self.regret is not None and needed > 0 and self.regret.explore():
            order = 1 - order  # this admission evicts by the order not followed
            self._reorder(order)
            victims = self._plan_eviction(needed, exclude=model_id, newer_than=last_used_ms, keep=keep)
            self._reorder(1 - order)
        else:
            victims = self._plan_eviction(needed, exclude=model_id, newer_than=last_used_ms, keep=keep)
        if victims is None:
            # Worth waiting only if loads in progress, once evictable, could make the room.
            loading = sum(e.units for e in self._entries.values() if e.state is State.LOADING)
            evictable = sum(
                e.units
                for e in self._entries.values()
                if e.state is not State.LOADING
                and e.last_used_ms <= last_used_ms
                and e.model_id != model_id
                and e.model_id not in keep
            )
            if loading + evictable >= needed:
                return Admission(False, reason="no room until loads in progress finish", retryable=True)
            return Admission(False, reason="no room: the cache is full of more recently used models")
        if self.regret is not None and evicted_by is not None:  # its age before it evicts anything
            self.regret.reloaded(evicted_by[0], (self.clock - evicted_by[1]) / self.capacity_units)
        for victim in victims:
            victim.evicted_by = order
            if self.overruled is not None and victim.state is State.LOADED:
                overruled = self._heap_top() is not victim
                self.overruled += (overruled - self.overruled) / OVERRULED_EVICTIONS
            self._evict(victim)
        self._seq += 1
        entry = CacheEntry(model_id, units, last_used_ms, State.LOADING, now_ms, seq=self._seq)
        ghost = self._ghosts.pop(model_id, None)
        if self._rates:
            self._record_uses(entry, self._resumed(ghost[2] if ghost is not None else (), history), 1)

        elif ghost is not None and self.eviction is Eviction.GDSF:
            entry.uses += int(ghost[0])
        elif ghost is not None:
            entry.score += self._decayed(ghost[0], ghost[1])
        entry.priority = self.inflation + entry.uses * _cost_per_unit(entry)
        entry.clock = self.clock
        self._entries[model_id] = entry
        self._push(entry)
        self.used_units += units
        return Admission(True, tuple(victims))

    def victims_for(self, model_id: str, units: int, last_used_ms: int) -> tuple[CacheEntry, ...] | None:
        """What `admit` would evict for the model now ((): nothing; None: it would be refused).
        Changes nothing: the load queue's pressure rule compares the model with these."""
        if model_id in self._entries or units > self.capacity_units:
            return None
        victims = self._plan_eviction(units - self.free_units, exclude=model_id, newer_than=last_used_ms)
        return None if victims is None else tuple(victims)

    def resize(self, model_id: str, units: int, keep: frozenset[str] = frozenset()) -> tuple[CacheEntry, ...]:
        """Correct an entry's weight (after load or `modelSize`); returns what that evicts
        (never those in `keep`).

        If the correction cannot be covered by evicting others, the cache runs over its
        capacity rather than drop a model that is already loaded (upstream does the same).
        """
        entry = self._entries.get(model_id)
        if entry is None or units == entry.units:
            return ()
        self.used_units += units - entry.units
        old_cost = _cost_per_unit(entry)
        entry.units = units
        if entry.measured_ms > 0:  # the fit's view of its load changes with its size
            entry.load_ms = self.load_fit.cost_ms(units, entry.measured_ms)
        _recost(entry, old_cost)
        self._push(entry)
        victims = self._plan_eviction(-self.free_units, exclude=model_id, newer_than=None, keep=keep) or []
        for victim in victims:
            victim.evicted_by = RATE if self.frequency_weight else RECENCY
            self._evict(victim)
        return tuple(victims)

    def set_state(self, model_id: str, state: State, now_ms: int, load_ms: float | None = None) -> None:
        """Move an entry to `state`; `load_ms`: how long its load took (GDSF's cost)."""
        entry = self._entries.get(model_id)
        if entry is None:
            return
        self._loaded += (state is State.LOADED) - (entry.state is State.LOADED)
        self._failed += (state is State.FAILED) - (entry.state is State.FAILED)
        entry.state = state
        entry.since_ms = now_ms
        if load_ms is not None and math.isfinite(load_ms) and load_ms > 0:
            load_ms = max(load_ms, MIN_LOAD_COST_MS)
            old_cost = _cost_per_unit(entry)
            entry.measured_ms = load_ms
            entry.load_ms = self.load_fit.smoothed_ms(entry.units, load_ms)
            _recost(entry, old_cost)
            self._push(entry)
        if self.eviction is Eviction.CAPPED:
            self._part(entry)
            self._offer(entry)
        if state is State.FAILED:
            self.resize(model_id, 1)

    def remove(self, model_id: str) -> CacheEntry | None:
        return self._drop(model_id)

    def _evict(self, victim: CacheEntry) -> None:
        if victim.state is State.LOADED:
            self.evicted_units += victim.units
            if self.regret is not None and victim.evicted_by >= 0:
                self.regret.evicted(victim.evicted_by, self.fleet_size)
        if self.eviction is not Eviction.LRU and victim.state is State.LOADED:
            ghosts = self._ghosts
            if self.eviction is Eviction.GDSF:
                self.inflation = max(self.inflation, victim.priority)
                ghosts[victim.model_id] = (victim.uses, 0.0, ())
            else:
                ghosts[victim.model_id] = (victim.score, victim.clock, victim.uses_at)
                self.clock += victim.units / self.fleet_size
            while len(ghosts) > max(GHOSTS_MIN, GHOSTS_PER_ENTRY * len(self._entries)):
                del ghosts[next(iter(ghosts))]  # the oldest ghost goes
        victim.evicted_clock = self.clock
        self._drop(victim.model_id)
        if self.clock > _LRFU_REBASE * self._half_life:
            self._rebase()

    def follow_fleet(self, fleet_size: int, advance: float, floor: float = 0.0) -> None:
        """The fleet clock's step (`meshd.decisions.fleet_clock.FleetClock.step`): `fleet_size`
        instances share it, peers evicted `advance` units per instance since the last step, and
        the clock is at least `floor` (a peer's clock, when this cache joins a running fleet)."""
        self.fleet_size = max(1, fleet_size)
        self.clock = max(self.clock, floor) + max(0.0, advance)

    def follow_order(self, order: int) -> None:
        """ADAPTIVE: evict by `order` (`regret.RATE` or `regret.RECENCY`) from now on, as the
        fleet's regret says (`regret.fleet_order`)."""
        if (1.0 if order == RATE else 0.0) != self.frequency_weight:
            self._reorder(order)

    def _reorder(self, order: int) -> None:
        """ADAPTIVE: the heap in `order`'s keys (`frequency_weight` as `follow_order` sets it)."""
        self.frequency_weight = 1.0 if order == RATE else 0.0
        self._heap = [(self._key(e), e.seq, e.model_id) for e in self._entries.values()]
        heapq.heapify(self._heap)

    def _resumed(self, ghost: tuple[float, ...], history: Sequence[float]) -> tuple[float, ...]:
        """RATE: the uses a returning model resumes from: its ghost here or the history its
        record carries, whichever saw it last; uses "after" this clock (a peer a little
        ahead) count as now."""
        if not newer_history(history, ghost):
            return ghost
        clock = self.clock
        return tuple(min(c, clock) for c in history[-RATE_USES_KEPT:])

    def _record_uses(self, entry: CacheEntry, before: tuple[float, ...], uses: int) -> None:
        """RATE: `uses` more uses now after those at `before`; the entry's rate and clock follow."""
        kept = (*before, *(self.clock,) * min(uses, RATE_USES_KEPT))[-RATE_USES_KEPT:]
        entry.uses_at = kept
        entry.score = use_rate(kept, self._prior_span)
        entry.clock = self.clock

    def _decayed(self, score: float, clock: float) -> float:
        """LRFU: `score`, counted at `clock`, as it is worth now."""
        return score * math.exp2((clock - self.clock) / self._half_life)

    def _rebase(self) -> None:
        """Restart LRFU's clock at 0 (keys stay in the same order: each moves by the same amount)."""
        shift = self.clock
        self.clock = 0.0
        for e in self._entries.values():
            e.clock -= shift
            e.uses_at = tuple(c - shift for c in e.uses_at)
        self._ghosts = {
            m: (score, clock - shift, tuple(c - shift for c in at)) for m, (score, clock, at) in self._ghosts.items()
        }
        if self.eviction is Eviction.CAPPED:  # its keys and next victim
            self._rate_keys = {m: self._key(e)[0] for m, e in self._entries.items()}
            self._worth_parts = {}
            for e in self._entries.values():
                self._part(e)
            self._victim = None
        self._heap = [(self._key(e), e.seq, e.model_id) for e in self._entries.values()]
        heapq.heapify(self._heap)

    def _drop(self, model_id: str) -> CacheEntry | None:
        entry = self._entries.pop(model_id, None)
        if entry is not None:
            self.used_units -= entry.units
            self._loaded -= entry.state is State.LOADED
            self._failed -= entry.state is State.FAILED
            if self.eviction is Eviction.CAPPED:
                del self._rate_keys[model_id]
                self._worth_parts.pop(model_id, None)
                if self._victim is not None and self._victim[1] is entry:
                    self._victim = None
        return entry

    def _plan_eviction(
        self, needed: int, exclude: str, newer_than: int | None, keep: frozenset[str] = frozenset()
    ) -> list[CacheEntry] | None:
        """Victims freeing at least `needed` units, first in eviction order; None if impossible.

        Loading entries are never victims. Idle copies go before copies serving requests.
        With `newer_than`, an entry used more recently than the newcomer is not evicted
        for it (the newcomer would be the next victim anyway, under LRU; under GDSF it
        protects models in use from a load placed for a model nobody asked for lately).
        """
        if needed <= 0:
            return []
        if self.eviction is Eviction.CAPPED:
            return self._plan_by_worth(needed, exclude, newer_than, keep)
        # Pop in eviction order; idle entries first, then (sorted) those serving requests.
        # Everything valid that was popped goes back: planning changes nothing.
        heap = self._heap
        popped: list[tuple[tuple[float, ...], int, str]] = []
        busy: list[tuple[tuple[float, ...], int, str]] = []
        victims: list[CacheEntry] = []
        seen: set[str] = set()
        freed = 0
        while heap and freed < needed:
            item = heapq.heappop(heap)
            entry = self._entries.get(item[2])
            if entry is None or entry.seq != item[1] or self._key(entry) != item[0] or item[2] in seen:
                continue  # stale (or a duplicate: a key can return to an earlier value)
            seen.add(item[2])
            popped.append(item)
            if entry.state is State.LOADING or entry.model_id == exclude or entry.model_id in keep:
                continue
            if entry.inflight > 0:
                busy.append(item)
                continue
            if newer_than is not None and entry.last_used_ms > newer_than:
                continue
            victims.append(entry)
            freed += entry.units
        for item in sorted(busy):
            if freed >= needed:
                break
            entry = self._entries[item[2]]
            if newer_than is not None and entry.last_used_ms > newer_than:
                continue
            victims.append(entry)
            freed += entry.units
        for item in popped:
            heapq.heappush(heap, item)
        return victims if freed >= needed else None

    def _plan_by_worth(
        self, needed: int, exclude: str, newer_than: int | None, keep: frozenset[str]
    ) -> list[CacheEntry] | None:
        """CAPPED's `_plan_eviction`: the same rules, over every entry sorted by its worth now."""
        victim = self._next_victim()
        if (  # the usual case, without a sort: the next victim alone makes the room
            victim is not None
            and not self._failed
            and victim.units >= needed
            and victim.inflight == 0
            and victim.model_id != exclude
            and victim.model_id not in keep
            and (newer_than is None or victim.last_used_ms <= newer_than)
        ):
            return [victim]
        # `_worth_key` inlined, to the same arithmetic; a heap, as a few victims are taken at most
        clock = self.clock
        shift = clock / self._half_life
        span = self._hold_span
        keys = self._rate_keys
        log, log1p, exp = math.log, math.log1p, math.exp
        ranked: list[tuple[bool, float, int, int, CacheEntry]] = []
        for e in self._entries.values():
            if e.state is State.LOADING or e.model_id == exclude or e.model_id in keep:
                continue
            worth = keys[e.model_id] - shift
            silence = clock - e.clock
            if silence > 0:
                odds = log(silence / span) + e.score * silence
                if odds > 0:
                    worth = worth - (odds + log1p(exp(-odds))) / _LN2
                else:
                    worth = worth - log1p(exp(odds)) / _LN2
            ranked.append((e.inflight > 0, worth, e.last_used_ms, e.seq, e))  # seq is unique: no entry compared
        heapq.heapify(ranked)
        victims: list[CacheEntry] = []
        freed = 0
        while ranked and freed < needed:
            entry = heapq.heappop(ranked)[4]
            if newer_than is not None and entry.last_used_ms > newer_than:
                continue
            victims.append(entry)
            freed += entry.units
        return victims if freed >= needed else None

    def _worth_key(self, entry: CacheEntry) -> tuple[float, int, int]:
        return (self._log_worth(entry), entry.last_used_ms, entry.seq)

    def _log_worth(self, entry: CacheEntry) -> float:
        """CAPPED: log2 of what the entry is worth now: RATE's value decayed to the cache's
        clock, times the probability that its rate r still holds after its silence g,
        1 / (1 + h g exp(r g)) with h one over `RATE_HOLD_TURNOVERS` turnovers."""
        decayed = self._rate_keys[entry.model_id] - self.clock / self._half_life
        silence = self.clock - entry.clock
        if silence <= 0:
            return decayed
        # log of the odds that the rate ended: ln(h g) + r g; its softplus is -ln P(holds)
        odds = math.log(silence / self._hold_span) + entry.score * silence
        ended = odds + math.log1p(math.exp(-odds)) if odds > 0 else math.log1p(math.exp(odds))
        return decayed - ended / _LN2

    def _key(self, entry: CacheEntry) -> tuple[float, ...]:
        if self.eviction is Eviction.GDSF:
            return (entry.priority, entry.last_used_ms)
        if self.eviction in (Eviction.LRFU, Eviction.RATE, Eviction.CAPPED):
            # score x cost per unit, decayed to a common clock; in logs, so the order of two
            # entries does not change while neither is used (both decay at the same rate).
            return (self._log_value(entry) + entry.clock / self._half_life, entry.last_used_ms)
        if self.eviction is Eviction.ADAPTIVE:  # the same, its worth weighed by the learnt weight
            if self.frequency_weight:
                return (self._log_value(entry) + entry.clock / self._half_life, entry.last_used_ms)
            return (entry.clock / self._half_life, entry.last_used_ms)
        return (entry.last_used_ms,)

    def _log_value(self, entry: CacheEntry, score: float | None = None) -> float:
        """RATE, LRFU, ADAPTIVE, CAPPED: log2 of the entry's score (or `score`) x reload cost
        per unit, at its last use."""
        value = (entry.score if score is None else score) * _cost_per_unit(entry)
        if self.latency_target_ms and entry.load_ms > self.latency_target_ms:
            value *= LATENCY_TARGET_WEIGHT  # its reload would break the target
        return math.log2(value)

    def _push(self, entry: CacheEntry) -> None:
        key = self._key(entry)
        if self.eviction is Eviction.CAPPED:  # its order changes as silences lengthen: no heap of it
            self._rate_keys[entry.model_id] = key[0]
            self._part(entry)
            self._offer(entry)  # (the heap below holds RATE's order, for `overruled`)
        heapq.heappush(self._heap, (key, entry.seq, entry.model_id))
        if len(self._heap) > 4 * len(self._entries) + 64:  # drop the stale items now and then
            self._heap = [(self._key(e), e.seq, e.model_id) for e in self._entries.values()]
            heapq.heapify(self._heap)

    def _part(self, entry: CacheEntry) -> None:
        """CAPPED: `entry`'s row of `_worth_parts` (none unless loaded), after its key or state changed."""
        if entry.state is State.LOADED:
            self._worth_parts[entry.model_id] = (self._rate_keys[entry.model_id], entry.clock, entry.score, entry)
        else:
            self._worth_parts.pop(entry.model_id, None)

    def _offer(self, entry: CacheEntry) -> None:
        """CAPPED: `entry`'s key or state changed; the next victim found at this clock still
        stands unless it was this entry (found again when asked) or this one is now worth less."""
        found = self._victim
        if found is None or found[0] != self.clock:
            return
        if found[1] is entry:
            self._victim = None
        elif entry.state is State.LOADED:
            key = self._worth_key(entry)
            if key < found[2]:
                self._victim = (self.clock, entry, key)


def use_rate(uses_at: Sequence[float], prior_span: float, prior_uses: float = RATE_PRIOR_USES) -> float:
    """RATE: uses per unit of clock from the clocks of the last uses (oldest first): the densest
    run that ends at the last use, each run counted with `prior_uses` more uses over `prior_span`
    more clock (a model seen once is worth the prior; a new burst outweighs a sparse past)."""
    best = prior_uses / prior_span
    if not uses_at:
        return best
    last = uses_at[-1]
    n = len(uses_at)
    for j in range(n - 1):
        rate = (n - 1 - j + prior_uses) / (last - uses_at[j] + prior_span)
        if rate > best:
            best = rate
    return best


class LoadTimeFit:
    """Load time against size over an instance's recent loads (least squares, older loads
    weighing less): what a model of a size is expected to take to load."""

    def __init__(self, memory: float = LOAD_FIT_MEMORY, min_loads: int = LOAD_FIT_MIN_LOADS) -> None:
        self.memory = memory
        self.min_loads = min_loads
        self.loads = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, units: int, load_ms: float) -> None:
        m = self.memory
        self.loads += 1
        self._w = self._w * m + 1.0
        self._x = self._x * m + units
        self._y = self._y * m + load_ms
        self._xx = self._xx * m + units * units
        self._xy = self._xy * m + units * load_ms

    def expected_ms(self, units: int) -> float | None:
        """The fit's load time for `units` (None until it has `min_loads` loads). Never below a
        tenth of the mean load time: a fit is not trusted far outside what it saw."""
        if self.loads < self.min_loads:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        slope = max(0.0, (self._xy / self._w - mean_x * mean_y) / var) if var > 1e-9 * (1.0 + mean_x * mean_x) else 0.0
        return max(mean_y / 10, mean_y + slope * (units - mean_x))

    def cost_ms(self, units: int, load_ms: float) -> float:
        """A load's cost: halfway (geometric) between its own time and the fit's, the fit's
        held within 4x of the load's own (so the cost stays within 2x of what was measured)."""
        expected = self.expected_ms(units)
        if expected is None or not expected > 0:
            return load_ms
        return math.sqrt(load_ms * min(max(expected, load_ms / 4), load_ms * 4))

    def smoothed_ms(self, units: int, load_ms: float) -> float:
        """`cost_ms`, then the load is learnt."""
        cost = self.cost_ms(units, load_ms)
        self.add(units, load_ms)
        return cost


def _recost(entry: CacheEntry, old_cost: float) -> None:
    """A better known size or load time changes the cost of the uses already counted; the
    inflation part of the priority stays that of the entry's last use (re-basing on today's
    L would age it without a use)."""
    entry.priority += entry.uses * (_cost_per_unit(entry) - old_cost)


def _cost_per_unit(entry: CacheEntry) -> float:
    return entry.load_ms / entry.units if entry.load_ms > 0 else DEFAULT_LOAD_MS_PER_UNIT


POPULARITY_WINDOW = 10_000  # uses counted before every count is halved (TinyLFU's reset)


class Popularity:
    """Recent use counts per model, aged by halving every `window` uses (TinyLFU's reset):
    what the load queue's value and its admission under pressure read as "how hot"."""

    def __init__(self, window: int = POPULARITY_WINDOW) -> None:
        if window < 1:
            raise ValueError("the popularity window must be at least one use")
        self.window = window
        self._counts: dict[str, float] = {}
        self._since_reset = 0

    def count(self, model_id: str, uses: int = 1) -> None:
        """`uses` requests for `model_id` (more than one: counted elsewhere, told in a batch)."""
        self._counts[model_id] = self._counts.get(model_id, 0.0) + uses
        self._since_reset += uses
        while self._since_reset >= self.window:  # a batch may span windows: one halving each
            self._since_reset -= self.window
            self._counts = {k: v / 2 for k, v in self._counts.items() if v >= 1.0}

    def of(self, model_id: str) -> float:
        return self._counts.get(model_id, 0.0)


def adapter_slot_victim(
    base: str, bases: Mapping[str, str], entry: Callable[[str], CacheEntry | None]
) -> CacheEntry | None:
    """Which LoRA adapter of `base` gives up its engine slot when they are all taken: the
    loaded one used longest ago (None: none loaded). `bases`: adapter -> its base model."""
    loaded = [e for e in (entry(a) for a, b in bases.items() if b == base) if e is not None and e.state is State.LOADED]
    return min(loaded, key=lambda e: e.last_used_ms) if loaded else None
