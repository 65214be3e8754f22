"""Service time in the simulator: in-flight counts steer copy choice, gates queue and refuse
as meshd's gate does, and zero service time changes nothing."""

from __future__ import annotations

import random
from array import array
from dataclasses import replace

from sim.engine import EPOCH_MS, Fleet, Simulation, simulate
from sim.policies import MESHD, UPSTREAM
from sim.workloads import Catalogue, Workload, catalogue, zipf

UNITS = 10


def one_model(service_ms: float) -> Catalogue:
    """One model that loads instantly and serves in `service_ms` exactly (no jitter in these fleets)."""
    return Catalogue(ids=("m",), units=(UNITS,), load_ms=(0.0,), service_ms=(service_ms,))


def trace(times: list[int], cat: Catalogue) -> Workload:
    return Workload("t", cat, array("q", times), array("q", [0] * len(times)))


def preload(sim: Simulation, instance: int, model: int, started_ms: int) -> None:
    """A copy loaded (with its gate, if the fleet limits concurrency) before the trace starts."""
    inst = sim.insts[instance]
    assert inst.cache.admit(sim.ids[model], sim.units[model], started_ms, started_ms).admitted
    sim.copies[model][inst.instance_id] = started_ms
    inst.loading += 1
    sim._load_done(started_ms, 0, instance, model, 0.0)


def test_in_flight_requests_steer_the_next_one_to_the_less_busy_copy() -> None:
    cat = one_model(service_ms=1000.0)
    sim = Simulation(trace([0], cat), Fleet(3, 100, service_jitter=0.0), UPSTREAM)
    for i in (1, 2):
        preload(sim, i, 0, EPOCH_MS - 60_000)
    sim._publish(EPOCH_MS, force=True)
    entry = sim.insts[0]
    t = EPOCH_MS + 10
    sim._request(t, 0, entry)  # both copies idle: the tie goes to the smaller id
    assert entry.inflight == {"i001": 1}
    sim._request(t, 0, entry)  # i001 has one in flight from here: i002 serves
    assert entry.inflight == {"i001": 1, "i002": 1}
    sim._request(t, 0, entry)
    assert entry.inflight == {"i001": 2, "i002": 1}
    sim._request(t + 999, 0, entry)  # nothing answered yet: i002 has fewer in flight
    assert entry.inflight == {"i001": 2, "i002": 2}
    sim._request(t + 1000, 0, entry)  # the first three answered (1 s each), not the fourth: i001
    assert entry.inflight == {"i001": 1, "i002": 1}
    assert [sim.insts[i].cache.get("m").served for i in (1, 2)] == [3, 2]


def test_a_concurrency_limit_queues_first_come_first_served() -> None:
    # One instance, one slot, 100 ms per request: the load (instant) ends at 0 and the first
    # request runs 0-100; the others wait for the slot: 100-10, 200-20, 300-30 ms.
    wl = trace([0, 10, 20, 30], one_model(100.0))
    r = simulate(wl, Fleet(1, 100, service_jitter=0.0, max_concurrency=1), UPSTREAM)
    assert (r.requests, r.loads, r.queued, r.failed) == (4, 1, 3, 0)
    assert r.added_mean_ms == (0 + 90 + 180 + 270) / 4
    assert (r.added_p50_ms, r.added_p99_ms) == (90.0, 270.0)
    assert r.total_mean_ms == (100 + 190 + 280 + 370) / 4
    assert (r.total_p50_ms, r.total_p99_ms) == (190.0, 370.0)
    unlimited = simulate(wl, Fleet(1, 100, service_jitter=0.0), UPSTREAM)
    assert (unlimited.queued, unlimited.added_p99_ms, unlimited.total_p99_ms) == (0, 0.0, 100.0)


def test_a_full_queue_refuses_with_resource_exhausted() -> None:
    # Two may wait: the fourth request finds the slot taken and two waiting, and no other copy.
    wl = trace([0, 10, 20, 30], one_model(100.0))
    r = simulate(wl, Fleet(1, 100, service_jitter=0.0, max_concurrency=1, max_queue=2), UPSTREAM)
    assert (r.requests, r.queued, r.failed, r.rejected) == (4, 2, 1, 1)
    assert r.added_p99_ms == 180.0


def test_a_refused_request_reroutes_to_another_copy() -> None:
    cat = one_model(service_ms=1000.0)
    sim = Simulation(trace([0], cat), Fleet(2, 100, service_jitter=0.0, max_concurrency=1, max_queue=1), UPSTREAM)
    for i in (0, 1):
        preload(sim, i, 0, EPOCH_MS - 60_000)
    sim._publish(EPOCH_MS, force=True)
    local = sim.insts[0]
    t = EPOCH_MS + 10
    sim._request(t, 0, local)  # runs here
    sim._request(t, 0, local)  # waits here (one may wait)
    assert local.gates[0].running == 1 and len(local.gates[0].queue) == 1 and local.inflight == {}
    sim._request(t, 0, local)  # the local gate refuses: Refused(busy), rerouted to i001
    assert local.inflight == {"i001": 1}
    assert sim.insts[1].gates[0].running == 1
    assert (sim.result.hits, sim.result.queued, sim.result.rejected) == (3, 1, 0)
    sim._request(t, 0, local)  # refused here again: waits at i001
    assert (sim.result.queued, sim.result.failed) == (2, 0)
    sim._request(t, 0, local)  # both gates full: RESOURCE_EXHAUSTED (the router's busy rule)
    assert (sim.result.failed, sim.result.rejected) == (1, 1)


def test_zero_service_time_gives_the_results_of_no_service_time() -> None:
    rng = random.Random(3)
    timed = catalogue(300, rng, size_sigma=0.5)
    instant = replace(timed, service_ms=(0.0,) * len(timed))
    for policy in (UPSTREAM, MESHD):
        wl_timed = zipf(timed, 4000, 1.0, 20.0, seed=4)
        wl_instant = replace(wl_timed, catalogue=instant)
        fleet = Fleet(4, max(1, timed.total_units // 20), loading_threads=2, seed=5)
        off = simulate(wl_timed, replace(fleet, service_time=False), policy, warmup=500)
        assert off.loads > 0 and off.hits > 0
        assert simulate(wl_instant, fleet, policy, warmup=500) == off
        # A gate on copies that answer at once never holds anyone back.
        assert simulate(wl_instant, replace(fleet, max_concurrency=1), policy, warmup=500) == off
        on = simulate(wl_timed, fleet, policy, warmup=500)
        assert on.total_p99_ms > on.added_p99_ms and off.total_p99_ms == off.added_p99_ms


def test_a_queueing_copy_gets_more_copies_from_the_scaler() -> None:
    # 20 requests/s at a copy serving one at a time for 100 ms: it queues. The scaler's gated
    # rate (at most 600/min per copy, copies added above 90 % of it) asks for more copies;
    # without the gate the same 1200/min stays under the configured 2000 and one copy serves.
    # Two minutes: the second copy comes at 10 s, the third at 60 s, once the first copy's load
    # (at 0 s) is past the recent-load hold (2 x 10 s + 2 x the 20 s assume-loaded time).
    wl = trace(list(range(0, 120_000, 50)), one_model(100.0))
    fleet = Fleet(3, 100, service_jitter=0.0)
    alone = simulate(wl, fleet, UPSTREAM)
    assert (alone.loads, alone.queued, alone.failed) == (1, 0, 0)
    gated = simulate(wl, replace(fleet, max_concurrency=1), UPSTREAM)
    assert gated.loads == 3 and gated.queued > 0
    assert gated.total_p99_ms > alone.total_p99_ms
