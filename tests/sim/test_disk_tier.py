"""The simulator's disk tier (issue 42): loads pull their model's files unless the instance's
disk holds them, the disk keeps them within its budget, and meshd's placement sends a load
where the files are (loading.ready_soonest with the pull estimate from the records)."""

from __future__ import annotations

import random
from array import array
from pathlib import Path

import pytest

from meshd.decisions.cache import State
from meshd.decisions.placement.disk import GIB
from meshd.decisions.placement.view import ClusterView
from sim.__main__ import main
from sim.engine import EPOCH_MS, Fleet, Simulation, simulate
from sim.policies import MESHD, UPSTREAM
from sim.workloads import Catalogue, Workload, catalogue, zipf

UNITS = 1 << 15  # 256 MiB a model
PULL_MS_PER_GIB = 8_000.0  # a 256 MiB model pulls in 2 s, against its 1 s load


def models(n: int) -> Catalogue:
    return Catalogue(
        ids=tuple(f"m{i}" for i in range(n)), units=(UNITS,) * n, load_ms=(1000.0,) * n, service_ms=(0.0,) * n
    )


def two_instances(disk_units: int, n: int = 20) -> Simulation:
    wl = Workload("t", models(n), array("q", [0]), array("q", [0]))
    fleet = Fleet(
        2,
        4 * UNITS,
        load_jitter=0.0,
        service_time=False,
        pull_ms_per_gib=PULL_MS_PER_GIB,
        disk_units=disk_units,
    )
    return Simulation(wl, fleet, MESHD)


def on_disk(sim: Simulation, inst: int, model: int) -> None:
    """Model `model`'s files on instance `inst`'s disk, as a pull there left them."""
    disk = sim.insts[inst].disk
    assert disk is not None
    assert disk.admit(sim.ids[model], sim.units[model], EPOCH_MS, EPOCH_MS).admitted
    disk.set_state(sim.ids[model], State.LOADED, EPOCH_MS, sim.pull_ms[model])
    sim.insts[inst].disk_version += 1


def test_a_load_goes_where_its_files_are_and_skips_the_pull_there() -> None:
    sim = two_instances(disk_units=32 * UNITS)
    for m in range(1, 20):
        on_disk(sim, 1, m)
    sim._publish(EPOCH_MS, force=True)
    view = ClusterView("i000", EPOCH_MS, sim.views)
    assert view.instances["i001"].disk is not None and "m1" in view.instances["i001"].disk
    targets = {sim._load_target(view, m, frozenset()).target for m in range(1, 20)}  # type: ignore[union-attr]
    assert targets == {"i001"}
    # Requests arriving at i000 load on i001, from its disk: the load takes its 1 s, no pull.
    sim._request(EPOCH_MS, 1, sim.insts[0])
    assert "m1" in sim.insts[1].cache and "m1" not in sim.insts[0].cache
    done_at, *_ = sim.events[0]
    assert done_at == EPOCH_MS + 1000
    assert sim.result.disk_loads == 1 and sim.result.pulls == 0


def test_without_a_tier_placement_ignores_disks_and_every_load_pulls() -> None:
    sim = two_instances(disk_units=0)
    sim._publish(EPOCH_MS, force=True)
    view = ClusterView("i000", EPOCH_MS, sim.views)
    assert {sim._load_target(view, m, frozenset()).target for m in range(1, 20)} == {"i000", "i001"}  # type: ignore[union-attr]
    sim._request(EPOCH_MS, 1, sim.insts[0])
    done_at, *_ = sim.events[0]
    assert done_at == EPOCH_MS + 1000 + 2000  # the load and the pull before it
    assert sim.result.pulls == 1 and sim.result.disk_loads == 0


