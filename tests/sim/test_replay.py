"""The engine on tiny hand-checked traces: entry instances given per request (replaying a real
run), hits through a peer, loads waited for, bad replays refused."""

from __future__ import annotations

from array import array

import pytest

from meshd.decisions.cache import Eviction
from sim.engine import Fleet, simulate
from sim.policies import UPSTREAM, as_configured
from sim.workloads import Catalogue, Workload


def tiny(times: list[int], models: list[int], n: int = 3, load_ms: float = 100.0) -> Workload:
    cat = Catalogue(ids=tuple(f"m{i}" for i in range(n)), units=(1,) * n, load_ms=(load_ms,) * n, service_ms=(1.0,) * n)
    return Workload("tiny", cat, array("q", times), array("q", models))


def test_a_copy_on_a_peer_serves_requests_entering_elsewhere() -> None:
    # m0 loads (100 ms) where it first entered; later requests entering at the other
    # instance are served through that copy: one load, two hits, one hop of added latency each.
    w = tiny([0, 500, 1000], [0, 0, 0])
    r = simulate(w, Fleet(2, 2, load_jitter=0.0, hop_ms=1.0), UPSTREAM, ingress=[0, 1, 1])
    assert (r.loads, r.hits, r.failed) == (1, 2, 0)
    assert r.added_p99_ms == 100.0  # the first request waited for the load, the others 1 ms


def test_a_request_arriving_during_a_load_waits_for_it_and_is_a_miss() -> None:
    w = tiny([0, 40], [1, 1])
    r = simulate(w, Fleet(1, 2, load_jitter=0.0), UPSTREAM, ingress=[0, 0])
    assert (r.loads, r.hits) == (1, 0)
    assert r.added_p50_ms == 60.0 and r.added_p99_ms == 100.0


def test_the_same_replay_gives_the_same_result() -> None:
    w = tiny(list(range(0, 4000, 200)), [i % 3 for i in range(20)])
    ingress = [i % 2 for i in range(20)]
    fleet = Fleet(2, 1, load_jitter=0.0)
    policy = as_configured(Eviction.LRU)
    assert simulate(w, fleet, policy, ingress=ingress) == simulate(w, fleet, policy, ingress=ingress)


@pytest.mark.parametrize(
    ("ingress", "message"),
    [([0], "names 1 instances for 2 requests"), ([0, 2], "outside 0..1"), ([0, -1], "outside 0..1")],
)
def test_a_replay_naming_instances_the_fleet_lacks_is_refused(ingress: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        simulate(tiny([0, 1], [0, 1]), Fleet(2, 2), UPSTREAM, ingress=ingress)
