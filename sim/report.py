"""Tables and plots of simulator results (plots need matplotlib, an optional dependency)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from sim.engine import Result


def table(rows: Sequence[tuple[str, float, Result]]) -> str:
    """A markdown table: one row per (workload, capacity share, result). Added latency is
    what meshd adds (load and gate waits, hops); total adds the service time; failed
    includes requests every copy's full gate refused (RESOURCE_EXHAUSTED) and misses the load
    queue refused; late (only with a client deadline): served after it; pulls and from disk
    (only when pulls are modelled): loads that pulled their files, and loads that found them
    on the instance's disk tier."""
    late = any(r.late for _, _, r in rows)
    pulls = any(r.pulls or r.disk_loads for _, _, r in rows)
    lines = [
        "| workload | capacity | policy | hit ratio | loads | loads/min | added p99 ms | total p99 ms | queued "
        "| failed |" + (" late |" if late else "") + (" pulls | from disk |" if pulls else ""),
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        + (" ---: |" if late else "")
        + (" ---: | ---: |" if pulls else ""),
    ]
    for workload, share, r in rows:
        lines.append(
            f"| {workload} | {share:.0%} | {r.policy} | {r.hit_ratio:.3f} | {r.loads} | {r.loads_per_min:.1f} "
            f"| {r.added_p99_ms:.0f} | {r.total_p99_ms:.0f} | {r.queued} | {r.failed} |"
            + (f" {r.late} |" if late else "")
            + (f" {r.pulls} | {r.disk_loads} |" if pulls else "")
        )
    return "\n".join(lines)


def sweep_table(workload: str, rows: Sequence[tuple[float, float, Result]]) -> str:
    """A markdown table of a rate sweep: one row per (capacity share, rate, result). Hot p99:
    the added p99 of requests for the hottest 10 % of models; refused at once: misses the load
    queue refused on arrival (RESOURCE_EXHAUSTED); after waiting: failures more than 1 s
    after arrival (a displaced or timed-out load, or no room)."""
    lines = [
        "| workload | capacity | rate | policy | hit ratio | hot p99 ms | added p99 ms | failed "
        "| refused at once | failed after waiting | loads |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for share, rate, r in rows:
        lines.append(
            f"| {workload} | {share:.0%} | {rate:g} | {r.policy} | {r.hit_ratio:.3f} | {r.hot_added_p99_ms:.0f} "
            f"| {r.added_p99_ms:.0f} | {r.failed} | {r.failed - r.failed_slow} | {r.failed_slow} | {r.loads} |"
        )
    return "\n".join(lines)


def single_table(capacities: Sequence[float], values: dict[str, list[float]], fmt: str = "{:.3f}") -> str:
    """A markdown table of single-cache figures: one row per algorithm, one column per capacity."""
    head = "| algorithm | " + " | ".join(f"{c:.0%}" for c in capacities) + " |"
    lines = [head, "| --- |" + " ---: |" * len(capacities)]
    for name, row in values.items():
        lines.append(f"| {name} | " + " | ".join(fmt.format(v) for v in row) + " |")
    return "\n".join(lines)


def against_upstream(
    capacities: Sequence[float], fleet: Sequence[tuple[float, Result]], one_cache: dict[str, list[int]]
) -> str:
    """Issue 20's goal 1 beside its anchors: at each capacity, every fleet policy's loads and
    one cache's misses (`one_cache`: name -> misses per capacity), each against upstream's
    fleet. Empty without an upstream run at every capacity."""
    runs = {(share, r.policy): r for share, r in fleet}
    if any((c, "upstream") not in runs for c in capacities):
        return ""
    policies = [p for p in dict.fromkeys(r.policy for _, r in fleet) if p != "upstream"]
    names = [*(f"{p} (fleet)" for p in policies), *(f"one cache: {n}" for n in one_cache)]
    lines = ["| capacity | upstream (fleet) | " + " | ".join(names) + " |", "| --- |" + " ---: |" * (len(names) + 1)]
    for i, c in enumerate(capacities):
        base = runs[(c, "upstream")].loads
        counts = [runs[(c, p)].loads for p in policies] + [v[i] for v in one_cache.values()]
        lines.append(f"| {c:.0%} | {base} | " + " | ".join(f"{n} ({_change(n, base)})" for n in counts) + " |")
    return "\n".join(lines)


def _change(n: int, base: int) -> str:
    return f"{100 * (n / base - 1):+.1f} %" if base else "n/a"


def plots(name: str, rows: Sequence[tuple[str, float, Result]], out: Path) -> list[Path]:
    """PNGs: hit ratio vs capacity and added-latency p99 vs capacity per policy, and loads per
    minute over time per policy (at the middle capacity). Empty if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    by_policy: dict[str, list[tuple[float, Result]]] = {}
    for _, share, r in rows:
        by_policy.setdefault(r.policy, []).append((share, r))
    written: list[Path] = []
    metrics: tuple[tuple[str, str, Callable[[Result], float]], ...] = (
        ("hit_ratio", "hit ratio", lambda r: r.hit_ratio),
        ("p99", "added latency p99 (ms)", lambda r: r.added_p99_ms),
    )
    for metric, label, value in metrics:
        fig, ax = plt.subplots(figsize=(6, 4))
        for policy, points in by_policy.items():
            points.sort(key=lambda p: p[0])
            ax.plot([100 * s for s, _ in points], [value(r) for _, r in points], marker="o", label=policy)
        ax.set_xlabel("fleet capacity (% of the catalogue)")
        ax.set_ylabel(label)
        ax.set_title(f"{name}: {label}")
        ax.legend()
        path = out / f"{name}-{metric}.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, points in by_policy.items():
        share, r = points[len(points) // 2]
        ax.plot(range(len(r.loads_per_minute)), r.loads_per_minute, label=f"{policy} ({share:.0%})")
    ax.set_xlabel("minute")
    ax.set_ylabel("loads per minute")
    ax.set_title(f"{name}: loads per minute")
    ax.legend()
    path = out / f"{name}-loads.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    written.append(path)
    return written
