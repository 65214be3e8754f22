"""bench/peers.py: its command line, its meshd side end to end, and its Ray side (the Ray venv
built on first use, as the other third-party venvs are: about 500 MB from PyPI, a minute here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
BENCH = BENCH_DIR / "peers.py"
sys.path.insert(0, str(BENCH_DIR))

import peers  # noqa: E402 - bench/ is not a package


def test_defaults_and_quick() -> None:
    a = peers.parse_args([])
    systems = ["meshd", "meshd-lru", "ray", "ray-grpc"]
    assert (a.models, a.cache_models, a.concurrency, a.system_list) == (300, 16, 16, systems)
    # Equal footing by default: one load at a time per serving process (Ray's multiplex lock),
    # models of one size (a count and bytes are the same capacity), medians of three runs.
    assert (a.meshd_loading_threads, a.model_sizes, a.runs) == (1, "equal", 3)
    q = peers.parse_args(["--quick", "--systems", "meshd"])
    assert (q.models, q.cache_models, q.kill_requests, q.system_list, q.runs) == (40, 4, 0, ["meshd"], 1)
    assert peers.parse_args(["--quick", "--requests", "77"]).requests == 77


@pytest.mark.parametrize(
    "argv",
    [
        ["--systems", "meshd,triton"],
        ["--systems", ""],
        ["--requests", "0"],
        ["--kill-requests", "5"],
        ["--meshd-loading-threads", "-1"],
    ],
)
def test_bad_arguments_exit_with_usage(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        peers.parse_args(argv)
    assert info.value.code == 2


def test_workload_is_seeded_and_the_same_for_both_clients(tmp_path: Path) -> None:
    a = peers.parse_args(["--quick"])
    w1 = peers.build_workload(tmp_path / "a", a)
    w2 = peers.build_workload(tmp_path / "b", a)
    assert [p.model_id for p in w1.traces["zipf"]] == [p.model_id for p in w2.traces["zipf"]]
    assert w1.models == w2.models
    m = w1.models["model-0003"]
    assert m.bias[0] == 3.0 and m.hold_memory and m.size_bytes == 8 << 20
    assert {x.size_bytes for x in w1.models.values()} == {8 << 20}
    drawn = peers.build_workload(tmp_path / "c", peers.parse_args(["--quick", "--model-sizes", "drawn"]))
    assert len({x.size_bytes for x in drawn.models.values()}) > 1
    assert all(2 << 20 <= (x.size_bytes or 0) <= 32 << 20 for x in drawn.models.values())
    # The same draws otherwise: the size, and the load time that follows from it, differ.
    assert [x.service_ms for x in drawn.models.values()] == [x.service_ms for x in w1.models.values()]
    assert 2.0 <= m.service_ms <= 8.0 and m.load_ms > 0
    assert len(w1.traces["shift"]) == a.requests


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), *argv], capture_output=True, text=True, timeout=300)


def _rows(stdout: str) -> dict[tuple[str, str], list[str]]:
    rows = {}
    for line in stdout.splitlines():
        f = line.split()
        if len(f) > 10 and f[0] in ("zipf", "shift") and f[1] in peers.SYSTEMS:
            rows[(f[0], f[1])] = f
    return rows


@pytest.mark.slow
def test_meshd_side_quick() -> None:
    # Two loading threads: --quick's 4 models per process are so load-bound that one thread
    # refuses cold misses under pressure (RESOURCE_EXHAUSTED, by design); this checks the bench.
    argv = ["--quick", "--systems", "meshd,meshd-lru", "--kill-requests", "60", "--meshd-loading-threads", "2"]
    proc = _run(argv)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    rows = _rows(proc.stdout)
    for trace in ("zipf", "shift"):
        for system in ("meshd", "meshd-lru"):
            row = rows[(trace, system)]
            assert row[8] == "0" and row[9] == "0", row  # errors, wrong answers
            assert int(row[6]) > 0, row  # loads happened
    assert "kill run:" in proc.stdout
    assert "meshd eviction default (rate-capped), meshd-lru lru" in proc.stdout


@pytest.mark.slow
def test_ray_side_quick() -> None:
    from meshd.testing.venvs import ensure_venv

    ensure_venv("ray-serve", [f"ray[serve]=={peers.RAY_VERSION}"])  # before the run's own 300 s
    proc = _run(["--quick", "--systems", "ray,ray-grpc"])  # Serve's HTTP ingress, then its gRPC one
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    rows = _rows(proc.stdout)
    for trace in ("zipf", "shift"):
        for system in ("ray", "ray-grpc"):
            row = rows[(trace, system)]
            assert row[8] == "0" and row[9] == "0", row
            assert int(row[6]) > 0, row  # loads happened
