"""Request streams for the simulator: model catalogues, synthetic workloads, CSV trace replay.

A `Workload` is a catalogue of models (size, mean load time, mean service time) and a
trace: request times (ms from the start, non-decreasing) with the model each one names.
Generators are deterministic for a seed and use only `random`. Synthetic catalogues give
each model a mean service time log-normal around 10 ms (sigma 0.5: most between 4 and 27 ms,
typical of small CPU models; the engine adds per-request jitter).

Synthetic workloads (all over a Zipf(alpha) popularity of the catalogue):
- `zipf`: independent requests (the independent reference model), Poisson arrivals.
- `shifting`: the popularity ranking is re-dealt for a fraction of the models every period.
- `bursts`: Zipf background plus bursts during which one cold model takes a share of traffic.
- `daily`: the arrival rate follows a daily cycle (compressed: `day_s` seconds per day).
- `new_models`: models arrive over time, each entering at the top of the ranking.
- `switching`: `zipf` for half the requests, then the whole ranking re-dealt every minute.
- `large_models`: its own catalogue (`large_catalogue`): under a hundred big models with
  10-40 s loads and 10-60 s service times, asked for in bursts (sessions) over weeks, the
  catalogue growing as it goes (issue 33's held-back trace, in shape).

CSV trace format (`read_csv`): one request per line, `timestamp,model_id[,size_bytes[,latency_ms]]`.
`timestamp` is in seconds (a float, any origin; lines need not be sorted); `size_bytes` is the
model's memory size (the first non-empty value for a model counts; default `default_size_bytes`);
`latency_ms` is the request's time on the runtime, which the simulator uses as service time
(averaged per model; default 10 ms; load times come from the size). A first line
whose timestamp is not a number is taken as a header. Blank lines and lines starting with `#`
are skipped.
"""

from __future__ import annotations

import bisect
import csv
import itertools
import math
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from meshd.decisions.cache import UNIT_BYTES, to_units

MIB = 1 << 20
DEFAULT_SIZE_BYTES = 64 * MIB
DEFAULT_SERVICE_MS = 10.0  # median of the models' mean service times (and a trace's default)
DEFAULT_SERVICE_SIGMA = 0.5
# Load time = fixed start-up + bytes at a read/initialise rate (typical of model servers on local disk).
LOAD_FIXED_MS = 500.0
LOAD_MS_PER_MIB = 5.0  # ~200 MiB/s


MAX_SPAN_S = 366 * 86400  # a replay longer than a year is more likely timestamps in ms than a trace
MAX_SIZE_BYTES = 1 << 50


class TraceError(ValueError):
    """A trace file that cannot be read (the message names the line)."""


@dataclass(frozen=True, slots=True)
class Catalogue:
    """The models a workload names, by index: ids, sizes in 8 KiB units, mean load/service ms."""

    ids: tuple[str, ...]
    units: tuple[int, ...]
    load_ms: tuple[float, ...]
    service_ms: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def total_units(self) -> int:
        return sum(self.units)


class Epoch(NamedTuple):
    """What the generator knew from request `start` on, until the next epoch: each model's
    request probability (`p`). The popularity oracle reads it (sim.single). Epochs share their
    `probs` where they can, so a long trace does not hold a catalogue-sized array per epoch:
    - `probs` by model (catalogue order), with `hot` (when >= 0) taking `share` of the requests
      on top of `probs` x (1 - share) (a burst);
    - with `newest` >= 0 (new-models), `probs` by rank: models 0..`newest` are present, model m
      at rank `newest` - m, each rank's weight times `scale`; later models are not there yet."""

    start: int
    probs: array[float]
    hot: int = -1
    share: float = 0.0
    newest: int = -1
    scale: float = 1.0

    def p(self, m: int) -> float:
        if self.newest >= 0:
            return self.probs[self.newest - m] * self.scale if m <= self.newest else 0.0
        base = self.probs[m] * (1.0 - self.share)
        return base + self.share if m == self.hot else base


def _next_epoch(epochs: list[Epoch], epoch: Epoch) -> None:
    """Append `epoch`, or replace the last one when it starts at the same request (a change
    before any request was drawn from the last one)."""
    if epochs and epochs[-1].start == epoch.start:
        epochs[-1] = epoch
    else:
        epochs.append(epoch)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    catalogue: Catalogue
    times_ms: array[int]  # request times, non-decreasing, from 0
    models: array[int]  # catalogue index per request
    popularity: tuple[Epoch, ...] = ()  # () when unknown (a trace)

    def __len__(self) -> int:
        return len(self.models)


