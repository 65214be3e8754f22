"""One cache: meshd's eviction beside Belady and libCacheSim on the same stream."""

from __future__ import annotations

import random
from array import array

import pytest

from meshd.decisions.cache import Eviction
from sim.engine import Result
from sim.report import against_upstream
from sim.single import (
    Outcome,
    belady_hit_ratio,
    lfu_hits,
    libcachesim_hit_ratios,
    meshd_hit_ratio,
    meshd_hits,
    oracle_hits,
)
from sim.workloads import Epoch, zipf_weights

N_MODELS = 1000
REQUESTS = 30_000


def stream(alpha: float = 1.0) -> list[int]:
    return random.Random(5).choices(range(N_MODELS), weights=zipf_weights(N_MODELS, alpha), k=REQUESTS)


def test_belady_bounds_every_order_and_the_counting_ones_beat_lru_on_independent_zipf() -> None:
    reqs, units = stream(), [1] * N_MODELS
    lru = meshd_hit_ratio(reqs, units, 50, Eviction.LRU)
    gdsf = meshd_hit_ratio(reqs, units, 50, Eviction.GDSF)
    lrfu = meshd_hit_ratio(reqs, units, 50, Eviction.LRFU)
    best = belady_hit_ratio(reqs, units, 50)
    assert lru < gdsf < best
    assert lru < lrfu < best


def test_meshd_lru_is_libcachesim_lru() -> None:
    pytest.importorskip("libcachesim")
    reqs, units = stream(0.8), [1] * N_MODELS
    theirs = libcachesim_hit_ratios(reqs, units, 50, algorithms=("LRU", "Belady"))
    assert meshd_hit_ratio(reqs, units, 50, Eviction.LRU) == pytest.approx(theirs["LRU"], abs=1e-9)
    assert belady_hit_ratio(reqs, units, 50) == pytest.approx(theirs["Belady"], abs=0.002)


def test_outcome_counts_hits_and_the_load_seconds_of_misses_after_warmup() -> None:
    out = Outcome.of(bytearray([0, 1, 0, 1, 0]), [0, 0, 1, 1, 2], [1000.0, 2000.0, 4000.0], warmup=1)
    assert out.hit_ratio == pytest.approx(0.5)
    assert out.miss_load_s == pytest.approx((2000.0 + 4000.0) / 4)  # ms per request = s per 1,000


def test_the_popularity_oracle_holds_the_most_probable_and_follows_a_new_epoch() -> None:
    probs = array("d", [0.5, 0.3, 0.2])
    swapped = array("d", [0.2, 0.3, 0.5])
    reqs = [0, 1, 2, 0, 2, 1, 2, 2, 0]
    hits = oracle_hits(reqs, [1, 1, 1], 2, (Epoch(0, probs), Epoch(5, swapped)))
    # 0 and 1 fill the cache; 2 is never worth a place until it is the most probable (from 5
    # on), when it replaces the least probable of those held (0), which then misses.
    assert list(hits) == [0, 0, 0, 1, 0, 1, 0, 1, 0]
    # Per unit: a big model ranks below a small one of the same probability.
    assert list(oracle_hits([0, 1, 0, 1], [2, 1], 2, (Epoch(0, array("d", [0.5, 0.5])),))) == [0, 0, 0, 1]
    # Weighted by load time per unit (load-seconds): the slow big model ranks first.
    weighted = oracle_hits([0, 1, 0, 1], [2, 1], 2, (Epoch(0, array("d", [0.5, 0.5])),), load_ms=[10_000.0, 1000.0])
    assert list(weighted) == [0, 0, 1, 0]


def test_the_oracle_fills_free_room_but_loads_into_a_full_cache_only_what_it_aims_to_hold() -> None:
    one = (Epoch(0, array("d", [0.4, 0.3, 0.3])),)
    # Two small models (0.6 together) beat the big one (0.4): the big one only borrows free room.
    assert list(oracle_hits([0, 1, 2, 1, 2, 0], [2, 1, 1], 2, one)) == [0, 0, 0, 1, 1, 0]
    # A model as big as the cache, worth more than the small one per request though not per
    # unit, is kept: the small one is not loaded over it.
    whole = (Epoch(0, array("d", [0.9, 0.1])),)
    assert list(oracle_hits([0, 1, *[0] * 8, 1], [10, 1], 10, whole)) == [0, 0, *[1] * 8, 0]
    # Bigger than the cache: never loaded.
    assert list(oracle_hits([0, 0], [5], 4, (Epoch(0, array("d", [1.0])),))) == [0, 0]
    with pytest.raises(ValueError, match="probabilities a synthetic workload"):
        oracle_hits([0], [1], 1, ())


