"""How fast the storage helper pulls a model, against boto3's `download_file` and `s5cmd`
(docs/storage.md): one large object and a folder of many small files, from one S3-GET server
(`meshd.testing.objserver` in its own process: byte ranges sent with sendfile, signatures not
checked), several runs, medians. Also one plain GET stream of the large object, and a reload
from the disk tier (a restarted helper finding the model on disk).

    python bench/pull.py                      # 1 GiB object, 1,000 x 64 KiB files, 3 runs
    python bench/pull.py --stream-mib-s 100   # each GET capped at 100 MiB/s by the server
    python bench/pull.py --smoke              # small and quick, for the test suite
    python bench/pull.py --only small         # the 1,000 files only
    python bench/pull.py --only small --workers 4,8,32   # also meshd with these worker counts
    python bench/pull.py --only small --latency-ms 20    # each answer 20 ms late (a remote store)

Goals (printed as ratios, judged here, never in tests): meshd at least as fast as the faster of
boto3 and s5cmd, >= 3x one GET stream, a reload from disk >= 10x faster than the pull.

Each tool's row also shows how many cores the machine kept busy while it ran (server and
client together, from /proc/stat): on loopback one GET stream already keeps most of a small
machine busy, so parallel GETs have little left to win there. They pay off where each
connection is slower than the machine (a remote store): the server's per-GET cap
(`--stream-mib-s`) models that. Before each tool, memory is freed just then (`settle_memory`;
`--no-settle` to skip), so the tools' order does not decide which one pays for idle memory.
The `cpu_s` columns are the CPU seconds each tool's client used (its own process, or the
bench's for the in-process ones) and the object server's, so a tool that wins by burning more
of the shared cores shows it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from meshd.storage import StorageHelper, StorageSettings

MIB = 1 << 20
BUCKET = "bench"


def make_data(root: Path, big_bytes: int, small_count: int, small_bytes: int) -> None:
    bucket = root / BUCKET
    (bucket / "small").mkdir(parents=True, exist_ok=True)
    big = bucket / "big.bin"
    if not big.exists() or big.stat().st_size != big_bytes:
        block = os.urandom(16 * MIB)
        with open(big, "wb") as f:
            left = big_bytes
            while left:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
    for i in range(small_count):
        p = bucket / "small" / f"f{i:05d}.bin"
        if not p.exists():
            p.write_bytes(os.urandom(small_bytes))


def warm(folder: Path) -> None:
    """Read the served files into the page cache (the first tool must not pay for a cold read)."""
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(16 * MIB):
                    pass


def settle_memory(where: Path, nbytes: int) -> None:
    """Write and delete a scratch file of `nbytes`, so that the next tool's page-cache writes
    find memory the kernel freed just now. On a VM that hands idle memory back to its host
    (this project's: virtio-balloon free page reporting), memory idle for a few seconds costs
    a host page fault per page when written again: measured, a 1 GiB pull's writes took ~2 s
    more, in whichever tool ran when the memory was idle. Without this the order of the tools
    decides who pays it (docs/storage.md)."""
    block = bytes(512 << 10)  # small writes: large ones are what pays most on idle memory
    scratch = where / "settle.tmp"
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(nbytes // len(block) + 1):
            os.write(fd, block)
    finally:
        os.close(fd)
        scratch.unlink()


def start_server(root: Path, stream_bytes_s: float = 0.0, latency_ms: float = 0.0) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshd.testing.objserver",
            str(root),
            "--rate",
            str(stream_bytes_s),
            "--latency-ms",
            str(latency_ms),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    if not url.startswith("http"):
        proc.kill()
        raise SystemExit("the object server did not start")
    return proc, url


def busy_ticks() -> tuple[int, int] | None:
    """(busy, total) CPU ticks of the whole machine, or None where /proc/stat is absent."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = ticks[3] + ticks[4]  # idle + iowait
    return sum(ticks) - idle, sum(ticks)


def server_cpu_s(pid: int) -> float:
    """The object server's CPU seconds so far (user + system), 0.0 where /proc is absent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def client_cpu_s() -> float:
    """CPU seconds of this process and its waited-for children (s5cmd)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def meshd_pull(
    url: str, dest: Path, model_path: str, parallel: int, threshold: int, fsync: bool = False, objects: int = 0
) -> float:
    """meshd's pull: `parallel` ranged GETs in flight; `objects` workers for a folder of small
    files (0: adapted to the store, the default)."""
    config = dest / "config"
    config.mkdir(parents=True, exist_ok=True)
    (config / "k").write_text(json.dumps({"type": "s3", "endpoint_url": url, "bucket": BUCKET, "anonymous": "true"}))
    settings = StorageSettings(
        dest / "models",
        config,
        budget_bytes=1 << 42,
        parts_in_flight=parallel,
        objects_in_flight=objects,
        part_threshold=threshold,
        fsync=fsync,
    )

    async def run() -> None:
        helper = StorageHelper(settings)
        await helper.start()
        pulled = await helper.pull("m", model_path, json.dumps({"storage_key": "k"}))
        assert pulled is not None and not pulled.from_disk

    return timed(lambda: asyncio.run(run()))


def boto3_get(url: str, dest: Path, key: str, folder: bool) -> float:
    import boto3  # type: ignore[import-untyped]
    from botocore import UNSIGNED  # type: ignore[import-untyped]
    from botocore.config import Config  # type: ignore[import-untyped]

    client = boto3.client("s3", endpoint_url=url, config=Config(signature_version=UNSIGNED), region_name="us-east-1")

    def run() -> None:
        dest.mkdir(parents=True, exist_ok=True)
        if not folder:
            client.download_file(BUCKET, key, str(dest / Path(key).name))
            return
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=key + "/")
        for page in pages:  # download_file per object, one after another (its documented use)
            for obj in page.get("Contents", []):
                client.download_file(BUCKET, obj["Key"], str(dest / Path(obj["Key"]).name))

    return timed(run)


