"""A rolling update under traffic (issue 34), as a Kubernetes Deployment with maxSurge 1 and
maxUnavailable 0 does it: for each of three old instances in turn, one new instance (a newer
SERVICE_VERSION) is started and waited for until ready, then the old one gets SIGTERM and
leaves the Service's endpoints half a second later (endpoint removal races the signal).

Clients send checked requests all along, through whichever instances are endpoints, to
models with two copies (`min_copies: 2`), models loaded on demand (one copy) and models
capped at one copy (`max_copies: 1`). What must hold:

- no request fails for a model with two or more copies;
- a capped model is never held by two runtimes at once (sampled from the runtimes' own
  RepositoryIndex, in rounds, so a hand-over between two questions is not counted);
- loads during the update go to the new version (upstream's rule: the newest version unless
  it is saturated): no old instance gains a copy once a new one is up;
- at the end every model is served from the new instances and no record is lost.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.runtimes.models import GeneratedModel, generate_models
from meshd.testing.procs import wait_until

from ..integration.conftest import MODEL_SIZE, Client, close_enough, expected
from .conftest import ROWS, WAIT_S, FaultMesh, answers, listed_instances

pytestmark = [pytest.mark.slow]

OLD_VERSION = "meshd-20261101-1"
NEW_VERSION = "meshd-20261126-1"
# A pod's settings: a drain grace for the endpoint removal to land, upstream's stop budget.
POD: dict[str, str | int] = {"drain_grace_ms": 1500, "shutdown_timeout_ms": 20_000}
RUNTIME_ARGS = ["--load-delay-ms", "150"]  # loads take a while, as real ones do
INSTANCES = 3
CLIENT_THREADS = 4
ENDPOINT_REMOVAL_S = 0.5  # the Service drops a terminating pod this long after its SIGTERM
KEYS = {
    "two": '{"meshd": {"min_copies": 2}}',
    "one": "",
    "capped": '{"meshd": {"max_copies": 1}}',
}


class Endpoints:
    """The Service: the instances that take new requests, changed by the test as a Deployment
    would change them."""

    def __init__(self, clients: list[Client]) -> None:
        self._lock = threading.Lock()
        self._clients = list(clients)

    def pick(self, rng: random.Random) -> Client:
        with self._lock:
            return rng.choice(self._clients)

    def add(self, c: Client) -> None:
        with self._lock:
            self._clients.append(c)

    def remove(self, c: Client) -> None:
        with self._lock:
            self._clients.remove(c)


class Clients:
    """Client threads sending paced, checked requests for random models to random endpoints
    until stopped; every failure kept with the model's kind."""

    def __init__(self, endpoints: Endpoints, models: dict[str, str], files: dict[str, GeneratedModel]) -> None:
        self.endpoints = endpoints
        self.models = models  # id -> kind
        self.files = files
        self.failures: list[tuple[str, str]] = []  # (kind, what)
        self.served: Counter[str] = Counter()  # kind -> successes
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(CLIENT_THREADS)]

    def _run(self, n: int) -> None:
        rng = random.Random(n)
        ids = sorted(self.models)
        while not self._stop.wait(0.01):
            model_id = rng.choice(ids)
            kind = self.models[model_id]
            c = self.endpoints.pick(rng)
            try:
                ok = close_enough(c.infer(model_id, ROWS), expected(self.files[model_id], ROWS))
                error = "" if ok else "wrong answer"
            except grpc.RpcError as e:
                ok, error = False, f"{e.code().name}: {e.details()}"
            with self._lock:
                if ok:
                    self.served[kind] += 1
                else:
                    self.failures.append((kind, f"{c.node.instance_id} {model_id}: {error}"))

    @contextmanager
    def running(self) -> Iterator[Clients]:
        for t in self._threads:
            t.start()
        try:
            yield self
        finally:
            self._stop.set()
            for t in self._threads:
                t.join(60)

    def failed(self, kind: str) -> list[str]:
        with self._lock:
            return [what for k, what in self.failures if k == kind]


class CappedWatch:
    """Samples every runtime's RepositoryIndex in rounds until stopped. A capped model is held
    twice when runtime X holds it in two consecutive rounds and runtime Y held it when asked
    between those two questions: X held it throughout, so both held it at that moment."""

    def __init__(self, clients: list[Client], capped: list[str]) -> None:
        self.clients = list(clients)  # runtimes watched; the test adds and drops them
        self.capped = capped
        self.problems: list[str] = []
        self.rounds = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def watch(self, c: Client) -> None:
        with self._lock:
            self.clients.append(c)

    def forget(self, c: Client) -> None:
        with self._lock:
            self.clients.remove(c)

    def _round(self) -> list[tuple[str, set[str]]]:
        with self._lock:
            watched = list(self.clients)
        held: list[tuple[str, set[str]]] = []
        for c in watched:
            try:
                held.append((c.node.instance_id, set(c.runtime_loaded()) & set(self.capped)))
            except grpc.RpcError:
                held.append((c.node.instance_id, set()))  # stopped or stopping: counts as holding nothing
        return held

    def _run(self) -> None:
        before = self._round()
        while not self._stop.wait(0.05):
            now = self._round()
            earlier = {iid: n for n, (iid, _) in enumerate(before)}
            for i, (x, x_now) in enumerate(now):
                if x not in earlier:
                    continue
                j = earlier[x]
                # Asked after X in the earlier round, or before X in this one.
                between = [*before[j + 1 :], *now[:i]]
                for model_id in x_now & before[j][1]:
                    held_by = sorted({y for y, names in between if y != x and model_id in names})
                    if held_by:
                        self.problems.append(f"{model_id}: held by {x} and {held_by} at once")
            before = now
            self.rounds += 1

    @contextmanager
    def running(self) -> Iterator[CappedWatch]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(60)


