"""Responses as the operator CLI prints them (pure): `--json` objects and text.

The `--json` field names are a stable interface (docs/operations.md, "Operator CLI"): camelCase like the
management API, times as `...Ms` (milliseconds since the epoch), sizes as `...Bytes`,
unknown values as null.
"""

from __future__ import annotations

from typing import Any

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.ops.format import NONE, ago, block, duration, indent, last_used, percent, size, table, timestamp, version

JSON = dict[str, Any]

_MODEL_STATUS = mm.ModelStatusInfo.ModelStatus
_VMODEL_STATUS = mm.VModelStatusInfo.VModelStatus
_SUFFIX = {"LOADING": " (loading)", "LOADING_FAILED": " (failed)", "UNKNOWN": " (unknown)"}


def status_name(value: int) -> str:
    return str(_MODEL_STATUS.Name(value))


def _optional(msg: Any, name: str) -> int | None:
    return int(getattr(msg, name)) if msg.HasField(name) else None


# ---- listings (meshd.admin.MeshAdmin) ------------------------------------------------------
def copy_json(c: Any) -> JSON:
    return {
        "instanceId": c.instanceId,
        "state": status_name(c.state),
        "sinceMs": c.sinceMs,
        "sizeBytes": _optional(c, "sizeBytes"),
        "lastUsedMs": c.lastUsedMs,
        "error": c.error,
    }


def model_json(m: Any) -> JSON:
    return {
        "modelId": m.modelId,
        "type": m.type,
        "path": m.path,
        "status": status_name(m.status),
        "loadedCopies": sum(1 for c in m.copies if c.state == _MODEL_STATUS.LOADED),
        "copies": [copy_json(c) for c in m.copies],
        "sizeBytes": _optional(m, "sizeBytes"),
        "lastUsedMs": m.lastUsedMs,
        "refs": m.refs,
        "autoDelete": m.autoDelete,
        "errors": list(m.errors),
    }


def models_json(resp: Any) -> JSON:
    return {
        "models": [model_json(m) for m in resp.models],
        "nowMs": resp.nowMs,
        "unreachable": list(resp.unreachable),
    }


def where(m: Any) -> str:
    """Holders, loaded copies plain and others marked: `inst-a, inst-b (loading)`."""
    return ", ".join(c.instanceId + _SUFFIX.get(status_name(c.state), "") for c in m.copies) or NONE


def models_table(resp: Any) -> str:
    rows = [
        [
            m.modelId,
            m.type,
            status_name(m.status),
            str(sum(1 for c in m.copies if c.state == _MODEL_STATUS.LOADED)),
            size(_optional(m, "sizeBytes")),
            last_used(m.lastUsedMs, resp.nowMs),
            where(m),
        ]
        for m in resp.models
    ]
    out = table(["MODEL", "TYPE", "STATUS", "COPIES", "SIZE", "LAST USED", "WHERE"], rows)
    return out + _unreachable_note(resp)


def _unreachable_note(resp: Any) -> str:
    if not resp.unreachable:
        return ""
    return f"\n(no answer from {', '.join(resp.unreachable)}: their copies' state and size are unknown)"


def model_block(m: Any, now_ms: int) -> str:
    pairs = [
        ("model", m.modelId),
        ("type", m.type),
        ("path", m.path or NONE),
        ("status", status_name(m.status)),
        ("size", _size_long(_optional(m, "sizeBytes"))),
        ("last used", timestamp(m.lastUsedMs, now_ms) if m.lastUsedMs else "never"),
        ("vmodel refs", str(m.refs)),
        ("auto-delete", "yes" if m.autoDelete else "no"),
        ("copies", str(len(m.copies)) if m.copies else NONE),
    ]
    text = block(pairs)
    if m.copies:
        rows = [
            [
                c.instanceId,
                status_name(c.state),
                ago(c.sinceMs, now_ms),
                size(_optional(c, "sizeBytes")),
                ago(c.lastUsedMs, now_ms),
                c.error,
            ]
            for c in m.copies
        ]
        text += "\n" + indent(table(["INSTANCE", "STATE", "SINCE", "SIZE", "LAST USED", "ERROR"], rows))
    if m.errors:
        text += "\nerrors:\n" + indent("\n".join(m.errors))
    return text


def _size_long(nbytes: int | None) -> str:
    return NONE if nbytes is None else f"{size(nbytes)} ({nbytes} bytes)"


