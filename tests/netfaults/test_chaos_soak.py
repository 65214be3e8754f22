"""The chaos soak (`bench/chaos_soak.py`, issue 34) for three minutes with a fixed seed: random
faults one after another (instances and runtimes killed, restarted and frozen, etcd stopped,
killed, restarted and stalled, partitions, a slow lossy link) under checked traffic. No
timing thresholds here (those are the bench's): every answer right, no record lost or
changed, and no request failed that no fault excuses (its ingress hit, or a partition not yet
noticed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshd.testing.netns import LabUnavailable, NetLab

BENCH = Path(__file__).resolve().parent.parent.parent / "bench" / "chaos_soak.py"
SEED = 144  # its first faults: a frozen meshd, a partition, etcd stopped, a runtime killed, etcd killed
MINUTES = 3

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_three_minutes_of_random_faults_lose_nothing_and_fail_only_what_a_fault_excuses(tmp_path: Path) -> None:
    try:
        NetLab.check_available()
    except LabUnavailable as e:
        pytest.skip(str(e))
    out = tmp_path / "soak.json"
    argv = [sys.executable, str(BENCH), "--minutes", str(MINUTES), "--seed", str(SEED), "--json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=540)
    print(proc.stdout)
    assert out.exists(), f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["wrong_answers"] == 0, result
    assert result["records_lost"] == [], result
    assert result["failed_not_excused"] == 0, result["not_excused_examples"]
    assert sum(result["faults"].values()) >= 4 and result["requests"] > 1000, result
    assert proc.returncode == 0, proc.stdout[-3000:]