def test_perfect_memory_lfu_weighs_counts_by_load_time_per_unit_when_given() -> None:
    reqs = [0, 1, 0, 1, 2, 0, 1]  # 0 and 1 twice each, then 2 needs a place
    # Counts alone tie; the lower id goes first: 0 is evicted, misses, and pushes 2 out.
    assert list(lfu_hits(reqs, [1, 1, 1], 2)) == [0, 0, 1, 1, 0, 0, 1]
    # Model 0 reloads ten times slower: 1 goes instead.
    assert list(lfu_hits(reqs, [1, 1, 1], 2, load_ms=[10.0, 1.0, 1.0])) == [0, 0, 1, 1, 0, 1, 0]
    # Per unit: model 0 (two units) is worth less than 1 for the same count.
    assert list(lfu_hits([0, 1, 0, 1, 2, 1, 0], [2, 1, 1], 3)) == [0, 0, 1, 1, 0, 1, 0]


def test_perfect_memory_lfu_keeps_a_model_for_its_old_uses_where_lrfu_forgets_them() -> None:
    old = [0] * 200  # model 0, very popular once
    churn = [1 + i % 40 for i in range(40 * 100)]  # then 40 models taking turns, 100 rounds
    reqs = old + churn + [0]
    assert lfu_hits(reqs, [1] * 41, 10)[-1] == 1  # 200 uses outrank every newcomer's 100
    assert meshd_hits(reqs, [1] * 41, 10, Eviction.LRFU)[-1] == 0  # decayed over the turnover


def test_the_anchors_rank_as_they_should_on_independent_zipf() -> None:
    reqs, units = stream(), [1] * N_MODELS
    probs = array("d", zipf_weights(N_MODELS, 1.0))
    warm = REQUESTS // 5
    ratio = {
        "lru": meshd_hit_ratio(reqs, units, 50, Eviction.LRU, warmup=warm),
        "lrfu": meshd_hit_ratio(reqs, units, 50, Eviction.LRFU, warmup=warm),
        "rate": meshd_hit_ratio(reqs, units, 50, Eviction.RATE, warmup=warm),
        "lfu": Outcome.of(lfu_hits(reqs, units, 50), reqs, [1.0] * N_MODELS, warm).hit_ratio,
        "oracle": Outcome.of(oracle_hits(reqs, units, 50, (Epoch(0, probs),)), reqs, [1.0] * N_MODELS, warm).hit_ratio,
        "belady": belady_hit_ratio(reqs, units, 50, warm),
    }
    assert ratio["lru"] < ratio["lrfu"] < ratio["lfu"] < ratio["oracle"] < ratio["belady"], ratio
    assert ratio["lrfu"] < ratio["rate"] < ratio["oracle"], ratio  # a longer memory of each model's rate
    # The static top 50's expected hit ratio, from the probabilities alone.
    assert ratio["oracle"] == pytest.approx(sum(sorted(probs, reverse=True)[:50]), abs=0.01)


def test_the_fleet_against_upstream_table_gives_each_count_as_a_change_from_upstreams_loads() -> None:
    def run(policy: str, loads: int) -> Result:
        return Result(policy=policy, workload="t", instances=2, capacity_units=10, loads=loads)

    fleet = [(0.1, run("upstream", 200)), (0.1, run("meshd", 150)), (0.2, run("upstream", 0)), (0.2, run("meshd", 5))]
    text = against_upstream([0.1, 0.2], fleet, {"x": [100, 3]})
    rows = text.splitlines()
    assert rows[0] == "| capacity | upstream (fleet) | meshd (fleet) | one cache: x |"
    assert rows[2] == "| 10% | 200 | 150 (-25.0 %) | 100 (-50.0 %) |"
    assert rows[3] == "| 20% | 0 | 5 (n/a) | 3 (n/a) |"  # no loads upstream: no ratio
    assert against_upstream([0.1, 0.2], fleet[:2], {}) == ""  # upstream missing at 20 %: no table
