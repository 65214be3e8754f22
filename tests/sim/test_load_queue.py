"""The load queue in the simulator (issue 24): queued loads take no room, the most valuable
starts first, a load that cannot start in time is refused at once, and an overloaded fleet
keeps its hit ratio where the first-come queue collapses."""

from __future__ import annotations

import random
from array import array

import pytest

from sim.engine import EPOCH_MS, Fleet, Simulation, simulate
from sim.policies import MESHD, MESHD_FIFO
from sim.workloads import Catalogue, Workload, catalogue, zipf

UNITS = 10


def models(n: int, load_ms: float = 1000.0) -> Catalogue:
    return Catalogue(
        ids=tuple(f"m{i}" for i in range(n)), units=(UNITS,) * n, load_ms=(load_ms,) * n, service_ms=(0.0,) * n
    )


def preload(sim: Simulation, model: int, at_ms: int) -> None:
    inst = sim.insts[0]
    assert inst.cache.admit(sim.ids[model], sim.units[model], at_ms, at_ms).admitted
    sim.copies[model][inst.instance_id] = at_ms
    inst.loading += 1
    sim._load_done(at_ms, 0, 0, model, 0.0)


def one_instance(policy_load_queue: bool, capacity: int = 2 * UNITS, n: int = 40, **kw: object) -> Simulation:
    wl = Workload("t", models(n), array("q", [0]), array("q", [0]))
    fleet = Fleet(1, capacity, loading_threads=1, load_jitter=0.0, service_time=False, **kw)  # type: ignore[arg-type]
    sim = Simulation(wl, fleet, MESHD if policy_load_queue else MESHD_FIFO)
    preload(sim, 0, EPOCH_MS - 60_000)  # the hot model, loaded, used a minute ago
    sim._publish(EPOCH_MS, force=True)
    return sim


def test_a_queued_load_takes_no_room_so_the_serving_copy_stays() -> None:
    for load_queue, hot_stays in ((True, True), (False, False)):
        sim = one_instance(load_queue)
        inst = sim.insts[0]
        sim._request(EPOCH_MS, 1, inst)  # starts at once: the free half of the cache
        sim._request(EPOCH_MS + 1, 2, inst)  # the thread is busy: it waits
        assert ("m0" in inst.cache) is hot_stays, load_queue
        assert ("m2" in inst.cache) is not load_queue  # first-come: admitted (evicting) while it waits
        assert (2 in inst.pending) is load_queue


@pytest.mark.parametrize(
    ("done_at_ms", "first", "still_waiting"),
    [
        (400, "m3", 2),  # within the overtaking bound (0.5 s): the more valuable first
        (1000, "m2", 3),  # m2 has waited 1 s, past the bound: its turn
    ],
)
def test_the_most_valuable_waiting_load_starts_first_unless_one_was_overtaken_too_long(
    done_at_ms: int, first: str, still_waiting: int
) -> None:
    sim = one_instance(True)
    inst = sim.insts[0]
    sim._request(EPOCH_MS, 1, inst)  # runs
    sim._request(EPOCH_MS + 1, 2, inst)  # waits first, one request
    for k in range(3):
        sim._request(EPOCH_MS + 2 + k, 3, inst)  # waits later, three requests
    assert list(inst.pending) == [2, 3]
    sim._load_done(EPOCH_MS + done_at_ms, 0, 0, 1, float(done_at_ms))
    other = "m2" if first == "m3" else "m3"
    assert first in inst.cache and other not in inst.cache
    assert list(inst.pending) == [still_waiting]


def test_a_load_that_cannot_start_within_the_limit_is_refused_at_once() -> None:
    # 1 thread, 1 s loads, a 4 s limit: a load joins while it should start within 2 s.
    sim = one_instance(True, load_wait_limit_ms=4_000)
    inst = sim.insts[0]
    inst.mean_load_ms = 1000.0
    for m in range(1, 10):
        sim._request(EPOCH_MS + m, m, inst)
    assert inst.loading == 1 and len(inst.pending) == 2  # 1 running; waits of 0.5 s and 1.5 s
    r = sim.result
    assert r.failed == r.refused_fast == 6 and r.rejected == 6 and r.failed_slow == 0
    sim._request(EPOCH_MS + 20, 0, inst)  # the hot copy still answers, as a hit
    assert r.hits == 1


