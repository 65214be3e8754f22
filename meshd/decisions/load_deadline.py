"""When a load is cut: the runtime's loading timeout, not counting the time its model's pull took.

Upstream (and meshd before) gave `loadModel` one deadline, the runtime's
`modelLoadingTimeoutMs` (90 s by default), and the adapter pulls the model inside that call,
so a big model on a slow link failed however steadily it downloaded (modelmesh-serving#219:
the advice was to raise the timeout for every model). meshd counts only the time the load
spends outside the pull: while the runtime's disk tier (`meshd.disk.DiskTier`) lists the
model's pull as running, the load is not cut, and once the pull ends the load may take the
timeout on top of the pull's length. A pull that stops moving is the storage helper's to fail
(`MESHD_PULL_STALL_MS`); `longest_ms` (`MESHD_PULL_DEADLINE_MS`) bounds a load however its pull
goes, so a store trickling a byte a minute cannot hold a loading thread for ever.

No I/O: the caller polls the runtime and cancels the call.
"""

from __future__ import annotations

from dataclasses import dataclass

PULL_POLL_MS = 2_000  # how often a load on a runtime with a disk tier asks how its pull goes
DEFAULT_PULL_DEADLINE_MS = 2 * 3_600_000  # MESHD_PULL_DEADLINE_MS: a load pulling, at the longest


@dataclass(frozen=True, slots=True)
class PullSeen:
    """What the load has seen of its model's pull: how long it ran (the running pull's elapsed
    time, then the finished pull's own length) and whether it is running still."""

    pulled_ms: int = 0
    running: bool = False


def load_cut_at_ms(timeout_ms: int, longest_ms: int, seen: PullSeen, elapsed_ms: int, poll_ms: int) -> int:
    """The time since the load's start at which to cut it: `timeout_ms` plus the time its pull
    took; while the pull runs, never before the next poll (`elapsed_ms` + `poll_ms`); never
    after `longest_ms` (nor before `timeout_ms`, should `longest_ms` be set below it)."""
    allowed = timeout_ms + max(0, seen.pulled_ms)
    if seen.running:
        allowed = max(allowed, elapsed_ms + poll_ms)
    return max(timeout_ms, min(allowed, longest_ms))


def pull_seen(before: PullSeen, running_ms: int | None, finished_ms: int | None) -> PullSeen:
    """The pull after one look at the disk tier: `running_ms`, its elapsed time when listed as
    running; else `finished_ms`, the pull length the tier lists for the model. A finished pull
    counts only if this load saw it running (a model found on disk was pulled by another load)."""
    if running_ms is not None:
        return PullSeen(max(before.pulled_ms, running_ms), True)
    if before.running:
        return PullSeen(max(before.pulled_ms, finished_ms or 0), False)
    return before
