"""A chaos soak (issue 34): random faults, one after another, under checked traffic.

    python bench/chaos_soak.py [--minutes 60] [--seed N] [--json FILE]

Three meshd instances, each with its reference runtime, and one etcd, every process on a
host of its own (network namespaces: `meshd.testing.netns`, root needed). Models of three
kinds: two copies (`min_copies: 2`), loaded on demand (one copy) and capped (`max_copies: 1`).
Client threads send checked requests throughout, each through the instance with the fewest
requests in flight from the client (a balancer's least-request rule) among those it has not
seen fail in the last few seconds.

A fault starts every 20-40 s (the next no sooner than the last has healed), drawn in turn from
a shuffled deck of every kind, so a short run still meets many kinds:

    kill-meshd       SIGKILL an instance's meshd, start it again (its container restarting)
    kill-runtime     SIGKILL an instance's runtime, start it again
    restart-meshd    SIGTERM an instance's meshd (it drains), start it again
    freeze-meshd     SIGSTOP an instance's meshd for 10-20 s, then SIGCONT
    etcd-stop        SIGTERM etcd, start it again 10-20 s later
    etcd-kill        SIGKILL etcd, start it again 10-20 s later
    etcd-restart     SIGTERM etcd and start it again at once
    etcd-stall       SIGSTOP etcd past the instance lease TTL, then SIGCONT
    partition        cut one instance off from every other host for 15 s
    slow-net         200 ms latency and 5 % loss to and from one instance for 30 s

A failed request is excused when its ingress was the instance a fault hit, from the fault's
start until that instance serves again (what a request in flight on a killed process, or sent
to it before its balancer noticed, meets), and, for a model capped at one copy, through any
instance while its holder is cut off or frozen, for TTL + 5 s (until its lease lapses: no
second copy may load before). Every
other failure counts, as does every wrong answer and every record lost or changed.

Printed every 5 minutes and at the end: requests, failures by cause (excused or not), wrong
answers, the longest time any model went from one right answer to the next through the
instances no fault hit (and the fault under way then),
records lost, the RSS of every process and each meshd's RSS slope over the second half. The
seed is printed first: `--seed` replays the same faults at the same times. Exit status 1 on
any wrong answer, lost record or failure not excused.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from _shared import command_line, log, rss_bytes, sigterm_as_interrupt, slope  # noqa: E402 - bench/ is on sys.path

from meshd._proto.inference import grpc_predict_v2_pb2_grpc as v2_grpc  # noqa: E402
from meshd._proto.mmesh import model_mesh_pb2 as mm  # noqa: E402
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc  # noqa: E402
from meshd.kv.store import StoreError  # noqa: E402
from meshd.runtimes.models import DemoModel, decode_infer_response, generate_models, make_infer_request  # noqa: E402
from meshd.testing.netmesh import NetMesh, NetNode, start_netmesh  # noqa: E402
from meshd.testing.netns import SUBNET  # noqa: E402
from meshd.testing.observers import EtcdView  # noqa: E402
from meshd.testing.procs import wait_until  # noqa: E402

INSTANCES = ("inst-a", "inst-b", "inst-c")
MODEL_SIZE = 1 << 20
ROWS = [[1.0, 2.0, 3.0, 4.0]]
TTL_S = 4
SETTINGS: dict[str, str | int] = {
    "instance_ttl_s": TTL_S,
    "leader_sweep_ms": 2000,
    "dead_instance_prune_ms": 5000,
    "janitor_ms": 2000,
    "rate_check_ms": 2000,
    "runtime_check_ms": 1000,
    "drain_grace_ms": 1000,
    "shutdown_timeout_ms": 15_000,
}
LOAD_DELAY_MS = 100  # each load takes this long in the runtime: the reload time a fault costs
KINDS = {"two": '{"meshd": {"min_copies": 2}}', "one": "", "capped": '{"meshd": {"max_copies": 1}}'}
MODEL_KINDS = ["two", "two", "two", "one", "one", "one", "capped", "capped"]
CLIENT_THREADS = 8  # enough that requests stuck on a frozen ingress leave others sending
REQUEST_TIMEOUT_S = 10.0
BALANCER_SKIP_S = 3.0  # an ingress that failed is skipped this long (outlier ejection)
FAULT_EVERY_S = (20.0, 40.0)
QUIET_AFTER_HEAL_S = 5.0
NOTICED_S = TTL_S + 5.0  # a lease lapses after its TTL; its holder's copies are then not counted
REPORT_EVERY_S = 300.0
RSS_EVERY_S = 15.0
FAULTS = (
    "kill-meshd",
    "kill-runtime",
    "restart-meshd",
    "freeze-meshd",
    "etcd-stop",
    "etcd-kill",
    "etcd-restart",
    "etcd-stall",
    "partition",
    "slow-net",
)


@dataclass
class Answer:
    start: float
    end: float
    ingress: str
    model_id: str
    error: str  # "" when right


@dataclass
class Fault:
    kind: str
    target: str  # an instance, or "etcd"
    start: float
    healed: float = 0.0  # the fault lifted
    recovered: float = 0.0  # the target serves again
    # A holder cut off (partitioned or frozen) looks alive to etcd until its lease lapses: a
    # model capped at one copy held there cannot be served, through any ingress, until then.
    capped_unavailable_until: float = 0.0

    def excuses(self, a: Answer, kind: str) -> bool:
        if a.ingress == self.target and self.start <= a.end and a.start <= self.recovered:
            return True
        return kind == "capped" and self.start <= a.end and a.start <= self.capped_unavailable_until

    def active_until(self) -> float:
        return max(self.recovered, self.healed) + QUIET_AFTER_HEAL_S

    def active(self, at: float) -> bool:
        return self.start <= at <= self.active_until()

    def hit_ingress(self, a: Answer) -> bool:
        """Sent through the instance this fault hit, while it was hit."""
        return a.ingress == self.target and self.start <= a.end and a.start <= self.recovered


@dataclass
class Client:
    node: NetNode
    channel: grpc.Channel
    runtime_channel: grpc.Channel

    @classmethod
    def open(cls, node: NetNode) -> Client:
        return cls(node, grpc.insecure_channel(node.target), grpc.insecure_channel(node.runtime_target))

    def infer(self, model_id: str) -> list[list[float]]:
        stub = v2_grpc.GRPCInferenceServiceStub(self.channel)
        req = make_infer_request(model_id, ROWS)
        resp = stub.ModelInfer(req, metadata=(("mm-model-id", model_id),), timeout=REQUEST_TIMEOUT_S)
        return decode_infer_response(resp)

    def close(self) -> None:
        self.channel.close()
        self.runtime_channel.close()


@dataclass
class Soak:
    mesh: NetMesh
    clients: dict[str, Client]
    models: dict[str, str]  # id -> kind
    expected: dict[str, list[list[float]]]
    rng: random.Random
    answers: list[Answer] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    rss: list[tuple[float, dict[str, tuple[int, int]]]] = field(default_factory=list)  # name -> (pid, bytes)
    registered: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (path, key)
    lost: set[str] = field(default_factory=set)
    skip_until: dict[str, float] = field(default_factory=dict)
    outstanding: Counter[str] = field(default_factory=Counter)  # requests in flight per ingress
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    # ---- traffic ---------------------------------------------------------------------
    def send(self, seed: int) -> None:
        rng = random.Random(seed)  # drawn before any thread starts: `--seed` replays the same requests
        ids = sorted(self.models)
        while not self.stop.wait(0.01):
            now = time.monotonic()
            with self.lock:
                usable = [i for i in INSTANCES if self.skip_until.get(i, 0.0) <= now] or list(INSTANCES)
                # Least outstanding requests (Envoy's LEAST_REQUEST): a frozen or cut-off
                # instance keeps the requests it holds and gets no more, as behind a balancer;
                # picked at random it would soon hold every client thread.
                fewest = min(self.outstanding[i] for i in usable)
                ingress = rng.choice([i for i in usable if self.outstanding[i] == fewest])
                self.outstanding[ingress] += 1
            model_id = rng.choice(ids)
            start = time.monotonic()
            try:
                ok = _close(self.clients[ingress].infer(model_id), self.expected[model_id])
                error = "" if ok else "wrong answer"
            except grpc.RpcError as e:
                error = f"{e.code().name}: {(e.details() or '')[:160]}"
            end = time.monotonic()
            with self.lock:
                self.outstanding[ingress] -= 1
                self.answers.append(Answer(start, end, ingress, model_id, error))
                if error and error != "wrong answer":
                    self.skip_until[ingress] = end + BALANCER_SKIP_S

    # ---- faults ----------------------------------------------------------------------
    def node(self, iid: str) -> NetNode:
        return self.mesh.nodes[iid]

    def etcd(self) -> str:
        return self.mesh.etcd_members[0]

    def inject(self, kind: str) -> Fault:
        target = "etcd" if kind.startswith("etcd") else self.rng.choice(INSTANCES)
        fault = Fault(kind, target, time.monotonic())
        with self.lock:
            self.faults.append(fault)
        log(f"[{self.elapsed():7.1f}s] fault {kind} on {target}")
        getattr(self, "_" + kind.replace("-", "_"))(fault)
        fault.recovered = fault.recovered or time.monotonic()
        log(f"[{self.elapsed():7.1f}s]   healed after {fault.healed - fault.start:.1f}s, "
            f"serving again after {fault.recovered - fault.start:.1f}s")  # fmt: skip
        return fault

    def _kill_meshd(self, f: Fault) -> None:
        node = self.node(f.target)
        node.meshd.kill()
        time.sleep(1.0)
        self.mesh.restart_meshd(node)  # it waits for the lease of its old record to lapse
        f.healed = time.monotonic()
        self._wait_serving(f)

    def _kill_runtime(self, f: Fault) -> None:
        node = self.node(f.target)
        node.runtime.kill()
        time.sleep(1.0)
        self.mesh.restart_runtime(node)
        f.healed = time.monotonic()
        self._wait_serving(f)

    def _restart_meshd(self, f: Fault) -> None:
        node = self.node(f.target)
        node.meshd.send_signal(signal.SIGTERM)
        node.meshd.proc.wait(60)
        self.mesh.restart_meshd(node)
        f.healed = time.monotonic()
        self._wait_serving(f)

    def _freeze_meshd(self, f: Fault) -> None:
        node = self.node(f.target)
        f.capped_unavailable_until = f.start + NOTICED_S
        node.meshd.send_signal(signal.SIGSTOP)
        time.sleep(self.rng.uniform(10, 20))
        node.meshd.send_signal(signal.SIGCONT)
        f.healed = time.monotonic()
        self._wait_serving(f)

    def _etcd_down(self, f: Fault, sig: int, down_s: float) -> None:
        member = self.etcd()
        proc = self.mesh.etcd_procs[member]
        proc.stop(timeout_s=10, sig=sig)
        time.sleep(down_s)
        self.mesh.restart_etcd(member)
        wait_until(lambda: self.mesh.etcd_healthy(member), 60, "etcd healthy")
        f.healed = time.monotonic()

    def _etcd_stop(self, f: Fault) -> None:
        self._etcd_down(f, signal.SIGTERM, self.rng.uniform(10, 20))

    def _etcd_kill(self, f: Fault) -> None:
        self._etcd_down(f, signal.SIGKILL, self.rng.uniform(10, 20))

    def _etcd_restart(self, f: Fault) -> None:
        self._etcd_down(f, signal.SIGTERM, 0.0)

    def _etcd_stall(self, f: Fault) -> None:
        proc = self.mesh.etcd_procs[self.etcd()]
        proc.send_signal(signal.SIGSTOP)
        time.sleep(TTL_S + 3)
        proc.send_signal(signal.SIGCONT)
        f.healed = time.monotonic()

    def _partition(self, f: Fault) -> None:
        lab = self.mesh.lab
        others = [h for h in lab.hosts if h != f.target]
        f.capped_unavailable_until = f.start + NOTICED_S
        lab.cut(f.target, others)
        time.sleep(15)
        lab.heal()
        f.healed = time.monotonic()
        self._wait_serving(f)

    def _slow_net(self, f: Fault) -> None:
        lab = self.mesh.lab
        lab.shape(f.target, 200, 0.05, seed=self.rng.randrange(1 << 30))
        time.sleep(30)
        lab.unshape(f.target)
        f.healed = time.monotonic()

    def _wait_serving(self, f: Fault) -> None:
        """Until the target answers every model right through its own port."""
        client = self.clients[f.target]

        def serves() -> bool:
            try:
                return all(_close(client.infer(m), self.expected[m]) for m in sorted(self.models))
            except grpc.RpcError:
                return False

        wait_until(serves, 120, f"{f.target} serving", interval_s=0.2)
        f.recovered = time.monotonic()

    # ---- observation -----------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    t0: float = 0.0

    def sample_rss(self) -> None:
        procs = {"etcd": self.mesh.etcd_procs[self.etcd()]}
        for iid in INSTANCES:
            procs[iid], procs[f"{iid}-runtime"] = self.node(iid).meshd, self.node(iid).runtime
        sample = {name: (p.pid, rss_bytes(p.pid)) for name, p in procs.items() if p.alive()}
        self.rss.append((self.elapsed(), sample))

    def check_records(self) -> bool:
        """Records lost or changed since registration; False when etcd could not be read."""
        view = EtcdView(self.mesh.etcd_url(self.etcd()), f"/tas-runtime/{self.mesh.service}", timeout_s=3.0)
        try:
            records = view.records("registry")
        except (StoreError, OSError, grpc.RpcError, TimeoutError):
            return False
        for model_id, (path, key) in self.registered.items():
            r = records.get(model_id)
            if r is None or r.get("mPath") != path or (r.get("encKey") or "") != key:
                self.lost.add(model_id)
        return True

    def report(self, final: bool) -> dict[str, Any]:
        with self.lock:
            answers, faults = list(self.answers), list(self.faults)
        failed = [a for a in answers if a.error]
        wrong = [a for a in failed if a.error == "wrong answer"]
        kinds = self.models
        excused = [
            a for a in failed if a.error != "wrong answer" and any(f.excuses(a, kinds[a.model_id]) for f in faults)
        ]
        excused_set = {id(a) for a in excused}
        unexcused = [a for a in failed if a.error != "wrong answer" and id(a) not in excused_set]
        # Unavailable as the mesh is seen through the instances no fault hit: the longest time
        # from one right answer for a model to the next (failing or waiting in between).
        spared = [a for a in answers if not any(f.hit_ingress(a) for f in faults)]
        longest, longest_model, longest_at = _longest_gap(spared)
        during = [f for f in faults if f.start <= longest_at + longest and longest_at <= f.active_until()]
        out: dict[str, Any] = {
            "elapsed_s": round(self.elapsed(), 1),
            "requests": len(answers),
            "failed": len(failed),
            "failed_excused": len(excused),
            "failed_not_excused": len(unexcused),
            "wrong_answers": len(wrong),
            "causes": dict(Counter(a.error.split(":")[0] for a in failed)),
            "not_excused_by_fault": dict(Counter(_during(faults, a) for a in unexcused)),
            "not_excused_by_kind": dict(Counter(self.models[a.model_id] for a in unexcused)),
            "not_excused_examples": sorted(
                {f"{_during(faults, a)}: {a.ingress} {a.model_id}: {a.error}" for a in unexcused}
            )[:8],
            "faults": dict(Counter(f.kind for f in faults)),
            "longest_unavailable_s": round(longest, 2),
            "longest_unavailable_model": longest_model,
            "longest_unavailable_during": [f"{f.kind} on {f.target}" for f in during],
            "records_lost": sorted(self.lost),
            "rss_mb": {n: round(b / 2**20, 1) for n, (_, b) in (self.rss[-1][1].items() if self.rss else [])},
            "meshd_rss_slope_mb_per_h_second_half": self._slopes(),
            "seed": self.seed,
        }
        title = "FINAL" if final else "REPORT"
        print(f"\n== {title} at {out['elapsed_s']} s ==", flush=True)
        for k, v in out.items():
            print(f"  {k}: {v}", flush=True)
        return out

    seed: int = 0

    def _slopes(self) -> dict[str, float]:
        """Each meshd's RSS slope over the second half, from the samples of its current process."""
        if not self.rss:
            return {}
        half = self.rss[-1][0] / 2
        out = {}
        for iid in INSTANCES:
            last_pid = self.rss[-1][1].get(iid, (0, 0))[0]
            pts = [(t, s[iid][1]) for t, s in self.rss if t >= half and s.get(iid, (0, 0))[0] == last_pid]
            if len(pts) >= 3:
                xs, ys = [t / 3600 for t, _ in pts], [b / 2**20 for _, b in pts]
                out[iid] = round(slope(xs, ys), 1)
        return out


