"""The simulator against theory: one instance, LRU, independent Zipf requests vs Che's approximation."""

from __future__ import annotations

import random
from array import array

import pytest

from sim.engine import Fleet, simulate
from sim.policies import UPSTREAM
from sim.single import che_hit_ratio
from sim.workloads import Catalogue, Workload, zipf_weights

MODELS = 500
REQUESTS = 40_000
WARMUP = 10_000


def unit_catalogue(n: int) -> Catalogue:
    """Models of one unit each that load instantly (Che's model has no load time)."""
    return Catalogue(ids=tuple(f"m{i}" for i in range(n)), units=(1,) * n, load_ms=(0.0,) * n, service_ms=(1.0,) * n)


@pytest.mark.parametrize("alpha", [0.6, 0.8, 1.0, 1.2])
def test_one_lru_instance_matches_che_within_one_point(alpha: float) -> None:
    weights = zipf_weights(MODELS, alpha)
    rng = random.Random(7)
    models = array("q", rng.choices(range(MODELS), weights=weights, k=REQUESTS))
    # One request per ms: every request has its own time, so LRU order is exact.
    workload = Workload("zipf", unit_catalogue(MODELS), array("q", range(REQUESTS)), models)
    for capacity in (25, 50, 100):  # 5, 10 and 20 % of the catalogue
        result = simulate(workload, Fleet(1, capacity, load_jitter=0.0), UPSTREAM, warmup=WARMUP)
        expected = che_hit_ratio(weights, capacity)
        assert result.failed == 0
        assert abs(result.hit_ratio - expected) <= 0.01, (alpha, capacity, result.hit_ratio, expected)
