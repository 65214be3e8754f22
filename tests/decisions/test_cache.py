"""The weighted LRU decision (pure)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from meshd.decisions.cache import UNIT_BYTES, State, WeightedLRU, to_units


def loaded(cache: WeightedLRU, model_id: str, units: int, last_used: int) -> None:
    assert cache.admit(model_id, units, last_used, last_used).admitted
    cache.set_state(model_id, State.LOADED, last_used)


def test_units_round_up_and_never_zero() -> None:
    assert to_units(0) == 1
    assert to_units(1) == 1
    assert to_units(UNIT_BYTES) == 1
    assert to_units(UNIT_BYTES + 1) == 2


def test_admit_evicts_least_recently_used_until_it_fits() -> None:
    cache = WeightedLRU(10)
    loaded(cache, "a", 4, 100)
    loaded(cache, "b", 4, 200)
    cache.touch("a", 300)  # b is now the LRU
    adm = cache.admit("c", 4, 400, 400)
    assert adm.admitted
    assert [e.model_id for e in adm.evicted] == ["b"]
    assert cache.used_units == 8
    assert "b" not in cache


def test_weight_matters_several_small_go_for_one_big() -> None:
    cache = WeightedLRU(10)
    for i, name in enumerate("abcde"):
        loaded(cache, name, 2, 100 + i)
    adm = cache.admit("big", 5, 500, 500)
    assert [e.model_id for e in adm.evicted] == ["a", "b", "c"]
    assert cache.used_units == 4 + 5


def test_loading_entries_are_never_victims_and_refusal_changes_nothing() -> None:
    cache = WeightedLRU(8)
    assert cache.admit("a", 4, 100, 100).admitted
    assert cache.admit("b", 4, 100, 100).admitted
    adm = cache.admit("c", 4, 500, 500)
    assert not adm.admitted and adm.retryable
    assert cache.used_units == 8 and len(cache) == 2


def test_too_big_for_the_whole_cache_is_refused_for_good() -> None:
    cache = WeightedLRU(4)
    adm = cache.admit("huge", 5, 0, 0)
    assert not adm.admitted and not adm.retryable


def test_an_older_newcomer_does_not_push_out_newer_models() -> None:
    cache = WeightedLRU(4)
    loaded(cache, "recent", 4, 1000)
    assert not cache.admit("old", 4, 10, 2000).admitted
    assert "recent" in cache


def test_idle_copies_go_before_copies_serving_requests() -> None:
    cache = WeightedLRU(8)
    loaded(cache, "busy", 4, 100)
    loaded(cache, "idle", 4, 200)
    cache.get("busy").inflight = 1  # type: ignore[union-attr]
    adm = cache.admit("new", 4, 300, 300)
    assert [e.model_id for e in adm.evicted] == ["idle"]


def test_resize_after_load_evicts_others_or_overcommits() -> None:
    cache = WeightedLRU(10)
    loaded(cache, "a", 3, 100)
    assert cache.admit("b", 3, 200, 200).admitted
    assert cache.resize("b", 7) == ()  # 3 + 7 still fits in 10
    assert [e.model_id for e in cache.resize("b", 8)] == ["a"]
    assert cache.used_units == 8
    # Nothing left to evict: the loaded model stays, over capacity.
    assert cache.resize("b", 12) == ()
    assert cache.used_units == 12 and cache.free_units == -2


def test_failed_entries_weigh_one_unit_and_are_evictable() -> None:
    cache = WeightedLRU(4)
    assert cache.admit("bad", 4, 100, 100).admitted
    cache.set_state("bad", State.FAILED, 150)
    assert cache.used_units == 1
    adm = cache.admit("good", 4, 200, 200)
    assert [e.model_id for e in adm.evicted] == ["bad"]


def test_lru_time_is_the_oldest_loaded_use() -> None:
    cache = WeightedLRU(10)
    assert cache.lru_ms(999) == 999
    loaded(cache, "a", 1, 300)
    loaded(cache, "b", 1, 200)
    assert cache.lru_ms(999) == 200


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        WeightedLRU(0)


def test_gdsf_keeps_a_frequent_model_over_a_newer_one_and_reports_the_next_victim_as_lru() -> None:
    from meshd.decisions.cache import Eviction

    cache = WeightedLRU(2, Eviction.GDSF)
    loaded(cache, "old", 1, 100)
    for t in range(101, 105):
        cache.touch("old", t)  # used often, long ago
    loaded(cache, "once", 1, 200)
    assert cache.lru_ms(300) == 200  # placement's cache age: the next victim's last use
    adm = cache.admit("new", 1, 300, 300)
    assert [e.model_id for e in adm.evicted] == ["once"]  # LRU would have evicted "old"


def test_victims_for_plans_without_changing_anything() -> None:
    cache = WeightedLRU(10)
    loaded(cache, "a", 4, 100)
    loaded(cache, "b", 4, 200)
    victims = cache.victims_for("c", 4, 300)
    assert victims is not None and [v.model_id for v in victims] == ["a"]
    assert "a" in cache and cache.used_units == 8
    assert cache.victims_for("c", 2, 300) == ()  # it fits
    assert cache.victims_for("c", 4, 50) is None  # only newer models to evict
    assert cache.victims_for("a", 1, 300) is None  # already held


def test_popularity_counts_uses_and_halves_them_every_window() -> None:
    from meshd.decisions.cache import Popularity

    pop = Popularity(window=4)
    for m in ("a", "a", "a"):
        pop.count(m)
    assert pop.of("a") == 3.0 and pop.of("b") == 0.0
    pop.count("b")  # the fourth use: everything halves
    assert pop.of("a") == 1.5 and pop.of("b") == 0.5


def test_popularity_counts_a_batch_of_uses_and_halves_once_per_window_it_spans() -> None:
    """The native data plane tells its arrivals in batches (a poll of HAProxy's table)."""
    from meshd.decisions.cache import Popularity

    pop = Popularity(window=4)
    pop.count("a", 3)
    assert pop.of("a") == 3.0
    pop.count("b", 6)  # 9 uses: two windows end (at the 4th and the 8th), one use past them
    assert pop.of("a") == 0.75 and pop.of("b") == 1.5
    pop.count("b", 3)  # the 12th use: a third halving
    assert pop.of("b") == 2.25 and pop.of("a") == 0.0


def test_lrfu_keeps_a_frequent_model_until_its_uses_decay() -> None:
    """Four uses outweigh one newcomer's use until the cache's clock has run two half-lives."""
    from meshd.decisions.cache import LRFU_HALF_LIFE_TURNOVERS, Eviction

    cache = WeightedLRU(4, Eviction.LRFU)  # a half-life of 2 x 4 = 8 units evicted
    loaded(cache, "hot", 1, 100)
    for t in range(101, 104):
        cache.touch("hot", t)
    for i, t in enumerate((200, 201, 202)):
        loaded(cache, f"once{i}", 1, t)
    evicted_at: int | None = None
    for n in range(1, 40):
        adm = cache.admit(f"new{n}", 1, 300 + n, 300 + n)
        cache.set_state(f"new{n}", State.LOADED, 300 + n)
        if "hot" in [e.model_id for e in adm.evicted]:
            evicted_at = n
            break
    # LRU would have let it go at once; LRFU when the oldest of the three newcomers held was
    # admitted after two half-lives of clock: 4 uses x 2^-2 = that newcomer's one use.
    half_life = LRFU_HALF_LIFE_TURNOVERS * 4
    assert evicted_at == 2 * half_life + 3


def test_lrfu_lets_the_cheaper_reload_go_first() -> None:
    from meshd.decisions.cache import Eviction

    cache = WeightedLRU(3, Eviction.LRFU)
    for mid, t, load_ms in (("slow", 100, 900.0), ("fast", 101, 100.0)):
        assert cache.admit(mid, 1, t, t).admitted
        cache.set_state(mid, State.LOADED, t, load_ms)
    loaded(cache, "x", 1, 102)
    adm = cache.admit("y", 2, 200, 200)
    assert [e.model_id for e in adm.evicted][:1] == ["x"]  # unknown load time: cost 1 per unit
    assert "fast" in [e.model_id for e in adm.evicted] and "slow" in cache


def test_lrfu_a_model_that_returns_resumes_its_decayed_uses() -> None:
    from meshd.decisions.cache import Eviction

    cache = WeightedLRU(2, Eviction.LRFU)
    loaded(cache, "a", 1, 100)
    for t in range(101, 108):
        cache.touch("a", t)  # 8 uses
    loaded(cache, "b", 1, 110)
    cache.remove("b")
    loaded(cache, "c", 1, 120)
    loaded(cache, "d", 1, 121)  # evicts c (1 use) before a
    assert "a" in cache and "c" not in cache
    loaded(cache, "c", 1, 130)  # c's ghost: 1 use, decayed by one unit of clock
    entry = cache.get("c")
    assert entry is not None and 1.0 < entry.score < 2.0


@pytest.mark.parametrize("order", ["lrfu", "rate"])
def test_lrfu_restarting_the_clock_keeps_the_order(monkeypatch: pytest.MonkeyPatch, order: str) -> None:
    """LRFU and RATE keep the same clock; restarting it after every half-life changes no victim."""
    import meshd.decisions.cache as cache_module
    from meshd.decisions.cache import Eviction

    def victims(rebase_every: int) -> list[str]:
        monkeypatch.setattr(cache_module, "_LRFU_REBASE", rebase_every)
        cache = WeightedLRU(6, Eviction(order))
        out: list[str] = []
        evicted = 0
        for n in range(400):
            mid = f"m{n % 9}"
            if mid in cache:
                cache.touch(mid, n)
                continue
            adm = cache.admit(mid, 1 + n % 2, n, n)
            assert adm.admitted
            cache.set_state(mid, State.LOADED, n, 100.0 + 37 * (n % 5))
            out += [e.model_id for e in adm.evicted]
            evicted += sum(e.units for e in adm.evicted)
        if rebase_every == 1:
            assert cache.clock < evicted  # the clock did restart
        return out

    assert victims(1) == victims(1 << 20)


def test_load_time_fit_learns_time_against_size() -> None:
    from meshd.decisions.cache import LoadTimeFit

    fit = LoadTimeFit(min_loads=4)
    for units in (10, 20, 30):
        fit.add(units, 500.0 + 2.0 * units)
    assert fit.expected_ms(25) is None  # too few loads to trust
    fit.add(40, 580.0)
    expected = fit.expected_ms(25)
    assert expected is not None and abs(expected - 550.0) < 1e-6
    assert abs((fit.expected_ms(1000) or 0.0) - 2500.0) < 1e-6  # the line, outside what it saw too


def test_load_time_fit_without_a_size_trend_expects_the_mean_and_never_a_tiny_time() -> None:
    from meshd.decisions.cache import LoadTimeFit

    same = LoadTimeFit(memory=1.0, min_loads=2)  # every load weighs the same here
    for ms in (100.0, 300.0):
        same.add(8, ms)  # one size: no slope to fit
    assert same.expected_ms(8) == same.expected_ms(800) == 200.0
    falling = LoadTimeFit(memory=1.0, min_loads=2)
    falling.add(1, 1000.0)
    falling.add(100, 10.0)  # bigger loaded faster: not a law to extrapolate, the slope stays 0
    assert falling.expected_ms(10_000) == falling.expected_ms(1) == 505.0
    rising = LoadTimeFit(memory=1.0, min_loads=2)
    rising.add(100, 100.0)
    rising.add(200, 1000.0)
    assert rising.expected_ms(1) == 55.0  # the line gives less than nothing: a tenth of the mean


def test_a_loads_cost_is_halfway_between_its_own_time_and_the_fit() -> None:
    """One slow load (a busy disk) must not make a model look twice as costly to reload."""
    from meshd.decisions.cache import LOAD_FIT_MIN_LOADS, Eviction

    cache = WeightedLRU(100, Eviction.LRFU)
    for n in range(LOAD_FIT_MIN_LOADS):
        loaded(cache, f"m{n}", 1, n)
        cache.set_state(f"m{n}", State.LOADED, n, 400.0)  # the first ones: their own times
        assert cache.get(f"m{n}").load_ms == 400.0  # type: ignore[union-attr]
    loaded(cache, "slow", 1, 50)
    cache.set_state("slow", State.LOADED, 50, 1600.0)
    assert cache.get("slow").load_ms == 800.0  # type: ignore[union-attr]  # sqrt(1600 x 400)


def test_use_rate_takes_the_densest_recent_run_over_a_prior() -> None:
    from meshd.decisions.cache import use_rate

    assert use_rate((), 8.0) == use_rate((5.0,), 8.0) == 2.0 / 8.0  # a stranger, and a model seen once
    # Three uses close together after a sparse past: the recent run counts, not the whole history.
    assert use_rate((0.0, 100.0, 200.0, 201.0, 202.0), 8.0) == (2 + 2.0) / (2.0 + 8.0)
    # A steady rate: the whole run (the prior weighs less the longer it is) ...
    assert use_rate((0.0, 10.0, 20.0, 30.0), 100.0) == (3 + 2.0) / (30.0 + 100.0)
    # ... and never less than the prior: rarer uses than it are not told apart by rate.
    assert use_rate((0.0, 10.0, 20.0, 30.0), 8.0) == 2.0 / 8.0


def test_rate_keeps_a_steady_model_over_a_newcomer_and_a_returning_one_resumes() -> None:
    from meshd.decisions.cache import RATE_USES_KEPT, Eviction

    cache = WeightedLRU(2, Eviction.RATE)
    loaded(cache, "steady", 1, 100)
    for t in range(101, 120):
        cache.touch("steady", t)  # more uses than it keeps: only the last RATE_USES_KEPT count
    steady = cache.get("steady")
    assert steady is not None and len(steady.uses_at) == RATE_USES_KEPT
    loaded(cache, "once", 1, 130)
    adm = cache.admit("new", 1, 140, 140)
    assert [e.model_id for e in adm.evicted] == ["once"]  # one use is worth the prior only
    cache.set_state("new", State.LOADED, 140)
    for t in (141, 142):
        cache.touch("new", t)  # three uses of "new", at the clock of one eviction
    adm = cache.admit("once", 1, 150, 150)  # back: its ghost's use, and this one
    once = cache.get("once")
    assert once is not None and len(once.uses_at) == 2
    assert [e.model_id for e in adm.evicted] == ["new"]  # 3 uses at once < 8 kept, decayed less


def test_the_fit_never_moves_a_loads_cost_more_than_twice_from_its_own_time() -> None:
    from meshd.decisions.cache import LoadTimeFit

    fit = LoadTimeFit(memory=1.0, min_loads=2)
    fit.add(10, 100.0)
    fit.add(11, 200.0)  # a steep line over sizes close together
    assert fit.expected_ms(1000) == 100.0 + 100.0 * 990  # what the line says, far outside
    assert fit.cost_ms(1000, 1000.0) == 2000.0  # held within 4x: the cost within 2x of 1,000 ms
    assert fit.cost_ms(10, 100.0) == 100.0  # on the line: its own time


def test_a_load_time_that_is_not_a_time_is_ignored() -> None:
    from meshd.decisions.cache import Eviction

    cache = WeightedLRU(10, Eviction.RATE)
    for bad in (float("inf"), float("nan"), 0.0, -5.0):
        loaded(cache, "m", 1, 1)
        cache.set_state("m", State.LOADED, 1, bad)
        entry = cache.get("m")
        assert entry is not None and entry.load_ms == 0.0 and entry.measured_ms == 0.0
        cache.remove("m")
    assert cache.load_fit.loads == 0  # nothing learnt from them


def test_a_size_learnt_after_the_load_recomputes_the_cost_from_the_measured_time() -> None:
    from meshd.decisions.cache import LOAD_FIT_MIN_LOADS, Eviction

    cache = WeightedLRU(1000, Eviction.LRFU)
    for n in range(LOAD_FIT_MIN_LOADS):
        units = 10 + n
        loaded(cache, f"m{n}", units, n)
        cache.set_state(f"m{n}", State.LOADED, n, 100.0 + 30.0 * units)  # 30 ms a unit, 100 to start
    loaded(cache, "late", 10, 50)  # loaded at the default size (the fit expects 400 ms) ...
    cache.set_state("late", State.LOADED, 50, 400.0)
    assert cache.get("late").load_ms == pytest.approx(400.0)  # type: ignore[union-attr]
    cache.resize("late", 40)  # ... its real size known later: the fit expects 1,300 ms for it
    entry = cache.get("late")
    assert entry is not None and entry.measured_ms == 400.0
    assert entry.load_ms == pytest.approx(math.sqrt(400.0 * 1300.0), rel=1e-3)


def test_no_use_is_no_use() -> None:
    from meshd.decisions.cache import Eviction

    for order in (Eviction.LRFU, Eviction.RATE, Eviction.GDSF):
        cache = WeightedLRU(4, order)
        loaded(cache, "x", 1, 1)
        loaded(cache, "a", 1, 2)
        loaded(cache, "b", 2, 3)
        for t in range(4, 10):
            cache.touch("x", t)  # x is worth keeping
        loaded(cache, "c", 3, 10)  # evicts a and b: the clock moves on past x's last use
        before = cache.get("x")
        assert before is not None and "a" not in cache and "b" not in cache
        if order is not Eviction.GDSF:
            assert cache.clock > before.clock  # so a use now would move x's clock
        snapshot = (before.score, before.clock, before.uses_at, before.uses, before.last_used_ms)
        cache.touch("x", 10, uses=0)
        assert (before.score, before.clock, before.uses_at, before.uses, before.last_used_ms) == snapshot


def test_what_admission_must_keep_is_never_evicted() -> None:
    """A LoRA adapter's base stays while room is made for the adapter (it loads into it)."""
    cache = WeightedLRU(10)
    loaded(cache, "base", 6, 100)  # the oldest: the first victim otherwise
    loaded(cache, "other", 3, 200)
    admission = cache.admit("adapter", 3, 300, 300, keep=frozenset({"base"}))
    assert admission.admitted and [v.model_id for v in admission.evicted] == ["other"]
    assert cache.get("base") is not None
    # Only what must be kept could make room: refused, nothing changed.
    refused = cache.admit("big", 5, 400, 400, keep=frozenset({"base"}))
    assert not refused.admitted and cache.get("base") is not None
    assert [v.model_id for v in cache.resize("adapter", 4, keep=frozenset({"base"}))] == []


def test_an_adapter_slot_goes_to_the_loaded_adapter_of_that_base_used_longest_ago() -> None:
    from meshd.decisions.cache import adapter_slot_victim

    cache = WeightedLRU(20)
    loaded(cache, "a1", 1, 300)
    loaded(cache, "a2", 1, 100)  # the oldest of base b
    loaded(cache, "c1", 1, 50)  # older, but another base's
    cache.admit("a3", 1, 10, 10)  # still loading: holds no slot to give
    bases = {"a1": "b", "a2": "b", "a3": "b", "c1": "other"}
    victim = adapter_slot_victim("b", bases, cache.get)
    assert victim is not None and victim.model_id == "a2"
    assert adapter_slot_victim("nobody", bases, cache.get) is None


@pytest.mark.parametrize(("target_ms", "evicted"), [(0.0, "slow"), (1000.0, "quick")])
def test_a_latency_target_keeps_the_copy_whose_reload_would_break_it(target_ms: float, evicted: str) -> None:
    """Without a target, a copy used 2.5 times as often but half as slow to reload is worth
    more; with a 1 s target the one whose reload takes 1.2 s is kept (MESHD_LATENCY_TARGET_MS)."""
    from meshd.decisions.cache import Eviction

    cache = WeightedLRU(2, Eviction.RATE, latency_target_ms=target_ms)
    for name, load_ms in (("slow", 1200.0), ("quick", 600.0)):
        assert cache.admit(name, 1, 10, 10).admitted
        cache.set_state(name, State.LOADED, 10, load_ms)
    for _ in range(3):
        cache.touch("quick", 11)
    assert [e.model_id for e in cache.admit("new", 1, 12, 12).evicted] == [evicted]
    with pytest.raises(ValueError, match="latency target"):
        WeightedLRU(2, Eviction.RATE, latency_target_ms=-1.0)


def request(cache: WeightedLRU, model_id: str, now: int) -> bool:
    """One request as the daemon serves it: a hit touches, a miss admits and loads (True: a hit)."""
    if model_id in cache:
        cache.touch(model_id, now)
        return True
    if cache.admit(model_id, 1, now, now).admitted:
        cache.set_state(model_id, State.LOADED, now, 100.0)
    return False


class OneRecordStore:
    """What model records carry between evictions and loads for the adaptive order, for one
    cache: each evicted model's note (the order that evicted it, the clock then)."""

    def __init__(self, cache: WeightedLRU) -> None:
        self.cache = cache
        self.notes: dict[str, tuple[int, float]] = {}

    def request(self, model_id: str, now: int) -> bool:
        cache = self.cache
        if model_id in cache:
            cache.touch(model_id, now)
            return True
        admission = cache.admit(model_id, 1, now, now, evicted_by=self.notes.pop(model_id, None))
        for victim in admission.evicted:
            self.notes[victim.model_id] = (victim.evicted_by, victim.evicted_clock)
        if admission.admitted:
            cache.set_state(model_id, State.LOADED, now, 100.0)
        return False


def test_adaptive_follows_the_order_whose_evictions_come_back_less_and_returns() -> None:
    from meshd.decisions.cache import Eviction
    from meshd.decisions.regret import RATE, RECENCY, fleet_order

    cache = WeightedLRU(3, Eviction.ADAPTIVE)
    assert cache.regret is not None and cache.frequency_weight == 1.0  # it starts as RATE
    cache.regret.explore_every = 4  # explore often: a short test
    store = OneRecordStore(cache)
    now = 0

    def play(models: tuple[str, ...], rounds: int) -> list[bool]:
        nonlocal now
        hits = []
        for _ in range(rounds):
            for m in models:
                now += 1
                hits.append(store.request(m, now))
            assert cache.regret is not None
            cache.follow_order(fleet_order(cache.regret, []))  # a fleet of one: its own tally
        return hits

    # The hot pair moves on, again and again: RATE keeps the pair that went cold, so the new
    # pair's models push each other out and come straight back (its evictions are charged);
    # the admissions that explore evict the cold pair by recency, which never comes back.
    for shift in range(6):
        play((f"{shift}a", f"{shift}b"), 20)
    assert cache.frequency_weight == 0.0  # recency is followed
    tally = cache.regret.tally()
    assert tally.charges[RATE] / tally.evictions[RATE] > tally.charges[RECENCY] / max(tally.evictions[RECENCY], 1)
    play(("c", "d"), 3)
    assert all(play(("c", "d"), 5))  # and the new pair stays
    # Two hot models taking turns, each followed by a model used once: recency evicts the hot
    # ones, which come back; RATE keeps them and its exploring evictions never come back.
    hot_hits = []
    for scan in range(400):
        hot_hits += play((("x", "y")[scan % 2], f"s{scan}"), 1)[:1]
    assert cache.frequency_weight == 1.0
    # recency would miss every hot request here; RATE hits but after its exploring evictions
    assert sum(hot_hits[-100:]) >= 50, hot_hits[-100:]


def test_an_adaptive_reload_is_charged_to_the_order_that_evicted_it_by_its_age() -> None:
    from meshd.decisions.cache import Eviction
    from meshd.decisions.regret import RATE, RECENCY, REGRET_FLOOR

    cache = WeightedLRU(2, Eviction.ADAPTIVE)
    assert cache.regret is not None
    for n, t in (("a", 1), ("b", 2)):
        assert cache.admit(n, 1, t, t).admitted
        cache.set_state(n, State.LOADED, t, 100.0)
    evicted = cache.admit("c", 1, 3, 3).evicted
    assert [(e.model_id, e.evicted_by) for e in evicted] == [("a", RATE)]
    assert cache.regret.tally().evictions == (1.0, 0.0)
    cache.follow_fleet(1, 1.0)  # half a turnover later (2 units)...
    assert cache.admit("a", 1, 4, 4, evicted_by=(RECENCY, evicted[0].evicted_clock)).admitted
    assert cache.regret.tally().charges == (0.0, pytest.approx(REGRET_FLOOR**0.5, rel=1e-3))  # decayed a little
    cache.follow_fleet(1, 10.0)  # ... a reload a turnover or more after its eviction is not charged
    cache.set_state("c", State.LOADED, 5, 100.0)
    cache.set_state("a", State.LOADED, 5, 100.0)
    assert cache.admit("d", 1, 6, 6, evicted_by=(RATE, evicted[0].evicted_clock)).admitted
    assert cache.regret.tally().charges == (0.0, pytest.approx(REGRET_FLOOR**0.5, rel=1e-3))  # decayed a little
    assert WeightedLRU(2, Eviction.RATE).regret is None  # the other orders keep no regret


@pytest.mark.parametrize("order", ["rate", "lrfu", "gdsf"])
def test_load_times_under_the_floor_do_not_decide_which_copy_goes(order: str) -> None:
    """A 4 ms against a 1 ms load is the RPC's jitter, not the models': the copy used four
    times is kept over the one loaded once (before the floor, RATE evicted the hot one)."""
    from meshd.decisions.cache import MIN_LOAD_COST_MS, Eviction

    cache = WeightedLRU(2, Eviction(order))
    for name, load_ms in (("cold", 4.0), ("hot", 1.0)):
        assert cache.admit(name, 1, 10, 10).admitted
        cache.set_state(name, State.LOADED, 10, load_ms)
    for _ in range(3):
        cache.touch("hot", 11)
    assert [e.model_id for e in cache.admit("new", 1, 12, 12).evicted] == ["cold"]
    entry = cache.get("hot")
    assert entry is not None and entry.measured_ms == MIN_LOAD_COST_MS


def _hot_and_steady(order: str) -> tuple[WeightedLRU, Callable[[str], tuple[str, ...]], Callable[[str], None]]:
    """A cache of 3 units under `order` holding a model used 8 times in a row ("hot") and one
    used 4 times after it ("steady"); with `load` (admit and load a model of 1 unit, one clock
    tick on: returns what it evicted) and `use` (one request, one tick on)."""
    from meshd.decisions.cache import Eviction

    cache = WeightedLRU(3, Eviction(order))
    now = [0]

    def load(model_id: str) -> tuple[str, ...]:
        now[0] += 1
        admission = cache.admit(model_id, 1, now[0], now[0])
        assert admission.admitted
        cache.set_state(model_id, State.LOADED, now[0], 100.0)
        return tuple(e.model_id for e in admission.evicted)

    def use(model_id: str) -> None:
        now[0] += 1
        cache.touch(model_id, now[0])

    load("hot")
    for _ in range(7):
        use("hot")
    load("steady")
    for _ in range(3):  # in use before the stream begins
        use("steady")
    return cache, load, use


def _silenced_hot_model_survives(order: str) -> tuple[int | None, bool]:
    """A model used 8 times, then never again, while one-off models stream through a cache of
    3 and a steady model is used every second admission: after how many admissions the hot
    model is gone (None: never, in 60), and whether the steady one was ever evicted."""
    _cache, load, use = _hot_and_steady(order)
    gone_after = None
    steady_evicted = False
    for k in range(60):
        evicted = load(f"once-{k}")
        if "hot" in evicted:
            gone_after = k + 1
        if "steady" in evicted:
            steady_evicted = True
            load("steady")
        elif k % 2:
            use("steady")
    return gone_after, steady_evicted


def test_rate_capped_lets_a_model_that_went_quiet_go_once_its_silence_outlasts_its_rate() -> None:
    # RATE keeps the model that was hot for about log2(its rate / a newcomer's) half-lives
    # (4 turnovers each) after its last use; the capped order once its silence has made the
    # odds that its rate ended long (a few of its own intervals: here ~12 units of clock).
    rate_gone, rate_steady_evicted = _silenced_hot_model_survives("rate")
    capped_gone, capped_steady_evicted = _silenced_hot_model_survives("rate-capped")
    assert capped_gone is not None and capped_gone <= 12, capped_gone
    assert rate_gone is None or rate_gone > 2 * capped_gone, (rate_gone, capped_gone)
    # a model in steady use, silent no longer than its own rate predicts, is never the victim
    assert not capped_steady_evicted and not rate_steady_evicted


def test_rate_capped_victim_value_and_age_are_its_next_victims() -> None:
    from meshd.decisions.cache import RATE_HOLD_TURNOVERS, Eviction

    cache = WeightedLRU(4, Eviction.CAPPED)
    for t, m in enumerate(("a", "b", "c"), start=1):
        assert cache.admit(m, 1, t, t).admitted
        cache.set_state(m, State.LOADED, t, 100.0)
    for t in range(4, 12):
        cache.touch("a", t)  # a: dense use, then silence
    assert cache.admit("d", 1, 12, 12).admitted
    cache.set_state("d", State.LOADED, 12, 100.0)
    for t, m in enumerate(("e", "f", "g", "h", "i", "j"), start=13):  # turnover: the clock moves
        evicted = cache.admit(m, 1, t, t).evicted
        cache.set_state(m, State.LOADED, t, 100.0)
        assert len(evicted) == 1
    victim = min(
        (e for e in cache.entries() if e.state is State.LOADED),
        key=lambda e: (cache._log_worth(e), e.last_used_ms, e.seq),
    )
    assert cache.victim_value() == pytest.approx(cache._log_worth(victim))
    assert cache.lru_ms(100) == victim.last_used_ms
    planned = cache.victims_for("k", 1, 100)
    assert planned is not None and [e.model_id for e in planned] == [victim.model_id]
    # the bound: RATE's value times the odds its rate r holds over a silence g, at a hazard h of
    # one per RATE_HOLD_TURNOVERS turnovers: 1 / (1 + h g exp(r g))
    hazard = 1.0 / (RATE_HOLD_TURNOVERS * cache.capacity_units)
    silent = [e for e in cache.entries() if cache.clock > e.clock]
    assert silent
    for e in silent:
        silence = cache.clock - e.clock
        rate_value = cache._log_value(e) - silence / cache._half_life
        holds = 1.0 / (1.0 + hazard * silence * math.exp(e.score * silence))
        assert cache._log_worth(e) == pytest.approx(rate_value + math.log2(holds))


def test_rate_capped_counts_the_evictions_where_the_odds_overrule_rate() -> None:
    # The `meshd_eviction_odds_overruled` gauge: a moving average over about
    # OVERRULED_EVICTIONS evictions of whether the victim was not RATE's next one. One-off
    # models stream through a cache of 3 beside a steady model: both orders take the oldest
    # one-off; then the capped order takes the hot model that went quiet, which RATE keeps.
    from meshd.decisions.cache import OVERRULED_EVICTIONS, Eviction

    assert WeightedLRU(3, Eviction.RATE).overruled is None  # only the capped order has odds
    cache, load, use = _hot_and_steady("rate-capped")
    evictions = 0
    for k in range(60):
        evicted = load(f"once-{k}")
        evictions += len(evicted)
        if "hot" in evicted:
            break
        assert cache.overruled == 0.0, (k, evicted)  # the oldest one-off: RATE's victim too
        if k % 2:
            use("steady")
    else:
        raise AssertionError("the hot model was never evicted")
    assert evictions > 2
    assert cache.overruled == pytest.approx(1 / OVERRULED_EVICTIONS)
    # each later eviction that agrees with RATE weighs it down by the same moving average
    before = cache.overruled
    assert before is not None
    evicted = load("once-last")
    assert evicted and not any(m in ("hot", "steady") for m in evicted)
    assert cache.overruled == pytest.approx(before * (1 - 1 / OVERRULED_EVICTIONS))