def load_ms_for(size_bytes: int, mib_per_s: float = 1000.0 / LOAD_MS_PER_MIB) -> float:
    """Mean load time: the fixed start-up plus the bytes at `mib_per_s` (default ~200 MiB/s)."""
    return LOAD_FIXED_MS + 1000.0 * size_bytes / MIB / mib_per_s


def with_load_speed(cat: Catalogue, mib_per_s: float) -> Catalogue:
    """`cat` with every model's mean load time recomputed at `mib_per_s` from its size."""
    return replace(cat, load_ms=tuple(load_ms_for(u * UNIT_BYTES, mib_per_s) for u in cat.units))


def catalogue(
    n: int,
    rng: random.Random,
    size_mib: float = 64.0,
    size_sigma: float = 0.0,
    service_ms: float = DEFAULT_SERVICE_MS,
    service_sigma: float = DEFAULT_SERVICE_SIGMA,
) -> Catalogue:
    """`n` models with log-normal sizes (median `size_mib`; sigma 0: all the same size) and
    log-normal mean service times (median `service_ms`; 0: requests take no time)."""
    sizes = [int(size_mib * MIB * (math.exp(rng.gauss(0, size_sigma)) if size_sigma else 1.0)) for _ in range(n)]
    # Drawn after the sizes, so a seed gives the same sizes whatever the service times.
    service = [service_ms * (math.exp(rng.gauss(0, service_sigma)) if service_sigma else 1.0) for _ in range(n)]
    return Catalogue(
        ids=tuple(f"m{i:05d}" for i in range(n)),
        units=tuple(to_units(s) for s in sizes),
        load_ms=tuple(load_ms_for(s) for s in sizes),
        service_ms=tuple(service),
    )


def zipf_weights(n: int, alpha: float) -> list[float]:
    """Popularity of ranks 1..n under Zipf(alpha), normalised to sum to 1."""
    w = [1.0 / (i + 1) ** alpha for i in range(n)]
    total = sum(w)
    return [x / total for x in w]


def _cumulative(weights: Sequence[float]) -> list[float]:
    return list(itertools.accumulate(weights))


def _poisson_times(n: int, rate_rps: float, rng: random.Random) -> array[int]:
    t = 0.0
    out = array("q")
    mean_gap_ms = 1000.0 / rate_rps
    for _ in range(n):
        t += rng.expovariate(1.0) * mean_gap_ms
        out.append(int(t))
    return out


def zipf(cat: Catalogue, n_requests: int, alpha: float, rate_rps: float, seed: int = 0, name: str = "zipf") -> Workload:
    """Independent requests: each names model i with probability ~ 1/(i+1)^alpha."""
    rng = random.Random(seed)
    weights = zipf_weights(len(cat), alpha)
    models = array("q", rng.choices(range(len(cat)), cum_weights=_cumulative(weights), k=n_requests))
    return Workload(name, cat, _poisson_times(n_requests, rate_rps, rng), models, (Epoch(0, array("d", weights)),))


def shifting(
    cat: Catalogue,
    n_requests: int,
    alpha: float,
    rate_rps: float,
    period_s: float = 600.0,
    fraction: float = 0.2,
    seed: int = 0,
) -> Workload:
    """Zipf whose ranking changes: every `period_s`, `fraction` of the ranks are re-dealt."""
    rng = random.Random(seed)
    n = len(cat)
    weights = zipf_weights(n, alpha)
    cum = _cumulative(weights)
    rank_to_model = list(range(n))
    rng.shuffle(rank_to_model)
    times = _poisson_times(n_requests, rate_rps, rng)
    models = array("q")
    epochs = [Epoch(0, _by_model(weights, rank_to_model))]
    next_shift = period_s * 1000
    for t in times:
        shifted = t >= next_shift
        while t >= next_shift:
            picked = rng.sample(range(n), max(2, int(n * fraction)))
            moved = [rank_to_model[r] for r in picked]
            rng.shuffle(moved)
            for r, m in zip(picked, moved, strict=True):
                rank_to_model[r] = m
            next_shift += period_s * 1000
        if shifted:
            _next_epoch(epochs, Epoch(len(models), _by_model(weights, rank_to_model)))
        models.append(rank_to_model[bisect.bisect_left(cum, rng.random() * cum[-1])])
    return Workload("shifting", cat, times, models, tuple(epochs))


