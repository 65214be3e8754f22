"""What the operator CLI prints for given answers (tables and `--json`)."""

from __future__ import annotations

from typing import Any

from meshd._proto.meshd import admin_pb2 as pb
from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.ops import render

NOW = 1_700_000_000_000
MIB = 1 << 20


def listing() -> Any:
    m1 = pb.ModelSummary(
        modelId="m1", type="demo", path="/m/1", status="LOADED", sizeBytes=MIB, lastUsedMs=NOW - 5_000, refs=1
    )
    m1.copies.add(instanceId="a", state="LOADED", sinceMs=NOW - 60_000, sizeBytes=MIB, lastUsedMs=NOW - 5_000)
    m1.copies.add(instanceId="b", state="LOADING", sinceMs=NOW - 1_000)
    m1.copies.add(instanceId="c", state="UNKNOWN", sinceMs=NOW - 90_000)
    m2 = pb.ModelSummary(modelId="m2", type="demo", status="LOADING_FAILED", lastUsedMs=0, errors=["x: boom"])
    m2.copies.add(instanceId="x", state="LOADING_FAILED", sinceMs=NOW - 2_000, error="boom")
    return pb.ListModelsResponse(models=[m1, m2], nowMs=NOW, unreachable=["c"])


def test_models_table() -> None:
    assert render.models_table(listing()).splitlines() == [
        "MODEL  TYPE  STATUS          COPIES  SIZE     LAST USED  WHERE",
        "m1     demo  LOADED          1       1.0 MiB  5s ago     a, b (loading), c (unknown)",
        "m2     demo  LOADING_FAILED  0       -        never      x (failed)",
        "(no answer from c: their copies' state and size are unknown)",
    ]


def test_models_json_names_and_unknowns() -> None:
    out = render.models_json(listing())
    assert out["nowMs"] == NOW and out["unreachable"] == ["c"]
    m1, m2 = out["models"]
    assert m1 == {
        "modelId": "m1",
        "type": "demo",
        "path": "/m/1",
        "status": "LOADED",
        "loadedCopies": 1,
        "copies": [
            {
                "instanceId": "a",
                "state": "LOADED",
                "sinceMs": NOW - 60_000,
                "sizeBytes": MIB,
                "lastUsedMs": NOW - 5_000,
                "error": "",
            },
            {
                "instanceId": "b",
                "state": "LOADING",
                "sinceMs": NOW - 1_000,
                "sizeBytes": None,
                "lastUsedMs": 0,
                "error": "",
            },
            {
                "instanceId": "c",
                "state": "UNKNOWN",
                "sinceMs": NOW - 90_000,
                "sizeBytes": None,
                "lastUsedMs": 0,
                "error": "",
            },
        ],
        "sizeBytes": MIB,
        "lastUsedMs": NOW - 5_000,
        "refs": 1,
        "autoDelete": False,
        "errors": [],
    }
    assert (m2["sizeBytes"], m2["errors"], m2["copies"][0]["error"]) == (None, ["x: boom"], "boom")


def test_model_block() -> None:
    text = render.model_block(listing().models[1], NOW)
    assert "status:       LOADING_FAILED" in text
    assert "size:         -" in text
    assert "last used:    never" in text
    assert "  x         LOADING_FAILED  2s ago  -     -          boom" in text
    assert text.endswith("errors:\n  x: boom")


def instances() -> Any:
    common = {"capacityBytes": 8 * MIB, "startTimeMs": NOW - 120_000, "version": 100, "location": "10.0.0.1:8080"}
    return pb.ListInstancesResponse(
        instances=[
            pb.InstanceSummary(
                instanceId="a",
                usedBytes=2 * MIB,
                modelCount=2,
                rpm=30,
                lruTimeMs=NOW - 300_000,
                leader=True,
                zone="z1",
                labels=["gpu", "big"],
                **common,
            ),
            pb.InstanceSummary(instanceId="b", usedBytes=0, modelCount=0, lruTimeMs=NOW, shutdown=True, **common),
            pb.InstanceSummary(instanceId="c", lruTimeMs=NOW, shutdown=True, runtimeDown=True, **common),
        ],
        nowMs=NOW,
    )


