"""The scale benchmark and the soak run end to end with tiny sizes (no thresholds: those belong in bench/)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.slow
def test_scale_quick() -> None:
    out = run("scale.py", "--quick", "--models", "200", "--seconds", "1").stdout
    for figure in (
        "start-up to ready, empty registry:",
        "start-up to ready, 200 records:",
        "registration via API:",
        "direct etcd CAS creates:",
        "tracemalloc, Table mirror in-process:",
        "watch propagation:",
    ):
        assert figure in out, f"no {figure!r} in:\n{out}"
    # Every update reached every instance's mirror (its watch trace).
    seen = [line.split()[1] for line in out.splitlines() if line.startswith("  scale-")]
    assert seen == ["200"] * 3, out
    assert "summary: ok" in out


@pytest.mark.slow
def test_soak_briefly() -> None:
    out = run("soak.py", "--minutes", "0.1", "--models", "12", "--cache-models", "3", "--concurrency", "4").stdout
    assert "errors: 0" in out, out
    assert "summary: ok" in out
    assert out.count("MB/hour over the run") == 3, out
    for figure in ("throughput:", "management:", "mesh:"):
        assert figure in out, out
