"""The proxy-overhead benchmark runs end to end (no timing thresholds: those belong in bench/)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "proxy_overhead.py"


@pytest.mark.slow
def test_proxy_overhead_smoke() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    rows = [line.split() for line in proc.stdout.splitlines()]
    for payload in ("100B", "1MiB"):
        for conc in ("1", "8", "64"):
            for target in ("direct", "bare", "meshd", "http"):
                assert any(r[:3] == [payload, conc, target] for r in rows), (
                    f"no row for {payload} c={conc} {target}:\n{proc.stdout}"
                )
    assert "summary:" in proc.stdout


@pytest.mark.slow
def test_native_floor_smoke(haproxy_path: str) -> None:
    """Every proxy row is printed with its two ratios, and no request failed through HAProxy."""
    proc = subprocess.run(
        [sys.executable, str(BENCH.parent / "native_floor.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    rows = {r[0]: r[1:] for r in (line.split() for line in proc.stdout.splitlines()) if r}
    for proxy in ("haproxy-bare", "meshd-rules", "meshd"):
        tiny, big, errors = rows[proxy]
        # stderr says what the first failed call got (once per case): the count alone says little
        assert float(tiny) > 0 and float(big) > 0 and errors == "0", f"{proc.stdout}\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("argv", [["--repeat", "0"], ["--duration", "0"], ["--duration", "nan"]])
def test_native_floor_refuses_bad_arguments_with_usage(argv: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH.parent / "native_floor.py"), *argv], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "error:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def run_bench(script: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """A simulator bench run to its end (2 minutes at most: a guard, not a timing check)."""
    proc = subprocess.run(
        [sys.executable, str(BENCH.parent / script), *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def test_hot_tail_bound_prints_both_allocations_per_capacity() -> None:
    proc = run_bench("hot_tail_bound.py", ["--requests", "5000", "--models", "200"])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    by = {(r[0], r[2]): r for r in rows[1:]}
    for share in ("5%", "10%"):
        popular, tail_first = by[(share, "popular first")], by[(share, "slow loads first")]
        # Holding every slow-loading hot model first leaves none of their requests to a slow load.
        assert tail_first[4] == "0.00%", proc.stdout
        # The bench's point: the best hit ratio is bought with hot requests left to slow loads.
        assert float(popular[3]) > float(tail_first[3]) and float(popular[4].rstrip("%")) > 0, proc.stdout


def test_sim_latency_target_prints_upstream_and_each_target_per_capacity() -> None:
    proc = run_bench("sim_latency_target.py", ["--requests", "3000", "--capacities", "0.1", "--targets", "0,1000"])
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines()[2:]]
    expected = [("10%", "upstream", "-"), ("10%", "meshd", "-"), ("10%", "meshd", "1000")]
    assert [(r[0], r[1], r[2]) for r in rows] == expected, proc.stdout
    assert rows[0][4] == "+0.0 %" and all(int(r[3]) > 0 for r in rows), proc.stdout


def test_peers_replay_prints_every_replay_for_both_traces() -> None:
    """Issue 36: the peers traces replayed by eviction order. Loads are counted after the
    warm-up, so each cell is at most the trace's requests and, on cold models, more than 0."""
    argv = ["--models", "40", "--cache-models", "4", "--requests", "200", "--warmup", "50", "--seeds", "2"]
    proc = run_bench("peers_replay.py", argv)
    rows = [
        [c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines() if line.startswith("| ")
    ]
    names = [r[0] for r in rows[1:]]
    assert names == [
        "simulator: meshd (rate-capped)",
        "simulator: meshd rate",
        "simulator: meshd lru",
        "simulator: meshd adaptive",
        "simulator: upstream",
        "order only: LRU of 4 per process, misses anywhere (Ray's multiplexing)",
        "order only: one LRU of 12",
    ], proc.stdout
    for row in rows[1:]:
        for cell in row[1:]:
            mean, spread = re.fullmatch(r"(\d+) \((\d+-\d+)\)", cell).groups()  # type: ignore[union-attr]
            low, high = (int(x) for x in spread.split("-"))
            assert 0 < low <= int(mean) <= high <= 200, proc.stdout


def test_sim_speed_prints_its_yardstick_and_each_run() -> None:
    # Goal 4's figure is read against the machine's speed, so the bench must print both.
    proc = run_bench("sim_speed.py", ["--requests", "4000", "--models", "300", "--instances", "3", "--rate", "20"])
    out = proc.stdout
    assert re.search(r"^yardstick before: \d+\.\d\d s of CPU", out, re.M), out
    assert re.search(r"^yardstick after: \d+\.\d\d s of CPU", out, re.M), out
    for mode in ("off", "on "):
        assert re.search(rf"^service time {mode}: 4000 requests, 3 instances, policy meshd: .*CPU \d", out, re.M), out
    assert out.count("failed 0;") == 2, out


@pytest.mark.parametrize(
    ("script", "argv"),
    [
        ("hot_tail_bound.py", ["--capacities", "0"]),
        ("hot_tail_bound.py", ["--alpha", "nan"]),
        ("hot_tail_bound.py", ["--alpha", "-1"]),
        ("sim_speed.py", ["--capacity", "nan"]),
        ("sim_speed.py", ["--rate", "nan"]),
        ("sim_speed.py", ["--loading-threads", "0"]),
        ("sim_speed.py", ["--rate", "inf"]),
        ("sim_admission.py", ["--rates", "abc"]),
        ("sim_admission.py", ["--capacities", "0"]),
        ("sim_admission.py", ["--requests", "-5"]),
        ("sim_latency_target.py", ["--targets", "soon"]),
        ("sim_latency_target.py", ["--targets", "-5"]),
        ("sim_latency_target.py", ["--capacities", "0"]),
        ("sim_eviction.py", ["--models", "0"]),
        ("sim_eviction.py", ["--alpha", "-1"]),
        ("peers_replay.py", ["--rate", "0"]),
        ("peers_replay.py", ["--zipf", "-1"]),
        ("peers_replay.py", ["--seeds", "0"]),
    ],
)
def test_simulator_benches_refuse_bad_arguments_with_usage(script: str, argv: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH.parent / script), *argv], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "error:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(2400)  # the first run builds the engines' venvs (llama.cpp compiles: ~9 min)
def test_llm_bench_smoke() -> None:
    """bench/llm.py runs end to end on both engines and prints every row."""
    proc = subprocess.run(
        [sys.executable, str(BENCH.parent / "llm.py"), "--smoke"], capture_output=True, text=True, timeout=2300
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    rows = [line.split() for line in proc.stdout.splitlines()]
    for model in ("tiny", "wide", "vllm-tiny"):
        assert any(r[:2] == ["cold", model] for r in rows), proc.stdout
        for conc in ("1", "8"):
            for path in ("direct", "meshd", "ratio"):
                assert any(r[:3] == [model, conc, path] for r in rows), f"no {model} c={conc} {path}:\n{proc.stdout}"
    assert any(r[:3] == ["relay", "added", "p50"] for r in rows), proc.stdout


@pytest.mark.slow
def test_llm_relay_bench_smoke() -> None:
    """bench/llm_relay.py drives the paced engine directly and through meshd, every row printed,
    no stream failed on either path."""
    proc = subprocess.run(
        [sys.executable, str(BENCH.parent / "llm_relay.py"), "--smoke"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    rows = {(r[0], r[1]): r for r in (line.split() for line in proc.stdout.splitlines()) if len(r) > 2}
    for streams in ("4", "16"):
        for path in ("direct", "meshd"):
            row = rows[(streams, path)]
            assert float(row[2]) > 0 and row[-1] == "0", f"{streams} {path}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
        assert float(rows[(streams, "ratio")][2]) > 0, proc.stdout


@pytest.mark.parametrize("argv", [["--runs", "0"], ["--pieces", "1"], ["--streams", "0"], ["--seconds", "0"]])
def test_llm_relay_bench_refuses_bad_arguments_with_usage(argv: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH.parent / "llm_relay.py"), *argv], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "error:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_llm_routing_bench_smoke() -> None:
    """bench/llm_routing.py routes through both fronts to the three copies, each row printed,
    every copy used and no call failed; the simulator's rows for the same calls follow."""
    proc = subprocess.run(
        [sys.executable, str(BENCH.parent / "llm_routing.py"), "--smoke"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    rows = {r[0]: r for r in (line.split() for line in proc.stdout.splitlines()) if r and r[0] in ("load", "inflight")}
    assert set(rows) == {"load", "inflight"}, proc.stdout
    for policy, row in rows.items():
        assert float(row[1]) > 0 and row[-1] == "0", f"{policy}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
        assert all(int(n) > 0 for n in row[4].split("/")), f"a copy unused ({policy}):\n{proc.stdout}"
    # The simulator's figures for the same calls, beside the real ones.
    simulated = {r[0] for r in (line.split() for line in proc.stdout.splitlines()) if r and r[0].startswith("sim:")}
    assert simulated == {"sim:load", "sim:inflight"}, proc.stdout


def test_eviction_moves_prints_the_gauge_before_and_after_the_switch() -> None:
    """Issue 44: the default order's overruled share on `switching`, one cell per seed."""
    proc = run_bench("eviction_moves.py", ["--seeds", "1,2", "--capacities", "0.2", "--requests", "20000"])
    rows = [
        [c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines() if line.startswith("| ")
    ]
    assert rows[0] == ["capacity", "seed 1", "seed 2"] and [r[0] for r in rows[2:]] == ["20%"], proc.stdout
    for text in rows[2][1:]:
        found = re.fullmatch(r"(\d\.\d\d) -> (\d\.\d\d); (\d+|-) / (\d+|-) min; ([+-]\d+\.\d) %", text)
        assert found, text
        before, after = float(found[1]), float(found[2])
        assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0


def test_eviction_moves_refuses_bad_arguments() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH.parent / "eviction_moves.py"), "--capacities", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--capacities" in proc.stderr
