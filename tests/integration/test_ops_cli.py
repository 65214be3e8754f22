"""The operator CLI (`meshd models|vmodels|instances`) as a subprocess against a real mesh:
two meshd instances, two reference runtimes, one etcd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

from meshd.runtimes.models import GeneratedModel
from meshd.testing.procs import free_port, wait_until

from .conftest import MODEL_SIZE, Client, NodeFactory, close_enough, expected
from .test_mesh import load_on

pytestmark = pytest.mark.slow

ROWS = [[1.0, 2.0, 3.0, 4.0]]
CAPACITY_MODELS = 8


def meshd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "MESHD_ADDRESS"}
    return subprocess.run(
        [sys.executable, "-m", "meshd", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**full_env, **(env or {})},
    )


def ok(*args: str, env: dict[str, str] | None = None) -> str:
    done = meshd(*args, env=env)
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    assert done.stderr == "", done.stderr
    return done.stdout


def ok_json(*args: str) -> Any:
    return json.loads(ok(*args, "--json"))


def fails(*args: str) -> str:
    """The one stderr line of a failed command (exit 1, no traceback, nothing on stdout)."""
    done = meshd(*args)
    assert done.returncode == 1, (args, done.stdout, done.stderr)
    assert done.stdout == "" and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def model_entry(client: Client, model_id: str) -> dict[str, Any] | None:
    out = ok_json("models", "list", "--address", client.node.target)
    return next((m for m in out["models"] if m["modelId"] == model_id), None)


def test_operator_cli_against_a_two_instance_mesh(start_node: NodeFactory, models: list[GeneratedModel]) -> None:
    a = start_node("inst-a", capacity_models=CAPACITY_MODELS)
    b = start_node("inst-b", capacity_models=CAPACITY_MODELS)
    at_a, at_b = ("--address", a.node.target), ("--address", b.node.target)
    m0, m1 = models[0], models[1]

    # register: idempotent for the same info, ALREADY_EXISTS for different info
    reg = ok_json("models", "register", m0.id, "--type", "demo", "--path", str(m0.path), *at_a)
    assert reg == {"modelId": m0.id, "status": "NOT_LOADED", "errors": [], "copies": []}
    text = ok("models", "register", m0.id, "--type", "demo", "--path", str(m0.path), *at_b)
    assert "status:" in text and "NOT_LOADED" in text
    line = fails("models", "register", m0.id, "--type", "demo", "--path", str(m1.path), *at_b)
    assert line.startswith("meshd models register: ") and line.endswith("(ALREADY_EXISTS)"), line

    # listed before any load: no copies, size unknown, never used (not upstream's made-up date)
    entry = model_entry(b, m0.id)
    assert entry is not None
    assert (entry["status"], entry["copies"], entry["sizeBytes"], entry["type"]) == ("NOT_LOADED", [], None, "demo")
    assert entry["lastUsedMs"] == 0
    row = next(r for r in ok("models", "list", *at_a).splitlines() if r.startswith(m0.id))
    assert row.split()[3:6] == ["0", "-", "never"], row

    # inference loads the model; the listing shows where, its size and the use
    before_ms = int(time.time() * 1000)
    assert close_enough(b.infer(m0.id, ROWS), expected(m0, ROWS))
    holder, other = (a, b) if a.runtime_loaded() == [m0.id] else (b, a)
    assert holder.runtime_loaded() == [m0.id] and other.runtime_loaded() == []
    hid = holder.node.instance_id
    for client in (other, holder):  # from the holder itself and through the peer port
        entry = model_entry(client, m0.id)
        assert entry is not None
        assert entry["status"] == "LOADED" and entry["loadedCopies"] == 1
        assert [(c["instanceId"], c["state"], c["sizeBytes"]) for c in entry["copies"]] == [(hid, "LOADED", MODEL_SIZE)]
        assert entry["sizeBytes"] == MODEL_SIZE
        assert entry["lastUsedMs"] >= before_ms and entry["copies"][0]["lastUsedMs"] >= before_ms
    table = ok("models", "list", *at_a).splitlines()
    assert table[0].split() == ["MODEL", "TYPE", "STATUS", "COPIES", "SIZE", "LAST", "USED", "WHERE"]
    row = next(r for r in table[1:] if r.startswith(m0.id))
    assert row.split()[:6] == [m0.id, "demo", "LOADED", "1", "1.0", "MiB"] and row.endswith(hid), row
    detail = ok("models", "get", m0.id, *at_b)
    assert "size:" in detail and f"1.0 MiB ({MODEL_SIZE} bytes)" in detail and hid in detail
    assert ok_json("models", "get", m0.id, *at_b)["copies"][0]["instanceId"] == hid
    line = fails("models", "get", "no-such-model", *at_a)
    assert line == "meshd models get: model 'no-such-model' not found (NOT_FOUND)", line

    # instances: counts and capacity agree with the runtimes (records publish every 2 s)
    def instances_agree() -> bool:
        listed = {i["instanceId"]: i for i in ok_json("instances", "list", *at_a)["instances"]}
        return set(listed) == {"inst-a", "inst-b"} and all(
            listed[c.node.instance_id]["modelCount"] == len(c.runtime_loaded())
            and listed[c.node.instance_id]["usedBytes"] == MODEL_SIZE * len(c.runtime_loaded())
            for c in (a, b)
        )

    wait_until(instances_agree, 30, "instance records to show the load")
    listed = ok_json("instances", "list", *at_b)["instances"]
    assert [i["instanceId"] for i in listed] == ["inst-a", "inst-b"]
    for i in listed:
        assert i["capacityBytes"] == CAPACITY_MODELS * MODEL_SIZE
        assert i["location"].endswith(str((a if i["instanceId"] == "inst-a" else b).node.peer_port))
        assert not i["shutdown"] and i["startTimeMs"] <= time.time() * 1000
    assert sum(i["leader"] for i in listed) == 1
    assert next(i for i in listed if i["instanceId"] == hid)["lruAgeMs"] is not None
    table = ok("instances", "list", env={"MESHD_ADDRESS": b.node.target}).splitlines()  # address from the env
    assert table[0].split()[:4] == ["INSTANCE", "STATE", "LEADER", "CAPACITY"]
    assert [r.split()[0] for r in table[1:]] == ["inst-a", "inst-b"]
    assert all("8.0 MiB" in r and "serving" in r for r in table[1:])

    # vmodels: set, get, unregister refused while referenced, delete
    v = ok_json("vmodels", "set", "vm", m0.id, *at_a)
    assert (v["vmodelId"], v["status"], v["activeModelId"], v["targetModelId"]) == ("vm", "DEFINED", m0.id, m0.id)
    assert v["activeModel"]["status"] == "LOADED"
    assert ok_json("vmodels", "get", "vm", *at_b)["activeModelId"] == m0.id
    text = ok("vmodels", "get", "vm", *at_b)
    assert f"active model:  {m0.id} (LOADED)" in text, text
    line = fails("models", "unregister", m0.id, *at_b)
    assert line.startswith("meshd models unregister: ") and line.endswith("(FAILED_PRECONDITION)"), line
    # a new target registered with the vmodel, and a wrong expected target refused
    line = fails("vmodels", "set", "vm", m1.id, "--expected-target", "not-the-target", *at_a)
    assert line.startswith("meshd vmodels set: ") and line.endswith("(FAILED_PRECONDITION)"), line
    v = ok_json("vmodels", "set", "vm", m1.id, "--type", "demo", "--path", str(m1.path), "--force", *at_a)
    assert v["targetModelId"] == m1.id and v["activeModelId"] == m1.id
    assert model_entry(a, m1.id) is not None
    assert ok("vmodels", "delete", "vm", *at_b).strip() == "vmodel vm deleted"
    assert fails("vmodels", "get", "vm", *at_a) == "meshd vmodels get: vmodel 'vm' not found"

    # unregister once no vmodel references it
    assert ok_json("models", "unregister", m0.id, *at_a) == {"modelId": m0.id, "unregistered": True}
    wait_until(lambda: model_entry(b, m0.id) is None, 10, "the unregistered model to leave b's listing")

    # an unreachable holder: its copy is listed with state and size unknown
    m2 = models[2]
    ok("models", "register", m2.id, "--type", "demo", "--path", str(m2.path), *at_a)
    load_on(b, m2.id)
    b.node.meshd.kill()  # its record stays until its lease expires
    out = ok_json("models", "list", *at_a)
    entry = next(m for m in out["models"] if m["modelId"] == m2.id)
    assert out["unreachable"] == ["inst-b"]
    assert entry["status"] == "UNKNOWN" and entry["sizeBytes"] is None
    assert [(c["instanceId"], c["state"], c["sizeBytes"]) for c in entry["copies"]] == [("inst-b", "UNKNOWN", None)]
    assert "no answer from inst-b" in ok("models", "list", *at_a)

    # the mesh cannot be reached at all
    port = free_port()
    line = fails("models", "list", "--address", f"127.0.0.1:{port}")
    assert line == f"meshd models list: cannot reach meshd at 127.0.0.1:{port} (connection refused)", line
    line = fails("instances", "list", "--address", f"127.0.0.1:{port}", "--json")
    assert line == f"meshd instances list: cannot reach meshd at 127.0.0.1:{port} (connection refused)", line


def test_exit_codes_say_when_a_command_did_not_do_what_it_was_asked(start_node: NodeFactory, tmp_path: Any) -> None:
    """A load that failed under --load-now --sync, and unregistering or deleting what does
    not exist, exit 1 (they used to exit 0: scripts could not tell)."""
    a = start_node("inst-a")
    at = ("--address", a.node.target)
    missing = str(tmp_path / "no-such-model.json")
    done = meshd("models", "register", "broken", "--type", "demo", "--path", missing, "--load-now", "--sync", *at)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "LOADING_FAILED" in done.stdout and "Traceback" not in done.stderr
    assert done.stderr.strip() == "meshd models register: broken registered but not loaded (LOADING_FAILED)"
    assert fails("models", "unregister", "nosuch", *at) == "meshd models unregister: model 'nosuch' not found"
    assert fails("vmodels", "delete", "nosuch", *at) == "meshd vmodels delete: vmodel 'nosuch' not found"
    # What exists still goes as before, exit 0.
    assert ok_json("models", "unregister", "broken", *at) == {"modelId": "broken", "unregistered": True}
