"""Model sizes with a real Triton: what the adapter reports against what tritonserver uses.

Starts tritonserver (the `nvidia-pytriton` wheel, from the test venv, built on first use) in
explicit mode, then loads Python-backend models one at a time, each holding a ballast array of
a given size (standing for its weights, read into memory at load), and prints per model:

- its size on disk, and the size `meshd adapter` reports for it (disk x MODELSIZE_MULTIPLIER,
  1.25) and the size upstream's Triton adapter would report (the key's `disk_size_bytes` x
  1.25; without one, its 1 MB default);
- the growth of tritonserver's RSS plus its backend stubs' (one stub process per model
  instance) over the load, measured after the load settles. A first model with no ballast is
  loaded before and printed apart: its growth includes the Python backend's own start-up.

    python -m bench.triton_sizes [--ballast-mib 0 4 16 64] [--rounds 3]

Memory, not time: absolute figures, medians over `--rounds` fresh servers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc

from meshd._proto.inference import grpc_predict_v2_pb2 as v2
from meshd._proto.inference import grpc_predict_v2_pb2_grpc as v2_grpc
from meshd.adapter import sizing
from meshd.runtimes.models import DemoModel, generate_models
from meshd.testing.procs import Children, free_port, port_open, wait_until
from meshd.testing.triton import (
    backend_directory,
    remove_shm,
    rss_bytes,
    stub_pids,
    triton_command,
    triton_venv,
    write_python_model,
)

MIB = 1 << 20
UPSTREAM_DEFAULT_MODEL_SIZE = 1_000_000  # model-mesh-triton-adapter DEFAULT_MODELSIZE
SETTLE_S = 1.0


def tree_rss(server_pid: int, shm_prefix: str) -> int:
    return rss_bytes(server_pid) + sum(rss_bytes(pid) for pid in stub_pids(shm_prefix))


def one_round(workdir: Path, ballasts: list[int]) -> list[tuple[int, int, int]]:
    """(disk bytes, adapter-reported bytes, RSS growth) per model, in load order."""
    install = triton_venv()
    backends = backend_directory(install, workdir / "backends")
    repository = workdir / "repository"
    rules = generate_models(workdir / "rules", len(ballasts) + 1, prefix="size-")
    ballasts = [0, *ballasts]  # the first: the backend's start-up
    for rule, ballast in zip(rules, ballasts, strict=True):
        write_python_model(repository / rule.id, DemoModel.load(rule.path), ballast_bytes=ballast)
    port, http = free_port(), free_port()
    prefix = f"meshd-bench-{uuid.uuid4().hex[:12]}-"
    argv, env = triton_command(install, repository, backends, port, http, prefix)
    out = []
    with Children(workdir / "logs") as children:
        try:
            server = children.start("tritonserver", argv, env)
            wait_until(lambda: port_open(port), 60, "tritonserver")
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = v2_grpc.GRPCInferenceServiceStub(ch)
                wait_until(lambda: stub.ServerReady(v2.ServerReadyRequest(), timeout=5).ready, 60, "ready")
                time.sleep(SETTLE_S)
                for rule in rules:
                    before = tree_rss(server.pid, prefix)
                    stub.RepositoryModelLoad(v2.RepositoryModelLoadRequest(model_name=rule.id), timeout=120)
                    time.sleep(SETTLE_S)
                    grown = tree_rss(server.pid, prefix) - before
                    disk = sizing.disk_usage(repository / rule.id)
                    reported = sizing.model_size("", disk, sizing.DEFAULT_MULTIPLIER, MIB)
                    out.append((disk, reported, grown))
        finally:
            children.stop_all()
            for pid in stub_pids(prefix):  # stubs that outlived their server
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            remove_shm(prefix)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ballast-mib", type=int, nargs="+", default=[0, 4, 16, 64])
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    ballasts = [b * MIB for b in a.ballast_mib]
    rounds = []
    for _ in range(a.rounds):
        with tempfile.TemporaryDirectory(prefix="meshd-triton-sizes-") as tmp:
            rounds.append(one_round(Path(tmp), ballasts))
    first = statistics.median(r[0][2] for r in rounds)
    print(f"first Python model loaded (no ballast, backend start-up included): RSS +{first / MIB:.1f} MiB\n")
    print("| ballast | on disk | meshd adapter reports | upstream adapter reports | tritonserver RSS growth (median) |")
    print("|---:|---:|---:|---:|---:|")
    for i, ballast in enumerate(ballasts, start=1):
        disk, reported, _ = rounds[0][i]
        grown = statistics.median(r[i][2] for r in rounds)
        upstream = int(disk * sizing.DEFAULT_MULTIPLIER)
        print(
            f"| {ballast / MIB:.0f} MiB | {disk / MIB:.2f} MiB | {reported / MIB:.2f} MiB | "
            f"{UPSTREAM_DEFAULT_MODEL_SIZE / MIB:.2f} MiB ({upstream / MIB:.2f} MiB with disk_size_bytes) | "
            f"{grown / MIB:.1f} MiB |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