def s5cmd_get(url: str, dest: Path, key: str, folder: bool) -> float | None:
    binary = shutil.which("s5cmd") or str(Path(sys.executable).parent / "s5cmd")
    if not Path(binary).exists():
        return None
    dest.mkdir(parents=True, exist_ok=True)
    src = f"s3://{BUCKET}/{key}/*" if folder else f"s3://{BUCKET}/{key}"
    argv = [binary, "--endpoint-url", url, "--no-sign-request", "cp", src, str(dest) + "/"]
    return timed(lambda: subprocess.run(argv, check=True, capture_output=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big-mib", type=int, default=1024, help="the large object's size (MiB)")
    ap.add_argument("--small-count", type=int, default=1000)
    ap.add_argument("--small-kib", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where data and copies go (default: a temp dir)")
    ap.add_argument("--stream-mib-s", type=float, default=0.0, help="cap each GET at this rate (0: no cap)")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="the server waits this long before each answer")
    ap.add_argument("--no-settle", action="store_true", help="do not free memory before each tool (see settle_memory)")
    ap.add_argument("--smoke", action="store_true", help="64 MiB, 50 files, 1 run")
    ap.add_argument("--only", choices=("big", "small"), default=None, help="one case only")
    ap.add_argument(
        "--workers", default="", help="also run meshd with these worker counts (comma-separated), as meshd-wN"
    )
    ap.add_argument("--skip", default="", help="tools not to run (comma-separated, e.g. meshd-fsync,boto3)")
    args = ap.parse_args()
    skip = {t.strip() for t in args.skip.split(",") if t.strip()}
    if args.smoke:
        args.big_mib, args.small_count, args.runs = 64, 50, 1
    if args.only == "small":
        args.big_mib = 1  # not pulled: the data folder needs no large object
    try:
        extra_workers = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError:
        ap.error("--workers takes comma-separated numbers")
    if (
        args.runs < 1
        or any(w < 1 for w in extra_workers)
        or args.big_mib < 1
        or args.small_count < 1
        or args.small_kib < 1
        or args.stream_mib_s < 0
        or args.latency_ms < 0
    ):
        ap.error("sizes and runs must be positive")
    base = args.dir or Path(tempfile.mkdtemp(prefix="meshd-pull-bench-"))
    base.mkdir(parents=True, exist_ok=True)  # a --dir not made yet
    data = base / "data"
    need = args.big_mib * MIB * 3 + args.small_count * args.small_kib * 1024 * 2
    if shutil.disk_usage(base).free < need + (1 << 30):
        raise SystemExit(f"not enough free disk under {base} for {need >> 20} MiB")
    cases = [c for c in (("big", "big.bin", False), ("small", "small", True)) if args.only in (None, c[0])]
    make_data(data, args.big_mib * MIB, args.small_count, args.small_kib * 1024)
    sizes = {"big": args.big_mib * MIB, "small": args.small_count * args.small_kib * 1024}
    server, url = start_server(data, args.stream_mib_s * MIB, args.latency_ms)
    results: dict[tuple[str, str], list[float]] = {}
    cores: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[tuple[float, float]]] = {}  # (client, server) CPU seconds
    try:
        for run in range(args.runs):
            for case, key, folder in cases:
                tools: list[tuple[str, Callable[[Path], float | None]]] = [
                    ("meshd", functools.partial(meshd_pull, url, model_path=key, parallel=16, threshold=32 * MIB)),
                    (
                        "meshd-fsync",
                        functools.partial(meshd_pull, url, model_path=key, parallel=16, threshold=32 * MIB, fsync=True),
                    ),
                    ("boto3", functools.partial(boto3_get, url, key=key, folder=folder)),
                    ("s5cmd", functools.partial(s5cmd_get, url, key=key, folder=folder)),
                ]
                tools += [
                    (
                        f"meshd-w{w}",
                        functools.partial(meshd_pull, url, model_path=key, parallel=w, threshold=32 * MIB, objects=w),
                    )
                    for w in extra_workers
                ]
                if not folder:
                    tools.append(
                        ("one-GET", functools.partial(meshd_pull, url, model_path=key, parallel=1, threshold=1 << 62))
                    )
                for name, fn in [(n, f) for n, f in tools if n not in skip]:
                    dest = base / f"out-{name}"
                    shutil.rmtree(dest, ignore_errors=True)
                    os.sync()  # each tool starts with no one else's dirty pages to write back
                    warm(data / BUCKET)  # ... and the server reads from memory, not the disk, for each
                    if not args.no_settle:  # ... and writes into memory freed just now, as every other
                        settle_memory(base, sizes[case] + sizes[case] // 8)
                    before = busy_ticks()
                    cpu_before = (client_cpu_s(), server_cpu_s(server.pid))
                    took = fn(dest)
                    after = busy_ticks()
                    if took is not None:
                        results.setdefault((case, name), []).append(took)
                        cpu.setdefault((case, name), []).append(
                            (client_cpu_s() - cpu_before[0], server_cpu_s(server.pid) - cpu_before[1])
                        )
                        if before and after and after[1] > before[1]:
                            share = (after[0] - before[0]) / (after[1] - before[1])
                            cores.setdefault((case, name), []).append(share * (os.cpu_count() or 1))
                    if name == "meshd":
                        reload_s = _reload(dest, key)
                        results.setdefault((case, "reload"), []).append(reload_s)
                    shutil.rmtree(dest, ignore_errors=True)
            print(f"run {run + 1}/{args.runs} done", file=sys.stderr, flush=True)
    finally:
        server.kill()
        server.wait()
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    cap = f", each GET capped at {args.stream_mib_s:g} MiB/s" if args.stream_mib_s else ""
    cap += f", each answer {args.latency_ms:g} ms late" if args.latency_ms else ""
    cap += ", memory not settled" if args.no_settle else ""
    print(f"{os.cpu_count()} cores{cap}")
    print(f"{'case':6} {'tool':12} {'median_s':>9} {'MiB/s':>8} {'cores':>5} {'cpu_s':>6} {'srv_s':>6}  runs")
    med: dict[tuple[str, str], float] = {}
    for (case, name), times in sorted(results.items()):
        med[(case, name)] = statistics.median(times)
        rate = sizes[case] / MIB / med[(case, name)]
        busy = statistics.median(cores[(case, name)]) if cores.get((case, name)) else float("nan")
        runs = " ".join(f"{t:.3f}" for t in times)
        spent = cpu.get((case, name))
        own = statistics.median(c for c, _s in spent) if spent else float("nan")
        srv = statistics.median(s for _c, s in spent) if spent else float("nan")
        print(f"{case:6} {name:12} {med[(case, name)]:9.3f} {rate:8.0f} {busy:5.2f} {own:6.2f} {srv:6.2f}  {runs}")
    print("summary:")
    for case, _key, _folder in cases:
        m = med[(case, "meshd")]
        rivals = [med[(case, t)] for t in ("boto3", "s5cmd") if (case, t) in med]
        line = f"  {case}: meshd / faster of boto3,s5cmd = {min(rivals) / m:.2f}x" if rivals else f"  {case}:"
        if (case, "meshd-fsync") in med and rivals:
            line += f" ({min(rivals) / med[(case, 'meshd-fsync')]:.2f}x with fsync)"
        if (case, "one-GET") in med:
            line += f"; meshd / one GET stream = {med[(case, 'one-GET')] / m:.2f}x"
            one = cores.get((case, "one-GET"))
            if one:
                line += f" (one stream kept {statistics.median(one):.2f} of {os.cpu_count()} cores busy)"
        line += f"; reload from disk {m / med[(case, 'reload')]:.0f}x faster than the pull"
        print(line)


def _reload(dest: Path, key: str) -> float:
    settings = StorageSettings(dest / "models", dest / "config", budget_bytes=1 << 42)

    async def run() -> None:
        helper = StorageHelper(settings)  # a restart: scan the disk, then the load finds it there
        await helper.start()
        pulled = await helper.pull("m", key, json.dumps({"storage_key": "k"}))
        assert pulled is not None and pulled.from_disk

    return timed(lambda: asyncio.run(run()))


if __name__ == "__main__":
    main()