def test_the_disk_keeps_pulled_files_within_its_budget_and_a_reload_skips_the_pull() -> None:
    sim = two_instances(disk_units=2 * UNITS)
    inst = sim.insts[0]
    assert sim._pull(inst, 1, EPOCH_MS) == 2000
    assert sim._pull(inst, 2, EPOCH_MS + 1) == 2000
    assert sim._pull(inst, 1, EPOCH_MS + 2) == 0  # on disk: no pull, and used now
    assert sim._pull(inst, 3, EPOCH_MS + 3) == 2000  # the budget holds two: m2 goes
    assert inst.disk is not None and {e.model_id for e in inst.disk.entries()} == {"m1", "m3"}
    assert (sim.result.pulls, sim.result.disk_loads) == (3, 1)


def small_zipf(seed: int = 1) -> Workload:
    cat = catalogue(200, random.Random(seed))
    return zipf(cat, 6000, 1.0, 20.0, seed=seed)


def test_with_a_disk_larger_than_the_catalogue_each_instance_pulls_a_model_once() -> None:
    wl = small_zipf()
    total = wl.catalogue.total_units
    rate = 2_000.0  # 0.5 GiB/s
    fleet = Fleet(4, max(1, total // 40), pull_ms_per_gib=rate, disk_units=total, seed=1)
    with_tier = simulate(wl, fleet, MESHD)
    distinct = len(set(wl.models))
    assert 0 < with_tier.pulls <= distinct * fleet.instances
    assert with_tier.disk_loads > with_tier.pulls  # most loads come from the disk
    without = simulate(wl, Fleet(4, max(1, total // 40), pull_ms_per_gib=rate, seed=1), MESHD)
    assert without.disk_loads == 0 and without.pulls >= without.loads
    assert with_tier.added_p99_ms < without.added_p99_ms


def test_meshd_places_by_the_disk_upstream_finds_files_only_by_chance() -> None:
    wl = small_zipf(2)
    total = wl.catalogue.total_units
    fleet = Fleet(4, max(1, total // 40), pull_ms_per_gib=2_000.0, disk_units=total // 10, seed=2)
    meshd, upstream = simulate(wl, fleet, MESHD), simulate(wl, fleet, UPSTREAM)
    assert meshd.pulls / meshd.loads < upstream.pulls / upstream.loads


def test_pulls_are_not_modelled_by_default() -> None:
    wl = small_zipf()
    r = simulate(wl, Fleet(4, max(1, wl.catalogue.total_units // 40), seed=1), MESHD)
    assert r.loads > 0 and r.pulls == r.disk_loads == 0


def test_a_pull_costs_its_size_at_the_rate() -> None:
    sim = two_instances(disk_units=0)
    assert sim.pull_ms[0] == pytest.approx(UNITS * 8192 / GIB * PULL_MS_PER_GIB)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"pull_ms_per_gib": -1.0}, "pull time per GiB"),
        ({"pull_ms_per_gib": float("nan")}, "pull time per GiB"),
        ({"disk_units": -1}, "disk budget"),
    ],
)
def test_a_bad_tier_is_refused(kw: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Fleet(2, 10, **kw)  # type: ignore[arg-type]


def test_the_command_line_compares_runs_with_and_without_the_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--preset", "zipf", "--models", "60", "--requests", "1500", "--instances", "3", "--no-plots"]
    assert main([*args, "--pull-mib-per-s", "500", "--disk-tier", "0,4", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "zipf.md").read_text()
    assert "pulls at 500 MiB/s" in text and "| pulls | from disk |" in text
    rows = [r.split("|") for r in text.splitlines() if r.startswith("| zipf |")]
    labels = {cells[3].strip() for cells in rows}
    assert {"meshd, no disk", "meshd, disk 4x", "upstream, no disk", "upstream, disk 4x"} <= labels
    for cells in rows:
        pulls, from_disk = int(cells[11]), int(cells[12])
        assert pulls > 0 and (from_disk == 0) == cells[3].strip().endswith("no disk")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*args, "--disk-tier", "4", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "--disk-tier needs --pull-mib-per-s" in capsys.readouterr().err