def _during(faults: Sequence[Fault], a: Answer) -> str:
    """The fault under way when a request ended (or "none")."""
    for f in reversed(faults):
        if f.active(a.end):
            return f"{f.kind} on {f.target}"
    return "none"


def _close(a: list[list[float]], b: list[list[float]]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(abs(p - q) < 1e-4 for p, q in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


def _longest_gap(answers: Sequence[Answer]) -> tuple[float, str, float]:
    """The longest time a model went from one right answer to the next: (seconds, model, when
    the gap began). Requests for every model go out many times a second, so a gap of seconds
    is a model failing or waiting, not one left unasked."""
    last_ok: dict[str, float] = {}
    best = (0.0, "", 0.0)
    for a in sorted(answers, key=lambda a: a.end):
        if a.error:
            continue
        before = last_ok.get(a.model_id)
        if before is not None and a.end - before > best[0]:
            best = (a.end - before, a.model_id, before)
        last_ok[a.model_id] = a.end
    return best


def run(minutes: float, seed: int, workdir: Path, report_every_s: float) -> dict[str, Any]:
    rng = random.Random(seed)
    mesh = start_netmesh(workdir, f"soak-{uuid.uuid4().hex[:8]}", etcd_members=1)
    clients: dict[str, Client] = {}
    threads: list[threading.Thread] = []
    soak: Soak | None = None
    try:
        args = ["--capacity-bytes", str(8 * MODEL_SIZE), "--load-delay-ms", str(LOAD_DELAY_MS)]
        for n, iid in enumerate(INSTANCES):
            clients[iid] = Client.open(mesh.add_node(iid, f"{SUBNET}.{21 + n}", args, SETTINGS))
        files = generate_models(workdir / "models", len(MODEL_KINDS), size_bytes=MODEL_SIZE)
        models = {g.id: kind for g, kind in zip(files, MODEL_KINDS, strict=True)}
        expected = {g.id: DemoModel.load(g.path).predict(ROWS) for g in files}
        soak = Soak(mesh, clients, models, expected, rng, seed=seed)
        stub = mm_grpc.ModelMeshStub(clients[INSTANCES[0]].channel)
        wait_until(lambda: _registers(stub, files[0].id, str(files[0].path), KINDS[MODEL_KINDS[0]]), 60, "registry")
        for g in files:
            key = KINDS[models[g.id]]
            if not _registers(stub, g.id, str(g.path), key):
                raise RuntimeError(f"could not register {g.id}")
            soak.registered[g.id] = (str(g.path), key)
        for m in models:
            wait_until(functools.partial(_answers, clients[INSTANCES[0]], m, expected[m]), 60, f"{m} served")
        soak.t0 = time.monotonic()
        end = soak.t0 + minutes * 60
        seeds = [rng.randrange(1 << 62) for _ in range(CLIENT_THREADS)]
        threads = [threading.Thread(target=soak.send, args=(seed,), daemon=True) for seed in seeds]
        for t in threads:
            t.start()
        deck: list[str] = []
        next_fault = soak.t0 + rng.uniform(*FAULT_EVERY_S) / 2
        next_report = soak.t0 + report_every_s
        next_rss = soak.t0
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_rss:
                soak.sample_rss()
                next_rss = now + RSS_EVERY_S
            if now >= next_report:
                soak.check_records()
                soak.report(final=False)
                next_report = now + report_every_s
            if now >= next_fault and end - now > 45:  # the last fault heals before the end
                if not deck:
                    deck = list(FAULTS)
                    rng.shuffle(deck)
                started = time.monotonic()
                soak.inject(deck.pop())
                next_fault = max(started + rng.uniform(*FAULT_EVERY_S), time.monotonic() + QUIET_AFTER_HEAL_S)
            time.sleep(0.2)
        soak.stop.set()
        for t in threads:
            t.join(REQUEST_TIMEOUT_S + 5)
        soak.sample_rss()
        wait_until(soak.check_records, 60, "etcd readable")
        return soak.report(final=True)
    finally:
        if soak is not None:
            soak.stop.set()
        for c in clients.values():
            c.close()
        mesh.stop()


def _registers(stub: Any, model_id: str, path: str, key: str) -> bool:
    info = mm.ModelInfo(type="demo", path=path, key=key)
    try:
        stub.registerModel(mm.RegisterModelRequest(modelId=model_id, modelInfo=info), timeout=10)
        return True
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.ALREADY_EXISTS:
            return True
        return False


def _answers(c: Client, model_id: str, expected: list[list[float]]) -> bool:
    try:
        return _close(c.infer(model_id), expected)
    except grpc.RpcError:
        return False


def passed(result: dict[str, Any]) -> bool:
    return not (result["wrong_answers"] or result["records_lost"] or result["failed_not_excused"])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=None, help="replay a run (default: a new one, printed)")
    p.add_argument("--json", type=Path, default=None, help="write the final figures here")
    p.add_argument("--report-every-s", type=float, default=REPORT_EVERY_S)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None, on_result: Callable[[dict[str, Any]], None] | None = None) -> int:
    args = parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    print(f"chaos soak: seed {seed}, {args.minutes:g} minutes ({command_line('bench/chaos_soak.py', argv)})")
    print(f"replay: python bench/chaos_soak.py --minutes {args.minutes:g} --seed {seed}", flush=True)
    sigterm_as_interrupt()  # SIGTERM (or Ctrl-C) stops every process and removes the lab
    try:
        with tempfile.TemporaryDirectory(prefix="meshd-chaos-") as tmp:
            result = run(args.minutes, seed, Path(tmp), args.report_every_s)
    except KeyboardInterrupt:
        log("interrupted; stopped every child")
        return 130
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    if on_result is not None:
        on_result(result)
    ok = passed(result)
    print("PASS" if ok else "FAIL: wrong answers, lost records or failures not excused", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