def instance_json(i: Any, now_ms: int) -> JSON:
    return {
        "instanceId": i.instanceId,
        "location": i.location,
        "zone": i.zone,
        "labels": list(i.labels),
        "capacityBytes": i.capacityBytes,
        "usedBytes": i.usedBytes,
        "modelCount": i.modelCount,
        "rpm": i.rpm,
        "lruTimeMs": i.lruTimeMs,
        "lruAgeMs": max(now_ms - i.lruTimeMs, 0) if i.modelCount else None,
        "shutdown": i.shutdown,
        "startTimeMs": i.startTimeMs,
        "version": i.version,
        "loadingThreads": i.loadingThreads,
        "loadingInProgress": i.loadingInProgress,
        "leader": i.leader,
        "runtimeDown": i.runtimeDown,
        "upstream": i.upstream,
    }


def instances_json(resp: Any) -> JSON:
    return {"instances": [instance_json(i, resp.nowMs) for i in resp.instances], "nowMs": resp.nowMs}


def _state(i: Any) -> str:
    if i.upstream:  # a Java ModelMesh instance: meshd never routes to it
        return "upstream (java)"
    if i.runtimeDown:  # shutdown is set too (placement skips it), but nothing is draining
        return "runtime down"
    return "stopping" if i.shutdown else "serving"


def instances_table(resp: Any) -> str:
    now = resp.nowMs
    rows = [
        [
            i.instanceId,
            _state(i),
            "yes" if i.leader else "",
            size(i.capacityBytes),
            f"{size(i.usedBytes)} {percent(i.usedBytes, i.capacityBytes)}",
            str(i.modelCount),
            str(i.rpm),
            duration(now - i.lruTimeMs) if i.modelCount and i.lruTimeMs else NONE,
            duration(now - i.startTimeMs) if i.startTimeMs else NONE,
            i.zone or NONE,
            i.location,
            version(i.version),
            ",".join(i.labels) or NONE,
        ]
        for i in resp.instances
    ]
    headers = ["INSTANCE", "STATE", "LEADER", "CAPACITY", "USED", "MODELS", "RPM", "LRU AGE", "UP"]
    return table([*headers, "ZONE", "LOCATION", "VERSION", "LABELS"], rows)


# ---- management API (mmesh.ModelMesh) -------------------------------------------------------
def status_json(model_id: str, st: Any) -> JSON:
    return {
        "modelId": model_id,
        "status": status_name(st.status),
        "errors": list(st.errors),
        "copies": [
            {"instanceId": c.location, "state": status_name(c.copyStatus), "sinceMs": c.time} for c in st.modelCopyInfos
        ],
    }


def status_block(model_id: str, st: Any, now_ms: int) -> str:
    copies = ", ".join(
        f"{c.location} {status_name(c.copyStatus)} since {ago(c.time, now_ms)}" for c in st.modelCopyInfos
    )
    pairs = [("model", model_id), ("status", status_name(st.status)), ("copies", copies or NONE)]
    pairs += [("error", e) for e in st.errors]
    return block(pairs)


def vmodel_json(vmodel_id: str, v: Any) -> JSON:
    return {
        "vmodelId": vmodel_id,
        "status": str(_VMODEL_STATUS.Name(v.status)),
        "activeModelId": v.activeModelId,
        "targetModelId": v.targetModelId,
        "owner": v.owner,
        "activeModel": status_json(v.activeModelId, v.activeModelStatus) if v.activeModelId else None,
        "targetModel": status_json(v.targetModelId, v.targetModelStatus) if v.targetModelId else None,
    }


def vmodel_block(vmodel_id: str, v: Any) -> str:
    def model(model_id: str, st: Any) -> str:
        return f"{model_id} ({status_name(st.status)})" if model_id else NONE

    pairs = [
        ("vmodel", vmodel_id),
        ("status", str(_VMODEL_STATUS.Name(v.status))),
        ("active model", model(v.activeModelId, v.activeModelStatus)),
        ("target model", model(v.targetModelId, v.targetModelStatus)),
        ("owner", v.owner or NONE),
    ]
    errors = [*v.activeModelStatus.errors, *(v.targetModelStatus.errors if v.targetModelId != v.activeModelId else ())]
    pairs += [("error", e) for e in errors]
    return block(pairs)
