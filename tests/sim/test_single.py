"""One cache: meshd's eviction beside Belady and libCacheSim on the same stream."""

from __future__ import annotations

import random

import pytest

from meshd.decisions.cache import Eviction
from sim.single import belady_hit_ratio, libcachesim_hit_ratios, meshd_hit_ratio
from sim.workloads import zipf_weights

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