def test_instances_table() -> None:
    assert render.instances_table(instances()).splitlines() == [
        "INSTANCE  STATE         LEADER  CAPACITY  USED         MODELS  RPM  LRU AGE  UP  ZONE  LOCATION       VERSION"
        "  LABELS",
        "a         serving       yes     8.0 MiB   2.0 MiB 25%  2       30   5m       2m  z1    10.0.0.1:8080  0.1.0"
        "    gpu,big",
        "b         stopping              8.0 MiB   0 B 0%       0       0    -        2m  -     10.0.0.1:8080"
        "  0.1.0    -",
        # shutdown is set for placement, but this one is not draining: its runtime is dead
        "c         runtime down          8.0 MiB   0 B 0%       0       0    -        2m  -     10.0.0.1:8080"
        "  0.1.0    -",
    ]


def test_instances_json() -> None:
    a, b, c = render.instances_json(instances())["instances"]
    assert a == {
        "instanceId": "a",
        "location": "10.0.0.1:8080",
        "zone": "z1",
        "labels": ["gpu", "big"],
        "capacityBytes": 8 * MIB,
        "usedBytes": 2 * MIB,
        "modelCount": 2,
        "rpm": 30,
        "lruTimeMs": NOW - 300_000,
        "lruAgeMs": 300_000,
        "shutdown": False,
        "startTimeMs": NOW - 120_000,
        "version": 100,
        "loadingThreads": 0,
        "loadingInProgress": 0,
        "leader": True,
        "runtimeDown": False,
        "upstream": False,
    }
    assert (b["lruAgeMs"], b["shutdown"], b["runtimeDown"]) == (None, True, False)  # no loaded models: no LRU age
    assert (c["shutdown"], c["runtimeDown"]) == (True, True)


def test_an_upstream_instance_shows_as_such() -> None:
    resp = instances()
    resp.instances[0].upstream = True
    assert render.instances_table(resp).splitlines()[1].split()[1:3] == ["upstream", "(java)"]
    assert render.instances_json(resp)["instances"][0]["upstream"] is True


def test_status_and_vmodel() -> None:
    st = mm.ModelStatusInfo(status=mm.ModelStatusInfo.LOADED, errors=["b: boom"])
    st.modelCopyInfos.add(location="a", copyStatus=mm.ModelStatusInfo.LOADED, time=NOW - 3_000)
    assert render.status_json("m1", st) == {
        "modelId": "m1",
        "status": "LOADED",
        "errors": ["b: boom"],
        "copies": [{"instanceId": "a", "state": "LOADED", "sinceMs": NOW - 3_000}],
    }
    assert render.status_block("m1", st, NOW).splitlines() == [
        "model:   m1",
        "status:  LOADED",
        "copies:  a LOADED since 3s ago",
        "error:   b: boom",
    ]
    v = mm.VModelStatusInfo(status=mm.VModelStatusInfo.TRANSITIONING, activeModelId="m1", targetModelId="m2")
    v.activeModelStatus.CopyFrom(st)
    v.targetModelStatus.status = mm.ModelStatusInfo.LOADING
    out = render.vmodel_json("vm", v)
    assert (out["status"], out["activeModel"]["status"], out["targetModel"]["status"], out["owner"]) == (
        "TRANSITIONING",
        "LOADED",
        "LOADING",
        "",
    )
    assert render.vmodel_block("vm", v).splitlines() == [
        "vmodel:        vm",
        "status:        TRANSITIONING",
        "active model:  m1 (LOADED)",
        "target model:  m2 (LOADING)",
        "owner:         -",
        "error:         b: boom",
    ]
