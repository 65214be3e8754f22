"""The Azure Functions 2019 trace as a model-serving workload (`python -m sim --azure DIR`).

The trace (`../shared/traces/azure-functions-2019/`, README there: Shahrad et al., ATC '20,
CC-BY 4.0, the 1,350-function sample of vhive-serverless/invitro) counts each function's
invocations per minute. Read as a model cache, as that README suggests:
- a function is a model; its size is its app's `AverageAllocatedMb` x `SIZE_SCALE` (median
  ~1.4 GiB; an app missing from `mem.csv.gz` gets the median app's), its load time follows from
  the size as for the presets (`workloads.load_ms_for`, `--load-mib-per-s`);
- its mean service time is its `Average` duration in `run.csv.gz`, capped at `SERVICE_CAP_MS`
  (a function missing there gets the presets' default);
- each minute's count is spread as uniform random arrivals inside the minute (seeded).
A window keeps only the functions invoked in it: the capacity shares of `python -m sim` are
shares of what the window asks for, as for a CSV trace.
"""

from __future__ import annotations

import csv
import gzip
import io
import random
import statistics
from array import array
from collections.abc import Iterator
from pathlib import Path

from meshd.decisions.cache import to_units
from sim.workloads import DEFAULT_SERVICE_MS, LOAD_MS_PER_MIB, MIB, Catalogue, TraceError, Workload, load_ms_for

INVOCATIONS = "inv_minutes_721_1440.csv.gz"
MEMORY = "mem.csv.gz"
DURATIONS = "run.csv.gz"
SIZE_SCALE = 10.0  # function memory x 10: model-like sizes (median ~1.4 GiB, catalogue ~2 TiB)
SERVICE_CAP_MS = 2000.0  # a few functions run for minutes; a model's request does not
WINDOW_HOURS = 3.0
MINUTE_MS = 60_000


def _rows(path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row by header) of a gzip CSV; TraceError naming the file when unreadable."""
    try:
        with gzip.open(path, "rt", newline="", encoding="utf-8") as f:
            yield from enumerate(csv.DictReader(f, strict=True), 2)
    except (OSError, EOFError, UnicodeDecodeError, csv.Error) as e:
        raise TraceError(f"cannot read {path}: {e}") from None


def _number(text: str | None, path: Path, lineno: int, column: str) -> float:
    try:
        value = float(text or "")
    except ValueError:
        raise TraceError(f"{path}:{lineno}: {column} {text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise TraceError(f"{path}:{lineno}: {column} must be 0 or more (got {text!r})")
    return value


def read(
    directory: Path,
    window: int = 0,
    window_hours: float = WINDOW_HOURS,
    seed: int = 1,
    size_scale: float = SIZE_SCALE,
    service_cap_ms: float = SERVICE_CAP_MS,
    load_mib_per_s: float = 1000.0 / LOAD_MS_PER_MIB,
) -> Workload:
    """The trace in `directory` as a workload: the whole of it (`window` 0) or its `window`-th
    span of `window_hours` (1: the first). Raises TraceError (missing files, bad numbers, a
    window past the end, a window without invocations)."""
    if window < 0 or not window_hours > 0:
        raise TraceError(f"a window is 0 (the whole trace) or 1 or more, of a positive length (got {window})")
    inv = directory / INVOCATIONS
    app_mb: dict[str, float] = {}
    mem = directory / MEMORY
    for lineno, row in _rows(mem):
        app_mb[row.get("HashApp") or ""] = _number(row.get("AverageAllocatedMb"), mem, lineno, "AverageAllocatedMb")
    run = directory / DURATIONS
    service: dict[str, float] = {}
    for lineno, row in _rows(run):
        service[row.get("HashFunction") or ""] = _number(row.get("Average"), run, lineno, "Average")
    default_mb = statistics.median(app_mb.values()) if app_mb else 128.0

    rng = random.Random(seed)
    requests: list[tuple[int, int]] = []  # (ms, model index)
    ids: list[str] = []
    sizes: list[int] = []
    service_ms: list[float] = []
    span = 0
    for lineno, row in _rows(inv):
        columns = [c for c in row if c.startswith("minute_")]
        span = len(columns)
        if window:
            first = int((window - 1) * window_hours * 60)
            if first >= span:
                raise TraceError(f"{inv}: window {window} of {window_hours:g} h starts past its {span} minutes")
            columns = columns[first : int(window * window_hours * 60)]
        fid = row.get("HashFunction") or ""
        model = len(ids)
        counted = False
        for i, col in enumerate(columns):
            count = int(_number(row[col], inv, lineno, col))
            for _ in range(count):
                requests.append((i * MINUTE_MS + int(rng.random() * MINUTE_MS), model))
            counted = counted or count > 0
        if not counted:
            continue
        ids.append(fid)
        mb = app_mb.get(row.get("HashApp") or "", default_mb) or default_mb
        sizes.append(int(mb * size_scale * MIB))
        service_ms.append(min(service_cap_ms, service.get(fid, DEFAULT_SERVICE_MS)))
    if not requests:
        raise TraceError(f"{inv}: no invocations" + (f" in window {window}" if window else ""))
    requests.sort()
    t0 = requests[0][0]
    cat = Catalogue(
        ids=tuple(ids),
        units=tuple(to_units(s) for s in sizes),
        load_ms=tuple(load_ms_for(s, load_mib_per_s) for s in sizes),
        service_ms=tuple(service_ms),
    )
    name = "azure-functions" if not window else f"azure-functions-{window_hours:g}h-{window}"
    return Workload(name, cat, array("q", (t - t0 for t, _ in requests)), array("q", (m for _, m in requests)))


def write_sample(directory: Path, functions: int, minutes_: int, seed: int = 0) -> None:
    """A small trace in the same three files and columns (for tests and examples): each
    function invoked every k-th minute (timers) or at random (a few popular ones)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    names = [f"f{i:04d}" for i in range(functions)]
    header = ["HashFunction", "HashOwner", "HashApp", *(f"minute_{721 + i}" for i in range(minutes_))]
    inv = io.StringIO()
    w = csv.writer(inv)
    w.writerow(header)
    for i, f in enumerate(names):
        every = 1 + i % 5
        counts = [(rng.randrange(20) if i % 7 == 0 else 1) if m % every == 0 else 0 for m in range(minutes_)]
        w.writerow([f, f"o{i}", f"a{i // 2}", *counts])
    mem = io.StringIO()
    w = csv.writer(mem)
    w.writerow(["HashOwner", "HashApp", "SampleCount", "AverageAllocatedMb"])
    for a in range(0, functions - 2, 2):  # the last app has no row: the median's size
        w.writerow([f"o{a}", f"a{a // 2}", 100, 100 + 50 * (a % 4)])
    run = io.StringIO()
    w = csv.writer(run)
    w.writerow(["HashOwner", "HashApp", "HashFunction", "Average", "Count"])
    for i, f in enumerate(names):
        w.writerow([f"o{i}", f"a{i // 2}", f, 5 + 3000 * (i % 11 == 0), 10])
    for name, buffer in ((INVOCATIONS, inv), (MEMORY, mem), (DURATIONS, run)):
        with gzip.open(directory / name, "wt", newline="", encoding="utf-8") as out:
            out.write(buffer.getvalue())
