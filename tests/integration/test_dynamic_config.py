"""Upstream's run-time settings under `<prefix>/<service>/config/`, written to a real etcd the
way an operator does (etcd's own JSON gateway, not meshd's code) and followed by a real meshd:
`logger_level`, `log_each_invocation` and `scaleup_rpm_threshold`, each put, seen to act, then
deleted and seen to give way to the value meshd was started with."""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from meshd.kv.embedded import EmbeddedEtcd
from meshd.runtimes.models import GeneratedModel
from meshd.testing.cluster import LocalMesh
from meshd.testing.procs import wait_until

from .conftest import Client, NodeFactory, close_enough, expected

pytestmark = pytest.mark.slow

ROWS = [[1.0, 2.0, 3.0, 4.0]]


def _gateway(etcd: EmbeddedEtcd, call: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(
        f"{etcd.url}/v3/kv/{call}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class Settings:
    """`/tas-runtime/<service>/config/<key>` (no root prefix, upstream's default MM_KVSTORE_PREFIX)."""

    def __init__(self, etcd: EmbeddedEtcd, service: str) -> None:
        self.etcd = etcd
        self.prefix = f"/tas-runtime/{service}/config/"

    def put(self, key: str, value: str) -> None:
        _gateway(self.etcd, "put", {"key": _b64(self.prefix + key), "value": _b64(value)})

    def delete(self, key: str) -> None:
        _gateway(self.etcd, "deleterange", {"key": _b64(self.prefix + key)})


class Log:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.mark = 0

    def since_mark(self) -> str:
        return self.path.read_text(errors="replace")[self.mark :]

    def set_mark(self) -> None:
        self.mark = len(self.path.read_text(errors="replace"))

    def wait_for(self, text: str, what: str) -> None:
        wait_until(lambda: text in self.since_mark(), 20, what)


def _node(
    start_node: NodeFactory, mesh: LocalMesh, etcd: EmbeddedEtcd, model: GeneratedModel
) -> tuple[Client, Settings, Log]:
    node = start_node("inst-a")  # started at INFO, MM_LOG_EACH_INVOKE unset (false)
    node.register(model)
    assert close_enough(node.infer(model.id, ROWS), expected(model, ROWS))
    return node, Settings(etcd, mesh.service), Log(node.node.meshd.log_path)


def test_logger_level_follows_etcd_and_the_start_level_is_back_when_deleted(
    start_node: NodeFactory, mesh: LocalMesh, etcd_server: EmbeddedEtcd, models: list[GeneratedModel]
) -> None:
    _, settings, log = _node(start_node, mesh, etcd_server, models[0])
    assert " DEBUG " not in log.since_mark()
    # meshd's DEBUG lines appear (here: the next setting's change, which meshd logs at DEBUG).
    settings.put("logger_level", "debug")
    settings.put("scaleup_rpm_threshold", "100")
    log.wait_for(" DEBUG meshd.", "a DEBUG line of meshd's")

    # An invalid value: one warning naming key and value; the start level (INFO) applies.
    settings.put("logger_level", "loud")
    log.wait_for("config/logger_level value 'loud' ignored", "the invalid value's warning")
    log.wait_for("level of meshd's loggers: as started (configured)", "the start level")

    # Deleted: the start level is back, and meshd's DEBUG lines are gone with it.
    log.set_mark()
    settings.put("logger_level", "DEBUG")
    log.wait_for("level of meshd's loggers: DEBUG", "DEBUG again")
    log.set_mark()
    settings.delete("logger_level")
    log.wait_for("level of meshd's loggers: as started (configured)", "the start level back")
    log.set_mark()
    settings.delete("scaleup_rpm_threshold")  # logged at DEBUG, and at INFO (what it changed)
    log.wait_for("scale-up threshold: 2000 rpm (configured)", "the threshold's delete seen")
    time.sleep(0.5)
    assert " DEBUG " not in log.since_mark(), log.since_mark()
    assert log.path.read_text().count("config/logger_level value 'loud'") == 1  # warned once


def test_log_each_invocation_follows_etcd_and_the_configured_off_is_back_when_deleted(
    start_node: NodeFactory, mesh: LocalMesh, etcd_server: EmbeddedEtcd, models: list[GeneratedModel]
) -> None:
    model = models[0]
    node, settings, log = _node(start_node, mesh, etcd_server, model)
    invoke = f"meshd.invocations: invoke /inference.GRPCInferenceService/ModelInfer model={model.id}"
    assert invoke not in log.since_mark()

    settings.put("log_each_invocation", "true")
    # One INFO line per call once the setting is seen (calls before that are not logged).
    wait_until(lambda: bool(node.infer(model.id, ROWS)) and invoke in log.since_mark(), 20, "a call's log line")

    settings.delete("log_each_invocation")
    log.wait_for("invoke log: off (configured)", "the invoke log off")
    log.set_mark()
    assert close_enough(node.infer(model.id, ROWS), expected(model, ROWS))
    time.sleep(0.5)
    assert "meshd.invocations: invoke" not in log.since_mark(), log.since_mark()


def _paced(client: Client, model: GeneratedModel, stop: threading.Event, failures: list[str]) -> None:
    while not stop.is_set():  # about 240 requests/min: above 60, far below the configured 5000
        try:
            assert close_enough(client.infer(model.id, ROWS), expected(model, ROWS))
        except Exception as e:
            failures.append(str(e))
        stop.wait(0.25)


def test_scaleup_threshold_follows_etcd_and_falls_back_when_deleted(
    start_node: NodeFactory, mesh: LocalMesh, etcd_server: EmbeddedEtcd, models: list[GeneratedModel]
) -> None:
    env: dict[str, str | int] = {"scaleup_rpm_threshold": 5000, "rate_check_ms": 500}
    a, b = start_node("inst-a", settings=env), start_node("inst-b", settings=env)
    settings = Settings(etcd_server, mesh.service)
    hot, later = models[0], models[1]

    def holders(model_id: str) -> set[str]:
        return {n.node.instance_id for n in (a, b) if model_id in n.runtime_loaded()}

    stop, failures = threading.Event(), list[str]()
    a.register(hot)
    settings.put("scaleup_rpm_threshold", "60")
    t = threading.Thread(target=_paced, args=(a, hot, stop, failures))
    t.start()
    try:
        wait_until(lambda: len(holders(hot.id)) == 2, 30, "a second copy at 240 rpm over a 60 rpm threshold")
    finally:
        stop.set()
        t.join(30)
    assert not failures, failures[:3]

    settings.delete("scaleup_rpm_threshold")
    for n in (a, b):
        Log(n.node.meshd.log_path).wait_for("scale-up threshold: 5000 rpm (configured)", "5000 rpm back")
    a.register(later)
    stop = threading.Event()
    t = threading.Thread(target=_paced, args=(a, later, stop, failures))
    t.start()
    try:
        time.sleep(5)  # ten rate checks at 240 rpm, under the configured 5000
    finally:
        stop.set()
        t.join(30)
    assert not failures, failures[:3]
    assert len(holders(later.id)) == 1
