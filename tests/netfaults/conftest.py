"""Network-fault tests: three etcd members and three meshd instances (each with its
reference runtime) on hosts of their own (`meshd.testing.netns`), one mesh for the module,
client load checked answer by answer, and an observer of what must never break.

Each test breaks the network in one way, heals it, and reports one row: requests for models
with another copy that failed (through the instances the fault spared, and through the one it
hit), requests served during the fault, the time from the heal until everything agrees again,
and anything lost or duplicated. Rows go to stdout and, when `MESHD_NETFAULTS_REPORT` names a
file, are appended to it as JSON lines (the README's table is made from them).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from meshd._proto.inference import grpc_predict_v2_pb2 as v2
from meshd._proto.inference import grpc_predict_v2_pb2_grpc as v2_grpc
from meshd._proto.meshd import admin_pb2, admin_pb2_grpc, peer_pb2, peer_pb2_grpc
from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc
from meshd.kv.etcd import EtcdStore
from meshd.kv.store import StoreError
from meshd.runtimes.models import DemoModel, GeneratedModel, decode_infer_response, generate_models, make_infer_request
from meshd.testing.netmesh import NetMesh, NetNode, start_netmesh
from meshd.testing.netns import SUBNET, LabUnavailable, NetLab
from meshd.testing.observers import ClientThreads, EtcdView, answers
from meshd.testing.procs import wait_until

MODEL_SIZE = 1 << 20
ROWS = [[1.0, 2.0, 3.0, 4.0]]
WAIT_S = 60.0  # generous: a condition that holds comes much sooner on a quiet machine
INSTANCES = ("inst-a", "inst-b", "inst-c")
SETTINGS: dict[str, str | int] = {
    "instance_ttl_s": 2,
    "leader_sweep_ms": 300,
    "dead_instance_prune_ms": 1000,
    "janitor_ms": 500,
    "rate_check_ms": 500,
    "runtime_check_ms": 1000,
    "scaleup_rpm_threshold": 1_000_000,  # copies stay where the test put them
}
# How long more runtimes than a model's max may hold it (a surplus copy leaves the record at
# once and is unloaded after its requests, on the next janitor or rate check, 0.5 s here).
SHED_SETTLE_S = 5.0
REQUEST_TIMEOUT_S = 10.0


@dataclass
class NetClient:
    node: NetNode
    channel: grpc.Channel
    peer_channel: grpc.Channel
    runtime_channel: grpc.Channel

    @classmethod
    def open(cls, node: NetNode) -> NetClient:
        return cls(
            node,
            grpc.insecure_channel(node.target),
            grpc.insecure_channel(node.peer_target),
            grpc.insecure_channel(node.runtime_target),
        )

    @property
    def iid(self) -> str:
        return self.node.instance_id

    @property
    def mm(self) -> Any:
        return mm_grpc.ModelMeshStub(self.channel)

    def infer(self, model_id: str) -> list[list[float]]:
        stub = v2_grpc.GRPCInferenceServiceStub(self.channel)
        req = make_infer_request(model_id, ROWS)
        resp = stub.ModelInfer(req, metadata=(("mm-model-id", model_id),), timeout=REQUEST_TIMEOUT_S)
        return decode_infer_response(resp)

    def is_leader(self) -> bool:
        stub = peer_pb2_grpc.MeshPeerStub(self.peer_channel)
        return bool(stub.InstanceStats(peer_pb2.InstanceStatsRequest(), timeout=3).leader)

    def listed_instances(self) -> set[str]:
        stub = admin_pb2_grpc.MeshAdminStub(self.channel)
        resp = stub.listInstances(admin_pb2.ListInstancesRequest(), timeout=3)
        return {i.instanceId for i in resp.instances}

    def runtime_loaded(self) -> set[str]:
        stub = v2_grpc.GRPCInferenceServiceStub(self.runtime_channel)
        return {m.name for m in stub.RepositoryIndex(v2.RepositoryIndexRequest(), timeout=3).models}

    def load_here(self, model_id: str) -> None:
        req = peer_pb2.InternalOpRequest(modelId=model_id, load=True, sync=True)
        state = peer_pb2_grpc.MeshPeerStub(self.peer_channel).InternalOperation(req, timeout=30).state
        assert state == peer_pb2.InternalOpResponse.LOADED

    def close(self) -> None:
        for ch in (self.channel, self.peer_channel, self.runtime_channel):
            ch.close()


@dataclass
class Net:
    """The module's mesh: hosts, clients, the models and their max copies."""

    mesh: NetMesh
    clients: dict[str, NetClient]
    models: dict[str, GeneratedModel]
    max_copies: dict[str, int]
    etcd_for_observer: str = "etcd2"  # a member no test partitions away

    @property
    def lab(self) -> NetLab:
        return self.mesh.lab

    @property
    def prefix(self) -> str:
        return f"/tas-runtime/{self.mesh.service}"

    def with_other_copy(self) -> set[str]:
        return {m for m, n in self.max_copies.items() if n > 1}

    # ---- etcd as outside tools see it ---------------------------------------------
    @property
    def etcd_view(self) -> EtcdView:
        return EtcdView(self.mesh.etcd_url(self.etcd_for_observer), self.prefix, timeout_s=3.0)

    def records(self, kind: str) -> dict[str, dict[str, Any]]:
        return self.etcd_view.records(kind)

    def instance_leases(self) -> dict[str, int]:
        """Each instance record's lease (a new one means the instance lost its lease)."""
        base = f"{self.prefix}/instances/"

        async def read(store: EtcdStore) -> dict[str, int]:
            kvs, _ = await store.range_prefix(base)
            return {kv.key[len(base) :]: kv.lease for kv in kvs}

        return self.etcd_view.call(read)

    def leader_in_etcd(self) -> str | None:
        return self.etcd_view.leader()

    def acting_leaders(self, skip: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
        out = []
        for iid, c in self.clients.items():
            if iid in skip:
                continue
            try:
                if c.is_leader():
                    out.append(iid)
            except grpc.RpcError:
                pass
        return out

    def agreement(self) -> list[str]:
        """What still disagrees (empty: converged): every instance live and listed by every
        instance, one leader acting, each model's live copies in etcd exactly the runtimes
        holding it, never above its max, and at least one."""
        issues: list[str] = []
        live = set(self.records("instances"))
        if live != set(INSTANCES):
            issues.append(f"live instances {sorted(live)}")
        for iid, c in self.clients.items():
            try:
                listed = c.listed_instances()
            except grpc.RpcError as e:
                issues.append(f"{iid} listInstances: {e.code().name}")
                continue
            if listed != set(INSTANCES):
                issues.append(f"{iid} lists {sorted(listed)}")
        leader, acting = self.leader_in_etcd(), self.acting_leaders()
        if leader is None or acting != [leader]:
            issues.append(f"leader in etcd {leader}, acting {acting}")
        records = self.records("registry")
        held = {iid: c.runtime_loaded() for iid, c in self.clients.items()}
        for model_id, cap in self.max_copies.items():
            named = set(records.get(model_id, {}).get("instanceIds", {})) & live
            holders = {iid for iid, names in held.items() if model_id in names}
            if named != holders:
                issues.append(f"{model_id}: record {sorted(named)}, runtimes {sorted(holders)}")
            if not 1 <= len(holders) <= cap:
                issues.append(f"{model_id}: {len(holders)} copies (max {cap})")
        return issues

    def converged(self) -> bool:
        try:
            return not self.agreement()
        except (grpc.RpcError, StoreError, OSError):
            return False


@dataclass
class Answer:
    at: float
    ingress: str
    model_id: str
    error: str  # "" when the answer was right
    sent: float = 0.0


class Traffic(ClientThreads[NetClient]):
    """One client thread per ingress, each asking for every model in turn, every answer
    checked against the model file and kept with its time."""

    def __init__(self, net: Net, ingress: list[str], pace_s: float = 0.05) -> None:
        clients = [net.clients[i] for i in INSTANCES]
        super().__init__(clients, pace_s=pace_s, join_s=REQUEST_TIMEOUT_S + 5, daemon=True)
        self.net = net
        self.answers: list[Answer] = []
        self._lock = threading.Lock()
        self._expected = {m: DemoModel.load(g.path).predict(ROWS) for m, g in net.models.items()}
        self._ingress = set(ingress)

    def use(self, ingress: list[str]) -> None:
        """Send through these instances only (a client's balancer skipping one it cannot reach)."""
        self._ingress = set(ingress)

    def _run(self, client: NetClient) -> None:
        order = sorted(self.net.models)
        i = 0
        while self._going():
            if client.iid not in self._ingress:
                continue
            model_id = order[i % len(order)]
            i += 1
            sent = time.monotonic()
            try:
                got = client.infer(model_id)
                error = "" if _close(got, self._expected[model_id]) else "wrong answer"
            except grpc.RpcError as e:
                error = f"{e.code().name}: {e.details()}"
            with self._lock:
                self.answers.append(Answer(time.monotonic(), client.iid, model_id, error, sent))

    def between(self, start: float, end: float) -> list[Answer]:
        with self._lock:
            return [a for a in self.answers if start <= a.at < end]


def _close(a: list[list[float]], b: list[list[float]]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(abs(p - q) < 1e-4 for p, q in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


class Observer:
    """Samples every 0.3 s, until stopped: who acts as leader (each instance's own word), how
    many live copies each record in etcd names, and how many runtimes hold each model; keeps
    what breaks. Instances in `excused` are left out of the runtime count (cut off, they keep
    serving what they hold and nobody can tell them otherwise until the network heals)."""

    def __init__(self, net: Net) -> None:
        self.net = net
        self.excused: set[str] = set()
        self.problems: list[str] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._two_before = False
        self._excess_since: dict[str, float] = {}

    def _sample(self) -> None:
        leaders = self.net.acting_leaders()
        two = len(leaders) > 1
        if two and self._two_before:  # one hand-over can show in one sample; a split brain persists
            self.problems.append(f"two acting leaders in consecutive samples: {leaders}")
        self._two_before = two
        live = set(self.net.records("instances"))
        records = self.net.records("registry")
        for model_id, cap in self.net.max_copies.items():
            named = set(records.get(model_id, {}).get("instanceIds", {})) & live
            if len(named) > cap:
                self.problems.append(f"{model_id}: record names {sorted(named)} (max {cap})")
        now = time.monotonic()
        held = {i: c.runtime_loaded() for i, c in self.net.clients.items() if i not in self.excused}
        for model_id, cap in self.net.max_copies.items():
            holders = sorted(i for i, names in held.items() if model_id in names)
            if len(holders) <= cap:
                self._excess_since.pop(model_id, None)
                continue
            since = self._excess_since.setdefault(model_id, now)
            if now - since > SHED_SETTLE_S:
                self.problems.append(f"{model_id}: runtimes {holders} held it for over {SHED_SETTLE_S} s (max {cap})")
                self._excess_since[model_id] = now
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            try:
                self._sample()
            except (grpc.RpcError, OSError, StoreError):
                self._two_before = False
            except Exception as e:  # a broken observer must fail the test, not stop quietly
                self.problems.append(f"observer failed: {e!r}")
                return

    def __enter__(self) -> Observer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


@dataclass
class Row:
    fault: str
    failed_spared: int = 0  # models with another copy, through instances the fault spared
    failed_hit: int = 0  # ... through the instance it hit
    failed_single: int = 0  # the model with one copy (max 1), any ingress
    failed_after_agreement: int = 0  # any model, sent once the mesh agreed again after the heal
    served: int = 0
    requests: int = 0
    converge_s: float = 0.0
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def report(self) -> None:
        line = json.dumps(self.__dict__)
        print(f"\nNETFAULT {line}")
        path = os.environ.get("MESHD_NETFAULTS_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    try:
        NetLab.check_available()
    except LabUnavailable as e:
        pytest.skip(str(e))
    workdir = tmp_path_factory.mktemp("netfaults")
    mesh = start_netmesh(workdir, f"svc-{uuid.uuid4().hex[:8]}")
    clients: dict[str, NetClient] = {}
    try:
        runtime_args = ["--capacity-bytes", str(8 * MODEL_SIZE)]
        for i, iid in enumerate(INSTANCES):
            node = mesh.add_node(iid, f"{SUBNET}.{21 + i}", runtime_args, SETTINGS)
            clients[iid] = NetClient.open(node)
            if i == 0:  # first in line: the leader
                wait_until(answers(clients[iid].is_leader), WAIT_S, f"{iid} to lead")
        generated = generate_models(workdir / "models", 4, size_bytes=MODEL_SIZE)
        models = {g.id: g for g in generated}
        # Three models with two copies each, one per pair of instances; one capped at one copy.
        layout = {generated[0].id: ("inst-a", "inst-b"), generated[1].id: ("inst-a", "inst-c"),
                  generated[2].id: ("inst-b", "inst-c"), generated[3].id: ("inst-a",)}  # fmt: skip
        a = clients["inst-a"]
        max_copies = {}
        for model_id, holders in layout.items():
            max_copies[model_id] = len(holders)
            key = json.dumps({"meshd": {"max_copies": len(holders)}})
            info = mm.ModelInfo(type="demo", path=str(models[model_id].path), key=key)
            a.mm.registerModel(mm.RegisterModelRequest(modelId=model_id, modelInfo=info), timeout=30)
            for iid in holders:
                clients[iid].load_here(model_id)
        n = Net(mesh, clients, models, max_copies)
        wait_until(n.converged, WAIT_S, "the mesh to agree")
        yield n
    finally:
        for c in clients.values():
            c.close()
        mesh.stop()


@dataclass
class Fault:
    """One fault under load: `hit` is the instance it is aimed at."""

    net: Net
    name: str
    hit: str
    traffic: Traffic
    observer: Observer
    row: Row = field(init=False)
    started: float = 0.0
    healed: float = 0.0
    agreed: float = float("inf")  # when the mesh agreed again after the heal

    def __post_init__(self) -> None:
        self.row = Row(self.name)

    def begin(self, excuse_hit: bool = True) -> None:
        self.started = time.monotonic()
        if excuse_hit:
            self.observer.excused = {self.hit}

    def end(self) -> None:
        self.healed = time.monotonic()
        self.net.lab.heal()
        self.traffic.use(list(INSTANCES))

    def settle(self) -> None:
        """Wait for agreement (timed), then keep watching a little with everything counted."""
        try:
            wait_until(self.net.converged, WAIT_S, f"agreement after {self.name}", interval_s=0.2)
            self.agreed = time.monotonic()
        except TimeoutError:
            self.row.errors.append(f"no agreement {WAIT_S:.0f} s after the heal: {self.net.agreement()[:5]}")
        self.row.converge_s = round(time.monotonic() - self.healed, 1)
        self.observer.excused = set()
        time.sleep(SHED_SETTLE_S + 1)  # an excused surplus copy must be shed by now

    def account(self) -> Row:
        """Fill in the row from the answers and the observer."""
        row = self.row
        during = self.traffic.between(self.started, self.healed)
        everything = self.traffic.between(0, time.monotonic())
        multi = self.net.with_other_copy()
        row.requests = len(everything)
        row.served = sum(1 for a in during if not a.error)
        for a in everything:
            if not a.error:
                continue
            if a.sent >= self.agreed:
                row.failed_after_agreement += 1
            if a.model_id not in multi:
                row.failed_single += 1
            elif a.ingress == self.hit:
                row.failed_hit += 1
            else:
                row.failed_spared += 1
        failures = sorted({f"{a.ingress} {a.model_id}: {a.error}" for a in everything if a.error})
        row.errors.extend(failures[:5])
        row.duplicated.extend(self.observer.problems[:5])
        row.lost.extend(f"wrong answer {a.ingress} {a.model_id}" for a in everything if a.error == "wrong answer")
        registered = set(self.net.records("registry"))
        row.lost.extend(f"record of {m} gone" for m in self.net.max_copies if m not in registered)
        return row
