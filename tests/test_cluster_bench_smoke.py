"""The cluster-load benchmark runs end to end (no throughput thresholds: those belong in bench/)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "cluster_load.py"


@pytest.mark.slow
def test_cluster_load_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.split()}
    for scenario, instances in (("mesh", "3"), ("single", "1")):
        assert scenario in rows, f"no row for {scenario}:\n{proc.stdout}"
        row = rows[scenario]
        assert row[1] == instances, row
        # columns: scenario inst cached req/s hit% no-load% loads evict errors wrong ...
        assert row[8] == "0" and row[9] == "0", f"{scenario} had errors or wrong answers: {row}"
    assert rows["single"][12] == "0.0", "one instance cannot forward to a peer"
    assert "summary:" in proc.stdout


@pytest.mark.slow
def test_cluster_load_open_loop_prints_one_row_per_queue_and_rate() -> None:
    argv = [sys.executable, str(BENCH), "--rates", "5", "--seconds", "4", "--models", "24", "--cache-models", "4"]
    argv += ["--load-delay-ms", "100", "--load-queue", "value,fifo"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    by_queue = {r[0]: r for r in rows[1:]}  # after the header row (the rule line starts "| ---")
    assert set(by_queue) >= {"value", "fifo"}, proc.stdout
    for queue in ("value", "fifo"):
        row = by_queue[queue]
        assert row[1] == "5" and int(row[2]) > 0, row  # rate, requests
        assert row[8].strip() in ("0", ""), f"{queue}: failures other than RESOURCE_EXHAUSTED: {row}"