def _by_model(rank_weights: Sequence[float], rank_to_model: Sequence[int]) -> array[float]:
    out = array("d", [0.0]) * len(rank_weights)
    for r, m in enumerate(rank_to_model):
        out[m] = rank_weights[r]
    return out


def bursts(
    cat: Catalogue,
    n_requests: int,
    alpha: float,
    rate_rps: float,
    every_s: float = 120.0,
    length_s: float = 20.0,
    share: float = 0.3,
    seed: int = 0,
) -> Workload:
    """Zipf background; every `every_s` a cold model (from the tail) takes `share` of the
    requests for `length_s` (a batch job or a newly launched feature)."""
    rng = random.Random(seed)
    n = len(cat)
    weights = zipf_weights(n, alpha)
    cum = _cumulative(weights)
    times = _poisson_times(n_requests, rate_rps, rng)
    models = array("q")
    tail = range(n // 2, n)
    background = array("d", weights)
    epochs = [Epoch(0, background)]
    current, hot = -1, -1  # the burst the last epoch describes (-1: none), and its model
    for t in times:
        k = int(t // (every_s * 1000))
        in_burst = t - k * every_s * 1000 < length_s * 1000 and k > 0
        burst = k if in_burst else -1
        if burst != current:
            current = burst
            hot = tail[random.Random(seed * 7919 + k).randrange(len(tail))] if in_burst else -1
            _next_epoch(epochs, Epoch(len(models), background, hot, share if in_burst else 0.0))
        if in_burst and rng.random() < share:
            models.append(hot)
        else:
            models.append(bisect.bisect_left(cum, rng.random() * cum[-1]))
    return Workload("bursts", cat, times, models, tuple(epochs))


def daily(
    cat: Catalogue,
    n_requests: int,
    alpha: float,
    rate_rps: float,
    day_s: float = 1200.0,
    trough: float = 0.2,
    seed: int = 0,
) -> Workload:
    """Zipf requests whose rate follows a day: peak `rate_rps` at midday, `trough` x it at night
    (thinned Poisson; one day lasts `day_s` seconds of simulated time)."""
    rng = random.Random(seed)
    weights = zipf_weights(len(cat), alpha)
    cum = _cumulative(weights)
    times = array("q")
    t = 0.0
    mean_gap_ms = 1000.0 / rate_rps
    day_ms = day_s * 1000
    while len(times) < n_requests:
        t += rng.expovariate(1.0) * mean_gap_ms
        level = trough + (1 - trough) * 0.5 * (1 - math.cos(2 * math.pi * (t % day_ms) / day_ms))
        if rng.random() < level:
            times.append(int(t))
    models = array("q", rng.choices(range(len(cat)), cum_weights=cum, k=n_requests))
    return Workload("daily", cat, times, models, (Epoch(0, array("d", weights)),))


def new_models(
    cat: Catalogue,
    n_requests: int,
    alpha: float,
    rate_rps: float,
    start_fraction: float = 0.5,
    seed: int = 0,
) -> Workload:
    """Models arrive over the trace: `start_fraction` of the catalogue is there at the start,
    the rest arrive at even intervals, each at the top of the ranking (new releases are hot),
    pushing the older ones down."""
    rng = random.Random(seed)
    n = len(cat)
    start = max(1, int(n * start_fraction))
    times = _poisson_times(n_requests, rate_rps, rng)
    models = array("q")
    arrivals = n - start
    every = max(1, n_requests // (arrivals + 1))
    present = start
    cum = _cumulative(zipf_weights(present, alpha))
    by_rank = array("d", zipf_weights(n, alpha))
    below = _cumulative(by_rank)  # below[k - 1]: the weight of the top k ranks

    def epoch(at: int) -> Epoch:
        return Epoch(at, by_rank, newest=present - 1, scale=1.0 / below[present - 1])

    epochs = [epoch(0)]
    for i in range(n_requests):
        if arrivals and i and i % every == 0 and present < n:
            present += 1
            cum = _cumulative(zipf_weights(present, alpha))
            epochs.append(epoch(i))
        rank = bisect.bisect_left(cum, rng.random() * cum[-1])
        models.append(present - 1 - rank)  # the newest model holds rank 0
    return Workload("new-models", cat, times, models, tuple(epochs))


def switching(cat: Catalogue, n_requests: int, alpha: float, rate_rps: float, seed: int = 0) -> Workload:
    """Two regimes, one after the other (issue 44): `zipf` for the first half of the requests, where
    counting uses wins, then `shifting` with the whole ranking re-dealt every minute, where the
    popular set keeps turning over and recency wins."""
    first = zipf(cat, n_requests // 2, alpha, rate_rps, seed=seed)
    second = shifting(cat, n_requests - n_requests // 2, alpha, rate_rps, period_s=60.0, fraction=1.0, seed=seed + 1)
    offset = first.times_ms[-1] if len(first) else 0
    times = array("q", first.times_ms)
    times.extend(t + offset for t in second.times_ms)
    models = array("q", first.models)
    models.extend(second.models)
    later = tuple(e._replace(start=e.start + len(first)) for e in second.popularity)
    return Workload("switching", cat, times, models, first.popularity + later)


def read_csv(path: Path, default_size_bytes: int = DEFAULT_SIZE_BYTES) -> Workload:
    """A workload from a CSV trace (format in the module docstring). Raises TraceError."""
    rows: list[tuple[float, str]] = []
    sizes: dict[str, int] = {}
    latency: dict[str, list[float]] = {}
    first_data_line = True
    try:
        with path.open(newline="", encoding="utf-8") as f:
            for lineno, row in enumerate(csv.reader(f, strict=True), 1):
                if not row or not row[0].strip() or row[0].lstrip().startswith("#"):
                    continue
                header, first_data_line = first_data_line, False
                try:
                    ts = float(row[0])
                except ValueError:
                    if header:
                        continue  # a header (comment lines may come before it)
                    raise TraceError(f"{path}:{lineno}: timestamp {row[0]!r} is not a number") from None
                if len(row) < 2 or not row[1].strip():
                    raise TraceError(f"{path}:{lineno}: missing model id")
                if not math.isfinite(ts):
                    raise TraceError(f"{path}:{lineno}: timestamp {row[0]!r} is not finite")
                mid = row[1].strip()
                rows.append((ts, mid))
                if len(row) > 2 and row[2].strip() and mid not in sizes:
                    size = _positive(row[2], path, lineno, "size_bytes")
                    if size > MAX_SIZE_BYTES:
                        raise TraceError(f"{path}:{lineno}: size_bytes {row[2]!r} is over 1 PiB")
                    sizes[mid] = int(size)
                if len(row) > 3 and row[3].strip():
                    latency.setdefault(mid, []).append(_positive(row[3], path, lineno, "latency_ms"))
    except OSError as e:
        raise TraceError(f"cannot read {path}: {e}") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except csv.Error as e:
        raise TraceError(f"{path}: not CSV: {e}") from None
    if not rows:
        raise TraceError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    span_s = rows[-1][0] - rows[0][0]
    if span_s > MAX_SPAN_S:
        raise TraceError(
            f"{path}: the trace spans {span_s / 86400:.0f} days; at most {MAX_SPAN_S // 86400} (timestamps are seconds)"
        )
    index: dict[str, int] = {}
    for _, mid in rows:
        index.setdefault(mid, len(index))
    ids = tuple(index)
    size_of = [sizes.get(m, default_size_bytes) for m in ids]
    cat = Catalogue(
        ids=ids,
        units=tuple(to_units(s) for s in size_of),
        load_ms=tuple(load_ms_for(s) for s in size_of),
        service_ms=tuple(sum(latency[m]) / len(latency[m]) if m in latency else DEFAULT_SERVICE_MS for m in ids),
    )
    t0 = rows[0][0]
    times = array("q", (int((ts - t0) * 1000) for ts, _ in rows))
    models = array("q", (index[mid] for _, mid in rows))
    return Workload(path.stem, cat, times, models)


def _positive(text: str, path: Path, lineno: int, column: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"{path}:{lineno}: {column} {text!r} is not a number") from None
    if not value > 0 or not math.isfinite(value):
        raise TraceError(f"{path}:{lineno}: {column} must be a positive number (got {text!r})")
    return value


def write_csv(workload: Workload, path: Path) -> None:
    """Write `workload` in the trace format (for replay, or another simulator)."""
    cat = workload.catalogue
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["timestamp", "model_id", "size_bytes", "latency_ms"])
        for t, m in zip(workload.times_ms, workload.models, strict=True):
            w.writerow([f"{t / 1000:.3f}", cat.ids[m], cat.units[m] * 8192, f"{cat.service_ms[m]:g}"])


# The large-models preset (issue 33): the shape of a held-back public trace of big models.
LARGE_MODELS = 80
LARGE_PRESENT_AT_START = 0.5  # the rest arrive evenly over the trace
LARGE_SIZE_MIB = 16_384.0  # median; log-normal sigma 0.3 (a third of an instance at 10 %, 3 instances)
LARGE_SIZE_SIGMA = 0.3
LARGE_LOAD_MS = (10_000.0, 40_000.0)  # by size: the smallest model loads in 10 s, the largest in 40 s
LARGE_SERVICE_MS = (10_000.0, 60_000.0)  # each model's mean, log-uniform
LARGE_SESSIONS_PER_DAY = 600.0  # bursts of requests for one model (a user, a batch job)
LARGE_SESSION_REQUESTS = 3.0  # mean requests per session (geometric)
LARGE_SESSION_GAP_MS = 30_000.0  # mean gap between a session's requests (exponential)
LARGE_NEWEST_SHARE = 0.3  # of sessions, the share that go to one of the newest models
LARGE_NEWEST = 4
DAY_MS = 86_400_000


def large_catalogue(rng: random.Random, n: int = LARGE_MODELS) -> Catalogue:
    """`n` big models: log-normal sizes around 16 GiB, load times from 10 s (the smallest)
    to 40 s (the largest) by size, mean service times log-uniform over 10-60 s."""
    sizes = [int(LARGE_SIZE_MIB * MIB * math.exp(rng.gauss(0, LARGE_SIZE_SIGMA))) for _ in range(n)]
    low, high = min(sizes), max(sizes)
    lo_ms, hi_ms = LARGE_LOAD_MS
    load = [lo_ms + (hi_ms - lo_ms) * (s - low) / max(1, high - low) for s in sizes]
    s_lo, s_hi = (math.log(x) for x in LARGE_SERVICE_MS)
    service = [math.exp(rng.uniform(s_lo, s_hi)) for _ in range(n)]
    return Catalogue(
        ids=tuple(f"large{i:03d}" for i in range(n)),
        units=tuple(to_units(s) for s in sizes),
        load_ms=tuple(load),
        service_ms=tuple(service),
    )


def large_models(n_requests: int, alpha: float, seed: int = 0) -> Workload:
    """Sessions of requests for one model at a time, over weeks (`LARGE_SESSIONS_PER_DAY`, more
    by day than by night), each `LARGE_SESSION_REQUESTS` requests on average `LARGE_SESSION_GAP_MS`
    apart; a session picks one of the `LARGE_NEWEST` newest models with `LARGE_NEWEST_SHARE`,
    else a model by Zipf(alpha) over those present (a fixed random ranking). Half the catalogue
    is there at the start, the rest arrive evenly until the trace ends."""
    rng = random.Random(seed)
    cat = large_catalogue(random.Random(seed * 31 + 1))
    n = len(cat)
    start = max(1, int(n * LARGE_PRESENT_AT_START))
    mean_gap_ms = DAY_MS / LARGE_SESSIONS_PER_DAY
    ranking = list(range(n))
    rng.shuffle(ranking)
    requests: list[tuple[int, int]] = []
    t = 0.0
    while len(requests) < n_requests:
        t += rng.expovariate(1.0) * mean_gap_ms
        day = 0.5 * (1 - math.cos(2 * math.pi * (t % DAY_MS) / DAY_MS))  # 0 at midnight, 1 at noon
        if rng.random() > 0.3 + 0.7 * day:  # thinned: nights have about a third of the sessions
            continue
        present = min(n, start + (n - start) * len(requests) // n_requests)
        if rng.random() < LARGE_NEWEST_SHARE:
            model = present - 1 - rng.randrange(min(LARGE_NEWEST, present))
        else:
            order = [m for m in ranking if m < present]
            weights = zipf_weights(len(order), alpha)
            model = order[bisect.bisect_left(_cumulative(weights), rng.random())]
        at = t
        for _ in range(1 + int(rng.expovariate(1.0 / (LARGE_SESSION_REQUESTS - 1)))):
            requests.append((int(at), model))
            at += rng.expovariate(1.0) * LARGE_SESSION_GAP_MS
    requests.sort()
    requests = requests[:n_requests]
    times = array("q", (r[0] for r in requests))
    models = array("q", (r[1] for r in requests))
    return Workload("large-models", cat, times, models)