def _full_queue_and_a_hotter_miss_at(ms: int) -> Simulation:
    """One 1 s load running, two waiting (the queue at its bound), then a miss for m9, which
    has been asked for here before (worth more than the waiting ones), `ms` after the start."""
    sim = one_instance(True, load_wait_limit_ms=4_000)
    inst = sim.insts[0]
    inst.mean_load_ms = 1000.0
    for m in (1, 2, 3):
        sim._request(EPOCH_MS + m, m, inst)
    assert list(inst.pending) == [2, 3]
    for _ in range(5):
        inst.popularity.count("m9")
    sim._request(EPOCH_MS + ms, 9, inst)
    return sim


def test_a_hotter_miss_displaces_the_least_valuable_waiting_load() -> None:
    sim = _full_queue_and_a_hotter_miss_at(10)
    assert list(sim.insts[0].pending) == [2, 9]  # m3 (latest of the least valuable) gave way
    assert sim.result.failed == 1


def test_a_load_that_has_waited_is_not_displaced_the_newcomer_is_refused_fast() -> None:
    sim = _full_queue_and_a_hotter_miss_at(300)  # m2 and m3 have waited about 300 ms: past the window
    assert list(sim.insts[0].pending) == [2, 3]
    r = sim.result
    assert r.failed == r.refused_fast == 1 and r.failed_slow == 0


def test_an_overloaded_fleet_keeps_its_hit_ratio_where_first_come_collapses() -> None:
    cat = catalogue(300, random.Random(1), size_sigma=0.5)
    fleet = Fleet(4, max(1, cat.total_units // 10 // 4), loading_threads=1, seed=1)

    def hit_ratio(rate: float, policy: object) -> float:
        wl = zipf(cat, 6000, 0.9, rate, seed=1)
        return simulate(wl, fleet, policy, 1200).hit_ratio  # type: ignore[arg-type]

    calm = hit_ratio(2.0, MESHD)
    assert hit_ratio(40.0, MESHD) > calm - 0.05
    assert hit_ratio(40.0, MESHD_FIFO) < hit_ratio(2.0, MESHD_FIFO) - 0.1  # the collapse this prevents


def test_a_request_with_a_long_deadline_queues_beyond_the_wait_limit_and_is_served() -> None:
    """Issue 33, as in the daemon: with a 4 s limit only two loads queue behind the running
    one; requests whose clients allow a minute queue deeper, are not refused when the limit
    passes, and are served (none late). A 1.2 s deadline cannot be met behind them: refused."""
    sim = one_instance(True, load_wait_limit_ms=4_000, client_timeout_ms=60_000)
    inst = sim.insts[0]
    inst.mean_load_ms = 1000.0
    for m in range(1, 7):
        sim._request(EPOCH_MS + m, m, inst)
    assert inst.loading == 1 and len(inst.pending) == 5 and sim.result.failed == 0
    t = EPOCH_MS
    for m in range(1, 7):  # each load takes 1 s; the last waits 5 s, past the 4 s limit
        t += 1000
        sim._load_done(t, 0, 0, m, 1000.0)
    r = sim.result
    assert r.failed == 0 and r.loads == 7 and r.late == 0  # 6 and the preloaded hot model
    assert all(f"m{m}" in inst.cache for m in (5, 6))


def test_requests_served_after_their_clients_deadline_are_counted_late() -> None:
    wl = Workload("t", models(3, load_ms=2_000.0), array("q", [0, 10, 20]), array("q", [0, 1, 2]))
    for timeout, late in ((0, 0), (60_000, 0), (3_000, 2)):  # one thread: 2 s, 4 s, 6 s
        fleet = Fleet(1, 3 * UNITS, loading_threads=1, load_jitter=0.0, service_time=False, client_timeout_ms=timeout)
        r = simulate(wl, fleet, MESHD_FIFO)
        assert (r.failed, r.late) == (0, late), timeout


def test_a_negative_client_deadline_is_refused() -> None:
    with pytest.raises(ValueError, match="client deadline"):
        Fleet(1, UNITS, client_timeout_ms=-1)
