"""One cache: meshd's eviction beside Belady and libCacheSim on the same stream."""

from __future__ import annotations

import random
from array import array

import pytest

from meshd.decisions.cache import Eviction
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
        "lfu": Outcome.of(lfu_hits(reqs, units, 50), reqs, [1.0] * N_MODELS, warm).hit_ratio,
        "oracle": Outcome.of(oracle_hits(reqs, units, 50, (Epoch(0, probs),)), reqs, [1.0] * N_MODELS, warm).hit_ratio,
        "belady": belady_hit_ratio(reqs, units, 50, warm),
    }
    assert ratio["lru"] < ratio["lrfu"] < ratio["lfu"] < ratio["oracle"] < ratio["belady"], ratio
    # The static top 50's expected hit ratio, from the probabilities alone.
    assert ratio["oracle"] == pytest.approx(sum(sorted(probs, reverse=True)[:50]), abs=0.01)
