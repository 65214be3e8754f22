"""`python -m sim`: a tiny run writes its table and plots; bad arguments are one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sim.__main__ import main, presets


def test_tiny_run_writes_table_and_replays_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "res"
    args = ["--preset", "bursts", "--models", "50", "--requests", "1500", "--instances", "3"]
    assert main([*args, "--capacities", "0.2,0.4", "--out", str(out), "--compare-libcachesim"]) == 0
    text = (out / "bursts.md").read_text()
    assert "| bursts | 20% | upstream |" in text and "| bursts | 40% | meshd |" in text
    assert "total p99 ms" in text
    assert "meshd GDSF" in text and "Belady (own)" in text  # --compare-libcachesim
    assert text.count("| popularity oracle (anchor) |") == 2  # hit ratio and load-seconds tables
    assert "load-seconds spent on misses" in text and "| LFU, perfect memory (anchor) |" in text
    # Goal 1 beside its anchors: each fleet policy and one cache's misses, each against upstream.
    head = next(row for row in text.splitlines() if row.startswith("| capacity | upstream (fleet) |"))
    assert "| one cache: popularity oracle (anchor) |" in head
    against = [row for row in text.splitlines() if row.startswith(("| 20% | ", "| 40% | "))]
    assert len(against) == 2 and all(row.count(" %)") == head.count("|") - 3 for row in against)
    assert main([*args, "--max-concurrency", "1", "--service-ms", "50", "--out", str(out), "--no-plots"]) == 0
    gated = [row.split("|") for row in (out / "bursts.md").read_text().splitlines() if row.startswith("| bursts |")]
    assert gated and any(int(cells[9]) > 0 for cells in gated)  # one slot per copy: some requests queued
    trace = tmp_path / "t.csv"
    trace.write_text("".join(f"{i * 0.5},m{i % 7},{(1 + i % 3) << 20},5\n" for i in range(300)))
    assert main(["--trace", str(trace), "--instances", "2", "--out", str(out), "--no-plots"]) == 0
    assert "| t | 10% | random |" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policies", "lfu"], "unknown policy 'lfu'"),
        (["--capacities", "0"], "capacities are shares of the catalogue"),
        (["--requests", "many"], "expected a whole number"),
        (["--trace", "/nonexistent/t.csv"], "cannot read /nonexistent/t.csv"),
        (["--max-concurrency", "-1"], "must be 0 or more"),
        (["--service-ms", "nan"], "must be 0 or more"),
        (["--max-queue", "2.5"], "expected a whole number"),
        (["--alpha", "1000"], "--alpha must be in (0, 10]"),
        (["--alpha", "inf"], "--alpha must be in (0, 10]"),
        (["--size-sigma", "nan"], "--size-sigma must be in [0, 3]"),
        (["--size-sigma", "50"], "--size-sigma must be in [0, 3]"),
        (["--preset", "zipf,flat"], "unknown preset 'flat'"),
        (["--preset", ","], "expected presets"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "sim", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_the_large_models_preset_runs_on_three_instances_with_a_client_deadline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "res"
    args = ["--preset", "large-models", "--requests", "600", "--capacities", "0.1", "--policies", "upstream,meshd"]
    assert main([*args, "--client-timeout-s", "600", "--out", str(out), "--no-plots"]) == 0
    text = (out / "large-models.md").read_text()
    assert "3 instances" in text and "a 600 s client deadline" in text
    assert "| large-models | 10% | upstream |" in text and "| large-models | 10% | meshd |" in text
    assert main([*args, "--instances", "2", "--out", str(out), "--no-plots"]) == 0
    assert "2 instances" in (out / "large-models.md").read_text()


def test_presets_are_named_in_a_list_or_all() -> None:
    assert presets("daily, zipf,daily") == ["daily", "zipf"]  # in the order given, each once
    every = presets("all")
    assert every[:5] == ["zipf", "shifting", "bursts", "daily", "new-models"] and "large-models" in every
    assert presets("zipf,all") == ["zipf", *(n for n in every if n != "zipf")]
