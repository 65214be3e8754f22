"""The Azure Functions 2019 converter (`sim.azure`): a small trace in its format, the real one
when the checkout has it, and its errors."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from sim import azure
from sim.__main__ import main
from sim.workloads import MIB, TraceError

REPO = Path(__file__).resolve().parents[2]
# Beside the checkout (../shared), or beside a worktree's folder.
PLACES = [p / "shared/traces/azure-functions-2019" for p in (REPO.parent, REPO.parents[1])]
REAL = next((p for p in PLACES if p.is_dir()), PLACES[0])


def test_minutes_become_requests_functions_models_and_windows_cut_the_minutes(tmp_path: Path) -> None:
    azure.write_sample(tmp_path, functions=20, minutes_=12, seed=3)
    whole = azure.read(tmp_path, seed=1)
    # Every count becomes that many requests inside its minute; sorted, from 0.
    with gzip.open(tmp_path / azure.INVOCATIONS, "rt") as f:
        rows = [line.strip().split(",") for line in f][1:]
    assert len(whole) == sum(int(c) for r in rows for c in r[3:])
    assert list(whole.times_ms) == sorted(whole.times_ms) and whole.times_ms[0] == 0
    assert whole.times_ms[-1] < 12 * azure.MINUTE_MS
    # Sizes: the app's memory x 10 (f0000 and f0001 share app a0: 100 MB, f0002 is a1's: 200);
    # the app of f0019 has no row in mem.csv.gz and gets the median app's memory (100 MB).
    cat = whole.catalogue
    units = dict(zip(cat.ids, cat.units, strict=True))
    assert units["f0000"] == units["f0001"] == units["f0019"] == 100 * 10 * MIB // 8192
    assert units["f0002"] == 200 * 10 * MIB // 8192
    service = dict(zip(cat.ids, cat.service_ms, strict=True))
    assert service["f0000"] == azure.SERVICE_CAP_MS and service["f0001"] == 5  # 3005 ms capped at 2 s
    # A 3-minute window: only its minutes' invocations, only the functions invoked in it.
    first = azure.read(tmp_path, window=1, window_hours=0.05, seed=1)
    assert len(first) == sum(int(c) for r in rows for c in r[3:6])
    assert set(first.catalogue.ids) == {r[0] for r in rows if any(int(c) for c in r[3:6])}
    assert first.name == "azure-functions-0.05h-1"
    # Seeded: the same seed, the same arrival times.
    assert azure.read(tmp_path, seed=1).times_ms == whole.times_ms != azure.read(tmp_path, seed=2).times_ms


def test_bad_traces_and_windows_are_trace_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        azure.read(tmp_path / "absent")
    azure.write_sample(tmp_path, functions=4, minutes_=6)
    with pytest.raises(TraceError, match="starts past its 6 minutes"):
        azure.read(tmp_path, window=3, window_hours=0.05)
    (tmp_path / azure.DURATIONS).write_bytes(b"not gzip")
    with pytest.raises(TraceError, match="cannot read"):
        azure.read(tmp_path)


def test_the_command_line_replays_windows_and_refuses_bad_ones(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    azure.write_sample(trace, functions=30, minutes_=360, seed=1)
    out = tmp_path / "out"
    argv = ["--azure", str(trace), "--instances", "2", "--policies", "upstream,meshd", "--no-plots"]
    assert main([*argv, "--azure-windows", "all,2", "--capacities", "0.3", "--out", str(out)]) == 0
    assert "| azure-functions | 30% | meshd |" in (out / "azure-functions.md").read_text()
    assert "| azure-functions-3h-2 | 30% | upstream |" in (out / "azure-functions-3h-2.md").read_text()
    for bad in (["--azure-windows", "0"], ["--azure-windows", "3"], ["--trace", str(trace)]):
        with pytest.raises(SystemExit) as e:
            main([*argv, *bad, "--out", str(out)])
        assert e.value.code == 2


@pytest.mark.skipif(not REAL.is_dir(), reason=f"the Azure Functions trace is not in this checkout ({REAL})")
def test_the_real_trace_reads_as_its_readme_says() -> None:
    wl = azure.read(REAL, window=1, window_hours=0.25, seed=1)  # its first quarter hour
    sizes = sorted(wl.catalogue.units)
    median_gib = sizes[len(sizes) // 2] * 8192 / (1 << 30)
    assert 500 < len(wl.catalogue) <= 1350 and 5_000 < len(wl) < 30_000
    assert 1.0 < median_gib < 2.0  # the README: median ~1.4 GiB
    assert max(wl.catalogue.service_ms) <= azure.SERVICE_CAP_MS and wl.times_ms[-1] < 15 * azure.MINUTE_MS
