"""Keys as upstream lays them out, checked with a writer and reader of the test's own.

The writer and reader below follow the upstream notes (../shared/reference, "etcd key
layout"): `rootPrefix + "/" + MM_KVSTORE_PREFIX + "/" + MM_SERVICE_NAME + "/registry/" + id`
(likewise `vmodels/`, `instances/`, `leaderLatch/`), a leading `/` when the root prefix is
empty, the root used exactly as given otherwise; records are JSON with upstream's field names
and fields at their default left out. They talk to etcd over its own JSON gateway (`/v3/kv/*`),
not through meshd's code, so meshd's key rule is checked against an independent one.
"""

from __future__ import annotations

import base64
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from meshd.kv.embedded import EmbeddedEtcd
from meshd.runtimes.models import GeneratedModel
from meshd.testing.cluster import LocalMesh
from meshd.testing.procs import wait_until

from .conftest import NodeFactory, close_enough, expected

pytestmark = pytest.mark.slow

UPSTREAM_KVSTORE_PREFIX = "tas-runtime"  # upstream's default MM_KVSTORE_PREFIX
ROWS = [[1.0, 2.0, 3.0, 4.0]]


def upstream_key(root: str, service: str, kind: str, name: str = "") -> str:
    return f"{root or ''}/{UPSTREAM_KVSTORE_PREFIX}/{service}/{kind}/{name}"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _gateway(etcd: EmbeddedEtcd, call: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"{etcd.url}/v3/kv/{call}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


def put(etcd: EmbeddedEtcd, key: str, record: dict[str, Any]) -> None:
    _gateway(etcd, "put", {"key": _b64(key), "value": _b64(json.dumps(record))})


def under(etcd: EmbeddedEtcd, prefix: str) -> dict[str, dict[str, Any]]:
    """Every key under `prefix` with its JSON value (prefix range: the last byte plus one)."""
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    kvs = _gateway(etcd, "range", {"key": _b64(prefix), "range_end": _b64(end)}).get("kvs", [])
    out: dict[str, dict[str, Any]] = {}
    for kv in kvs:
        value = base64.b64decode(kv.get("value", "")).decode(errors="replace")
        try:
            record = json.loads(value)
        except ValueError:
            record = None  # not a record (a leader latch's value, another test's raw write)
        out[base64.b64decode(kv["key"]).decode()] = record if isinstance(record, dict) else {}
    return out


@pytest.mark.parametrize("root", ["", "team-a", "/team-a", "team-a/"], ids=["none", "plain", "leading", "trailing"])
def test_meshd_serves_records_written_by_upstreams_rules_and_writes_them_so(
    root: str,
    start_node: NodeFactory,
    mesh: LocalMesh,
    etcd_server: EmbeddedEtcd,
    models: list[GeneratedModel],
    tmp_path: Path,
) -> None:
    svc = mesh.service
    written, vmodel, registered = models[0], f"{models[0].id}-v", models[1]
    # Upstream's writer leaves fields at their default out: no instanceIds, refs, lu, autoDel.
    put(etcd_server, upstream_key(root, svc, "registry", written.id), {"type": "demo", "mPath": str(written.path)})
    vrecord = {"o": "isvc-a", "amid": written.id, "tmid": written.id}
    put(etcd_server, upstream_key(root, svc, "vmodels", vmodel), vrecord)

    conn = tmp_path / "etcd_connection"  # as the controller mounts it from its secret
    conn.write_text(json.dumps({"endpoints": etcd_server.url, "root_prefix": root}))
    client = start_node("inst-a", settings={"kv_store": f"etcd:{conn}"})

    # meshd finds and serves what the independent writer put under upstream's keys...
    assert close_enough(client.infer(written.id, ROWS), expected(written, ROWS))
    assert close_enough(client.infer(vmodel, ROWS, header="mm-vmodel-id"), expected(written, ROWS))

    # ...and writes where the independent reader looks.
    client.register(registered)
    assert close_enough(client.infer(registered.id, ROWS), expected(registered, ROWS))
    records = under(etcd_server, upstream_key(root, svc, "registry"))
    assert set(records) == {upstream_key(root, svc, "registry", m.id) for m in (written, registered)}
    mine = records[upstream_key(root, svc, "registry", registered.id)]
    assert mine["type"] == "demo" and mine["mPath"] == str(registered.path) and "inst-a" in mine["instanceIds"]
    instances = under(etcd_server, upstream_key(root, svc, "instances"))
    assert list(instances) == [upstream_key(root, svc, "instances", "inst-a")]
    assert instances[upstream_key(root, svc, "instances", "inst-a")]["loc"].endswith(f":{client.node.peer_port}")
    wait_until(lambda: under(etcd_server, upstream_key(root, svc, "leaderLatch")), 20, "a leader latch key")
    # Nothing of this service's was written anywhere but under the root prefix.
    everything = under(etcd_server, "/") | under(etcd_server, "t")
    strays = [k for k in everything if f"/{svc}/" in k and not k.startswith(upstream_key(root, svc, "").rstrip("/"))]
    assert strays == []