def copies_on(records: dict[str, dict[str, Any]], instance_ids: set[str]) -> set[tuple[str, str]]:
    return {(m, iid) for m, r in records.items() for iid in r.get("instanceIds", {}) if iid in instance_ids}


def test_rolling_update_under_traffic_replaces_every_instance_without_failing_a_replicated_model(
    fault_mesh: FaultMesh, tmp_path: Any
) -> None:
    files = generate_models(tmp_path / "models", 7, size_bytes=MODEL_SIZE)
    kinds = ["two", "two", "one", "one", "one", "capped", "capped"]
    models = {m.id: kind for m, kind in zip(files, kinds, strict=True)}
    by_id = {m.id: m for m in files}
    old_settings = {**POD, "service_version": OLD_VERSION}
    new_settings = {**POD, "service_version": NEW_VERSION}
    olds = [fault_mesh.add(f"old-{n}", old_settings, runtime_args=RUNTIME_ARGS) for n in range(INSTANCES)]
    old_ids = {c.node.instance_id for c in olds}
    for c in olds:
        wait_until(answers(lambda c=c: listed_instances(c) == old_ids), WAIT_S, "old instances live")
    for model_id, kind in models.items():
        info = mm.ModelInfo(type="demo", path=str(by_id[model_id].path), key=KEYS[kind])
        olds[0].mm.registerModel(mm.RegisterModelRequest(modelId=model_id, modelInfo=info), timeout=30)
    for model_id in models:
        assert close_enough(olds[0].infer(model_id, ROWS), expected(by_id[model_id], ROWS))
    two = [m for m, k in models.items() if k == "two"]
    wait_until(
        lambda: all(len(fault_mesh.records()[m].get("instanceIds", {})) >= 2 for m in two), WAIT_S, "two copies each"
    )
    registered = fault_mesh.records()

    endpoints = Endpoints(olds)
    capped = sorted(m for m, k in models.items() if k == "capped")
    news: list[Client] = []
    gained_on_old: set[tuple[str, str]] = set()
    with Clients(endpoints, models, by_id).running() as clients, CappedWatch(olds, capped).running() as watch:
        time.sleep(1.0)
        for n, old in enumerate(olds):
            new = fault_mesh.add(f"new-{n}", new_settings, runtime_args=RUNTIME_ARGS)  # waits for /ready
            news.append(new)
            watch.watch(new)
            endpoints.add(new)
            time.sleep(1.0)  # both versions side by side under traffic
            still_old = {c.node.instance_id for c in olds[n:]}
            before = copies_on(fault_mesh.records(), still_old)
            old.node.meshd.send_signal(signal.SIGTERM)
            time.sleep(ENDPOINT_REMOVAL_S)
            endpoints.remove(old)
            assert old.node.meshd.proc.wait(WAIT_S) == 0, old.node.meshd.log_tail()
            gained_on_old |= copies_on(fault_mesh.records(), still_old - {old.node.instance_id}) - before
            watch.forget(old)
            old.node.runtime.stop()
        time.sleep(1.0)

    assert clients.served["two"] and clients.served["one"] and clients.served["capped"], clients.served
    assert not clients.failed("two"), clients.failed("two")[:5]
    assert watch.rounds > 20 and not watch.problems, watch.problems[:5]
    assert not gained_on_old, f"loads went to the old version while a new one was up: {sorted(gained_on_old)}"
    # Single copies and capped models: their copy moves, and requests for them wait for it.
    assert not clients.failed("one"), clients.failed("one")[:5]
    assert not clients.failed("capped"), clients.failed("capped")[:5]

    new_ids = {c.node.instance_id for c in news}
    for c in news:
        wait_until(answers(lambda c=c: listed_instances(c) == new_ids), WAIT_S, "only the new instances live")
    for model_id in models:
        assert close_enough(news[0].infer(model_id, ROWS), expected(by_id[model_id], ROWS))
    wait_until(
        lambda: all(set(r.get("instanceIds", {})) <= new_ids for r in fault_mesh.records().values()),
        WAIT_S,
        "records name only new instances",
    )
    records = fault_mesh.records()
    assert set(records) == set(registered), "records lost"
    for model_id, r in records.items():
        assert r["mPath"] == registered[model_id]["mPath"]
        assert r.get("encKey") == registered[model_id].get("encKey")
    held = Counter(m for c in news for m in c.runtime_loaded())
    assert all(held[m] <= 1 for m in capped), held
    assert all(held[m] >= 1 for m in models), f"not served from the new runtimes: {held}"
