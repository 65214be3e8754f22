"""The disk tier on real meshd processes (issue 42): meshd asks its runtime what it keeps on
its disk (`meshd.disk.DiskTier/diskInventory`), publishes it in its instance record
(`meshdDisk`, an added key) and places a load where the model's files already are."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from meshd.core.records import DISK_TIER
from meshd.decisions.placement.disk import disk_reading
from meshd.kv.embedded import EmbeddedEtcd
from meshd.runtimes.models import GeneratedModel
from meshd.testing.cluster import LocalMesh
from meshd.testing.procs import wait_until

from .conftest import NodeFactory, close_enough, expected, listed_instances
from .test_mesh import copies
from .test_upstream_keys import under, upstream_key

pytestmark = pytest.mark.slow

ROWS = [[1.0, 2.0, 3.0, 4.0]]


def record(etcd: EmbeddedEtcd, mesh: LocalMesh, instance_id: str) -> dict[str, Any]:
    key = upstream_key("", mesh.service, "instances", instance_id)
    return under(etcd, key).get(key, {})


def test_loads_go_where_the_files_are_on_disk_and_the_record_follows_the_disk(
    start_node: NodeFactory, mesh: LocalMesh, etcd_server: EmbeddedEtcd, models: list[GeneratedModel], tmp_path: Path
) -> None:
    disk = tmp_path / "disk-a"
    disk.mkdir()
    held, later = models[:4], models[4]
    for m in held:  # what pulls onto a's disk left there
        shutil.copy(m.path, disk / m.id)
    a = start_node("inst-a", runtime_args=["--disk-dir", str(disk)])
    b = start_node("inst-b")  # no tier: diskInventory is UNIMPLEMENTED
    wait_until(lambda: listed_instances(b) >= {"inst-a", "inst-b"}, 15, "inst-b to see inst-a")
    wait_until(lambda: DISK_TIER in record(etcd_server, mesh, "inst-a"), 15, "inst-a's record to carry its disk")
    on_a = disk_reading(record(etcd_server, mesh, "inst-a"))
    assert on_a is not None and on_a.count == len(held) and on_a.pull_ms_per_gib > 0
    assert all(m.id in on_a for m in held)
    assert DISK_TIER not in record(etcd_server, mesh, "inst-b")  # upstream's shape: no added key

    # Each request arrives at b, which has room and an idle thread: every load still goes to
    # a, where it skips the pull. Without the tier placement spreads them (recent loads).
    for m in held:
        b.register(m)
        assert close_enough(b.infer(m.id, ROWS), expected(m, ROWS))
        assert copies(b, m.id) == {"inst-a"}, m.id
    assert sorted(a.runtime_loaded()) == sorted(m.id for m in held) and b.runtime_loaded() == []

    # A pull lands on a's disk later: the record says so within a poll or two.
    shutil.copy(later.path, disk / later.id)

    def holds_later() -> bool:
        reading = disk_reading(record(etcd_server, mesh, "inst-a"))
        return reading is not None and reading.count == len(held) + 1 and later.id in reading

    wait_until(holds_later, 20, "inst-a's record to name the newly pulled model")
