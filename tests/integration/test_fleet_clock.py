"""The fleet's cache clock and use histories on a real mesh (issue 33): two meshd instances
with room for one model each. A model used five times on one instance and evicted there (its
last copy) keeps those uses in its etcd record; the other instance that loads it next starts
from them, so when it evicts the model in turn the record holds both instances' uses. Each
instance record carries its eviction count, from which the clock is shared."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from meshd.core.records import EVICTED_BY, FLEET_CLOCK, FLEET_EVICTED, REGRET, USE_HISTORY
from meshd.decisions.cache import to_units
from meshd.kv.embedded import EmbeddedEtcd
from meshd.runtimes.models import generate_models
from meshd.testing.cluster import LocalMesh
from meshd.testing.procs import wait_until

from .conftest import MODEL_SIZE, NodeFactory, close_enough, expected
from .test_mesh import load_on
from .test_upstream_keys import under, upstream_key

pytestmark = pytest.mark.slow

ROWS = [[1.0, 2.0, 3.0, 4.0]]


def test_a_models_use_history_outlives_its_last_copy_and_the_next_instance_starts_from_it(
    start_node: NodeFactory, mesh: LocalMesh, etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    a, b = start_node("inst-a", 1), start_node("inst-b", 1)
    m, x, y = generate_models(tmp_path / "models", 3, size_bytes=MODEL_SIZE)
    for model in (m, x, y):
        a.register(model)

    def record(kind: str, name: str) -> dict[str, Any]:
        key = upstream_key("", mesh.service, kind, name)
        return under(etcd_server, key).get(key, {})

    def history_once_gone() -> list[float] | None:
        rec = record("registry", m.id)
        return None if rec.get("instanceIds") else rec.get(USE_HISTORY)

    load_on(a, m.id)
    for _ in range(4):  # a's copy serves: four uses, five with its load's
        assert close_enough(a.infer(m.id, ROWS), expected(m, ROWS))
    load_on(a, x.id)  # room for one: m's last copy is evicted
    wait_until(lambda: history_once_gone() is not None, 15, "m's uses in its record, its copy gone")
    first = history_once_gone()
    assert first is not None and len(first) == 5, first

    load_on(b, m.id)  # b starts from a's five uses, plus its load's
    for _ in range(2):
        assert close_enough(b.infer(m.id, ROWS), expected(m, ROWS))
    load_on(b, y.id)
    wait_until(lambda: len(history_once_gone() or []) == 8, 15, "m's uses on both instances in its record")
    second = history_once_gone()
    assert second is not None and second[:5] == first and second == sorted(second), (first, second)

    units = to_units(MODEL_SIZE)
    for iid in (a.node.instance_id, b.node.instance_id):  # each evicted one model: its record says so

        def counted(iid: str = iid) -> bool:
            return bool(record("instances", iid).get(FLEET_EVICTED) == units)

        wait_until(counted, 15, f"{iid}'s eviction count")
        assert isinstance(record("instances", iid).get(FLEET_CLOCK), int | float)


def test_the_adaptive_order_notes_each_eviction_in_the_record_and_the_next_loader_is_charged(
    start_node: NodeFactory, mesh: LocalMesh, etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    """Issue 44 on real processes: under MESHD_EVICTION=adaptive the instance that evicts a
    model's last copy notes in its record which order chose it; the other instance that loads
    it next charges that order (its record's tally says so) and clears the note; both publish
    their tallies, which every instance sums to choose its order."""
    settings: dict[str, str | int] = {"eviction": "adaptive"}
    a, b = start_node("inst-a", 1, settings=settings), start_node("inst-b", 1, settings=settings)
    m, x = generate_models(tmp_path / "models", 2, size_bytes=MODEL_SIZE)
    for model in (m, x):
        a.register(model)

    def record(kind: str, name: str) -> dict[str, Any]:
        key = upstream_key("", mesh.service, kind, name)
        return under(etcd_server, key).get(key, {})

    load_on(a, m.id)
    load_on(a, x.id)  # room for one: m's last copy is evicted, by RATE's order (the start)
    wait_until(lambda: not record("registry", m.id).get("instanceIds"), 15, "m's copy gone")
    wait_until(lambda: EVICTED_BY in record("registry", m.id), 15, "m's eviction note")
    order, clock = record("registry", m.id)[EVICTED_BY]
    assert order == "rate" and isinstance(clock, int | float)

    load_on(b, m.id)  # b charges RATE for it
    assert close_enough(b.infer(m.id, ROWS), expected(m, ROWS))
    wait_until(lambda: EVICTED_BY not in record("registry", m.id), 15, "the note cleared by b's copy")

    def tally(iid: str) -> list[float]:
        return list(record("instances", iid).get(REGRET) or [0, 0, 0, 0])

    wait_until(lambda: tally(b.node.instance_id)[1] > 0, 30, "b's record: RATE charged for the reload")
    wait_until(lambda: tally(a.node.instance_id)[0] >= 1, 30, "a's record: one eviction by RATE's order")
