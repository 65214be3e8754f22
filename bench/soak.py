"""A soak: three meshd instances under a mixed workload with model churn, for --minutes.

    python bench/soak.py [--minutes M] [--models N] [--cache-models K] [--concurrency C]
                         [--zipf S] [--load-delay-ms D] [--seed X]

One real etcd, three reference runtimes sized for K models each and three `meshd serve`
processes (LocalMesh; every child stopped by PID on exit, also on failure and Ctrl-C). N demo
models are registered, more than the mesh holds (3 K), so loads and evictions go on all the
time. Until the deadline, all at once:

- unary: C tasks send ModelInfer for a model drawn from a Zipf(S) popularity, round-robin
  over the three external ports; every answer is checked against the model file;
- streaming: one task opens ModelStreamInfer streams of 4 requests each for Zipf models;
- vmodel: one vmodel is switched between two of the models every 3 s (setVModel), and
  inference through it (mm-vmodel-id) must answer as one of the two;
- churn: every second a fresh model id is registered (loadNow), asked once, and the oldest
  of the churned models beyond 4 is unregistered.

Every RPC error and wrong answer is an error; each distinct one is printed with its count.
Each meshd's RSS is sampled every 10 s (more often in short runs) and a least-squares slope
is printed in MB/hour, over the whole run and over its second half (after warm-up growth).
Exit status 1 when there was any error.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import platform
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

# Runnable as a plain script from a checkout: make `meshd` importable.
_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from _shared import (  # noqa: E402 - bench/ is on sys.path
    asyncio_run,
    command_line,
    dump_logs,
    log,
    rss_bytes,
    sigterm_as_interrupt,
    slope,
    stop_uninterrupted,
)

from meshd._proto.inference import grpc_predict_v2_pb2 as pb  # noqa: E402
from meshd._proto.mmesh import model_mesh_pb2 as mm  # noqa: E402
from meshd.demo import zipf_weights  # noqa: E402
from meshd.runtimes.models import (  # noqa: E402
    DemoModel,
    decode_infer_response,
    generate_models,
    make_infer_request,
)
from meshd.testing.cluster import LocalMesh, MeshClient, Node, StartFailed, sized_runtime_args  # noqa: E402

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
MODEL_SIZE_BYTES = 4 << 20
INSTANCES = 3
RPC_TIMEOUT_S = 60.0
STREAM_LEN = 4
VMODEL_ID = "soak-vmodel"
VMODEL_SWITCH_S = 3.0
CHURN_EVERY_S = 1.0
CHURN_KEEP = 4
CHURN_POOL = 8  # model files the churned ids point at
RSS_EVERY_S = 10.0
ROW = [0.5, -0.25, 1.0, 0.0]


@dataclass
class Tally:
    counts: Counter[str] = field(default_factory=Counter)  # kind -> successful calls
    errors: Counter[str] = field(default_factory=Counter)  # distinct error -> count

    def error(self, what: str) -> None:
        self.errors[what] += 1


def close(got: Sequence[float], expected: Sequence[float]) -> bool:
    return len(got) == len(expected) and all(
        math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-4) for a, b in zip(got, expected, strict=True)
    )


def rpc_error(kind: str, e: grpc.aio.AioRpcError) -> str:
    details = (e.details() or "").splitlines()[0][:160] if e.details() else ""
    return f"{kind}: {e.code().name}: {details}"


@dataclass
class Soak:
    clients: list[MeshClient]
    models: dict[str, DemoModel]
    paths: dict[str, Path]
    churn_files: list[tuple[Path, DemoModel]]
    args: argparse.Namespace
    deadline: float
    tally: Tally = field(default_factory=Tally)
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self.rng.seed(self.args.seed)
        ids = sorted(self.models)
        self.rng.shuffle(ids)
        self.ranked = ids
        self.weights = list(itertools.accumulate(zipf_weights(len(ids), self.args.zipf)))
        self.rr = itertools.count()
        self.vmodel_targets = (ids[-1], ids[-2])  # cold models: a switch makes a load happen

    def running(self) -> bool:
        return time.monotonic() < self.deadline

    def pick(self) -> str:
        return self.rng.choices(self.ranked, cum_weights=self.weights)[0]

    def client(self) -> MeshClient:
        return self.clients[next(self.rr) % len(self.clients)]

    async def infer(self, kind: str, header: tuple[str, str], expected: Sequence[Sequence[float]]) -> None:
        req = make_infer_request(header[1], [ROW]).SerializeToString()
        try:
            raw = await self.client().channel.unary_unary(INFER)(req, metadata=(header,), timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            self.tally.error(rpc_error(kind, e))
            return
        got = decode_infer_response(pb.ModelInferResponse.FromString(raw))
        if len(got) == 1 and any(close(got[0], exp) for exp in expected):
            self.tally.counts[kind] += 1
        else:
            self.tally.error(f"{kind}: wrong answer for {header[1]}")

    async def unary(self) -> None:
        while self.running():
            model_id = self.pick()
            await self.infer("unary", ("mm-model-id", model_id), [self.models[model_id].predict([ROW])[0]])

    async def streaming(self) -> None:
        while self.running():
            model_id = self.pick()
            expected = self.models[model_id].predict([ROW])[0]
            reqs = [make_infer_request(model_id, [ROW]).SerializeToString()] * STREAM_LEN
            call = self.client().channel.stream_stream(STREAM_INFER)
            answers = 0
            try:
                async for raw in call(iter(reqs), metadata=(("mm-model-id", model_id),), timeout=RPC_TIMEOUT_S):
                    resp = pb.ModelStreamInferResponse.FromString(raw)
                    got = decode_infer_response(resp.infer_response) if not resp.error_message else []
                    if resp.error_message:
                        self.tally.error(f"stream: error message: {resp.error_message[:160]}")
                    elif len(got) == 1 and close(got[0], expected):
                        answers += 1
                    else:
                        self.tally.error(f"stream: wrong answer for {model_id}")
            except grpc.aio.AioRpcError as e:
                self.tally.error(rpc_error("stream", e))
                continue
            self.tally.counts["stream messages"] += answers
            if answers != STREAM_LEN:
                self.tally.error(f"stream: {answers} answers to {STREAM_LEN} requests")
            else:
                self.tally.counts["streams"] += 1

    async def vmodel(self) -> None:
        a, b = self.vmodel_targets
        expected = [self.models[a].predict([ROW])[0], self.models[b].predict([ROW])[0]]
        for target in itertools.cycle((a, b)):
            if not self.running():
                return
            try:
                await self.client().mm.setVModel(
                    mm.SetVModelRequest(vModelId=VMODEL_ID, targetModelId=target), timeout=RPC_TIMEOUT_S
                )
                self.tally.counts["vmodel switches"] += 1
            except grpc.aio.AioRpcError as e:
                self.tally.error(rpc_error("setVModel", e))
            switch_at = time.monotonic() + VMODEL_SWITCH_S
            while self.running() and time.monotonic() < switch_at:
                await self.infer("vmodel", ("mm-vmodel-id", VMODEL_ID), expected)
                await asyncio.sleep(0.05)

    async def churn(self) -> None:
        live: list[str] = []
        for k in itertools.count():
            if not self.running():
                return
            path, model = self.churn_files[k % len(self.churn_files)]
            model_id = f"churn-{k:06d}"
            try:
                await self.client().mm.registerModel(
                    mm.RegisterModelRequest(
                        modelId=model_id, modelInfo=mm.ModelInfo(type="demo", path=str(path)), loadNow=True
                    ),
                    timeout=RPC_TIMEOUT_S,
                )
                self.tally.counts["registrations"] += 1
                live.append(model_id)
            except grpc.aio.AioRpcError as e:
                self.tally.error(rpc_error("registerModel", e))
            else:
                await self.infer("churned", ("mm-model-id", model_id), [model.predict([ROW])[0]])
            while len(live) > CHURN_KEEP:
                old = live.pop(0)
                try:
                    await self.client().mm.unregisterModel(
                        mm.UnregisterModelRequest(modelId=old), timeout=RPC_TIMEOUT_S
                    )
                    self.tally.counts["unregistrations"] += 1
                except grpc.aio.AioRpcError as e:
                    self.tally.error(rpc_error("unregisterModel", e))
            await asyncio.sleep(CHURN_EVERY_S)

    async def sample_rss(self, pids: list[int], every_s: float, samples: list[tuple[float, list[int]]]) -> None:
        t0 = time.monotonic()
        while True:
            samples.append((time.monotonic() - t0, [rss_bytes(p) for p in pids]))
            if not self.running():
                return
            await asyncio.sleep(min(every_s, max(0.0, self.deadline - time.monotonic())))


async def drive(
    nodes: list[Node], args: argparse.Namespace, workdir: Path, log: Callable[[str], None]
) -> tuple[Tally, float, list[tuple[float, list[int]]], dict[str, int]]:
    generated = generate_models(workdir / "models", args.models, size_bytes=MODEL_SIZE_BYTES, seed=args.seed)
    churn = generate_models(workdir / "churn", CHURN_POOL, prefix="churn-file-", size_bytes=MODEL_SIZE_BYTES, seed=1)
    clients = [MeshClient.open(n) for n in nodes]
    try:
        for g in generated:
            await clients[0].mm.registerModel(
                mm.RegisterModelRequest(modelId=g.id, modelInfo=mm.ModelInfo(type="demo", path=str(g.path))),
                timeout=30,
            )
        seconds = args.minutes * 60
        soak = Soak(
            clients,
            {g.id: DemoModel.load(g.path) for g in generated},
            {g.id: g.path for g in generated},
            [(c.path, DemoModel.load(c.path)) for c in churn],
            args,
            time.monotonic() + seconds,
        )
        before = [await c.stats() for c in clients]
        log(f"registered {len(generated)} models; soaking for {seconds:.0f} s")
        samples: list[tuple[float, list[int]]] = []
        every = min(RSS_EVERY_S, max(0.5, seconds / 10))
        t0 = time.monotonic()
        await asyncio.gather(
            *(soak.unary() for _ in range(args.concurrency)),
            soak.streaming(),
            soak.vmodel(),
            soak.churn(),
            soak.sample_rss([n.meshd.pid for n in nodes], every, samples),
        )
        elapsed = time.monotonic() - t0
        after = [await c.stats() for c in clients]
        keys = ("requests", "loads", "loadFailures", "evictions")
        stats = {k: sum(getattr(a, k) - getattr(b, k) for a, b in zip(after, before, strict=True)) for k in keys}
        return soak.tally, elapsed, samples, stats
    finally:
        for c in clients:
            await c.close()


def report(
    tally: Tally,
    elapsed: float,
    samples: list[tuple[float, list[int]]],
    stats: dict[str, int],
    nodes: list[Node],
    args: argparse.Namespace,
    command: str,
) -> list[str]:
    out = [
        f"command: {command}",
        f"python {platform.python_version()}, grpcio {grpc.__version__}, {os.cpu_count()} cpus; {INSTANCES} instances, "
        f"{args.models} models x {MODEL_SIZE_BYTES >> 20} MiB, cache {args.cache_models} per instance, "
        f"zipf {args.zipf:g}, load delay {args.load_delay_ms} ms, {args.concurrency} unary clients, seed {args.seed}",
        f"duration {elapsed:.0f} s",
    ]
    c = tally.counts
    infer = c["unary"] + c["vmodel"] + c["churned"] + c["stream messages"]
    out.append(
        f"throughput: {infer / elapsed:.1f} inferences/s ({c['unary']} unary, {c['stream messages']} stream messages "
        f"in {c['streams']} streams, {c['vmodel']} via the vmodel, {c['churned']} to churned models)"
    )
    out.append(
        f"management: {c['registrations']} registrations, {c['unregistrations']} unregistrations, "
        f"{c['vmodel switches']} vmodel switches"
    )
    out.append(
        f"mesh: {stats['loads']} loads, {stats['evictions']} evictions, {stats['loadFailures']} load failures, "
        f"{stats['requests']} requests counted by instances (peer hops included)"
    )
    out.append(f"errors: {sum(tally.errors.values())}")
    for what, n in tally.errors.most_common():
        out.append(f"  {n:>6} x {what}")
    out.append(f"RSS of each meshd ({len(samples)} samples):")
    ts = [t for t, _ in samples]
    half = [k for k, t in enumerate(ts) if t >= ts[-1] / 2] if ts else []
    for i, node in enumerate(nodes):
        ys = [s[1][i] / 1e6 for s in samples]
        whole = slope(ts, ys) * 3600
        late = slope([ts[k] for k in half], [ys[k] for k in half]) * 3600
        out.append(
            f"  {node.instance_id} pid {node.meshd.pid}: {ys[0]:.1f} -> {ys[-1]:.1f} MB (max {max(ys):.1f}); "
            f"slope {whole:+.1f} MB/hour over the run, {late:+.1f} MB/hour over its second half"
        )
    out.append("summary: " + ("ok" if not tally.errors else "ERRORS"))
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--minutes", type=float, default=10.0, help="soak duration (default 10)")
    p.add_argument("--models", type=int, default=40, help="registered models (default 40)")
    p.add_argument("--cache-models", type=int, default=8, help="models each runtime holds (default 8)")
    p.add_argument("--concurrency", type=int, default=8, help="unary client tasks (default 8)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of model popularity (default 1.1)")
    p.add_argument("--load-delay-ms", type=int, default=50, help="reference runtime load time (default 50)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--keep-workdir", action="store_true")
    a = p.parse_args(argv)
    if a.minutes <= 0 or min(a.models, a.cache_models, a.concurrency) < 1 or a.load_delay_ms < 0:
        p.error("--minutes must be > 0; --models, --cache-models, --concurrency >= 1; --load-delay-ms >= 0")
    if a.models < 3:
        p.error("--models must be >= 3 (two are the vmodel's targets)")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = command_line("soak.py", argv)
    sigterm_as_interrupt()

    tmp = tempfile.TemporaryDirectory(prefix="meshd-soak-")
    workdir = Path(tmp.name)
    mesh = LocalMesh(workdir / "mesh", service=f"soak-{uuid.uuid4().hex[:8]}")
    try:
        mesh.start_etcd()
        runtime_args = sized_runtime_args(args.cache_models, MODEL_SIZE_BYTES, args.load_delay_ms)
        nodes = [mesh.add_node(f"soak-{i}", runtime_args=runtime_args) for i in range(INSTANCES)]
        log("up: " + "; ".join(f"{n.instance_id} meshd pid {n.meshd.pid}" for n in nodes))
        tally, elapsed, samples, stats = asyncio_run(drive(nodes, args, workdir, log))
        if tally.errors:
            dump_logs(mesh, log)
    except KeyboardInterrupt:
        log("interrupted; stopped every child")
        return 130
    except StartFailed as e:
        log(f"could not start the mesh: {e}")
        return 1
    except BaseException:
        dump_logs(mesh, log)
        raise
    finally:
        stop_uninterrupted(mesh)
        if args.keep_workdir:
            log(f"kept {workdir}")
        else:
            tmp.cleanup()
    for line in report(tally, elapsed, samples, stats, nodes, args, command):
        print(line)
    return 1 if tally.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
