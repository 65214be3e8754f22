"""Copy scaling in the simulators: after copies are added for load, no more are added until
the loads that added them are past upstream's window (`scaling.recent_load_window_ms`: two
rate checks and twice the instance's learnt assume-loaded time), in the fleet simulator and in
the language-model one, as the daemon's scaler (tests/loops/test_scaler.py)."""

from __future__ import annotations

from array import array

from sim import llm
from sim.engine import EPOCH_MS, Fleet, Simulation
from sim.policies import MESHD, UPSTREAM
from sim.workloads import Catalogue, Workload


def load_starts(policy: object) -> list[int]:
    """One model loading in 1 s, asked 100 times a second for 2 min on 6 instances (6,000 a
    minute: three times the per-copy threshold); its copies' load starts, from the start."""
    cat = Catalogue(ids=("m",), units=(10,), load_ms=(1000.0,), service_ms=(1.0,))
    times = list(range(0, 120_000, 10))
    wl = Workload("busy", cat, array("q", times), array("q", [0] * len(times)))
    sim = Simulation(wl, Fleet(6, 100, service_jitter=0.0, load_jitter=0.0), policy)  # type: ignore[arg-type]
    sim.run()
    assert all(i.assume_loaded.ms("") in (20_333, 30_000) for i in sim.insts)  # 30 s default, one 1 s load
    return sorted(t - EPOCH_MS for t in sim.copies[0].values())


def test_no_copies_for_load_until_the_last_ones_are_past_the_window() -> None:
    for policy in (UPSTREAM, MESHD):
        # The first load at 0 s; the check at 20 s (the first with a rate) adds two copies,
        # max(2, 6 / 3) at a time. Their loads hold further copies back for 2 x 10 s + 2 x
        # 20.3 s (the assume-loaded time learnt from one 1 s load), to 80.7 s: the next is at
        # the check at 90 s. Before the hold, copies were added at 30, 30 and 40 s as well.
        assert load_starts(policy) == [0, 20_000, 20_000, 90_000], policy


def test_the_llm_simulator_adds_no_copy_just_after_another_loaded() -> None:
    # Loads of 5 s: the copy added at 20 s serves from 25 s, and the queue its backlog keeps
    # deep at 30 s no longer adds a copy there (the window is 2 x 10 s + 2 x 5 s); by 50 s the
    # two copies have caught up. Before the hold a third copy came at 30 s on every seed.
    setup = llm.Setup(copies=1, add_copies=True, load_ms=5_000)
    for seed in (1, 2, 3):
        assert llm.simulate(llm.Mix(requests=600), setup, "load", seed).added_s == [20], seed
