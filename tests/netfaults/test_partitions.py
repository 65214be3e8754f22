"""Partitions, an asymmetric link, an isolated leader, a lost etcd member, and a slow lossy
link, each under client load on one mesh of hosts of their own, then healed."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest

from meshd.kv.store import StoreError
from meshd.testing.netmesh import GRPC_PORT
from meshd.testing.procs import wait_until

from .conftest import INSTANCES, SETTINGS, WAIT_S, Fault, Net, Observer, Row, Traffic

pytestmark = pytest.mark.slow

LEASE_S = int(SETTINGS["instance_ttl_s"])
HOLD_S = 3 * LEASE_S  # each fault lasts well past one lease
ETCD = ["etcd1", "etcd2", "etcd3"]


def run_fault(
    net: Net,
    name: str,
    hit: str,
    apply: Callable[[], None],
    *,
    ingress_during: list[str] | None = None,
    hold_s: float = HOLD_S,
    during: Callable[[], None] | None = None,
    undo: Callable[[], None] | None = None,
) -> tuple[Row, Fault]:
    with Observer(net) as observer, Traffic(net, list(INSTANCES)) as traffic:
        time.sleep(1.0)
        fault = Fault(net, name, hit, traffic, observer)
        fault.begin()
        if ingress_during is not None:
            traffic.use(ingress_during)
        try:
            apply()
            until = time.monotonic() + hold_s
            if during is not None:
                during()
            time.sleep(max(0.0, until - time.monotonic()))
        finally:
            if undo is not None:
                undo()
            fault.end()
        fault.settle()
    row = fault.account()
    row.report()
    return row, fault


def check(row: Row, hit_may_fail: bool = False) -> None:
    assert row.served > 0, row
    assert row.failed_spared == 0, row.errors
    # Healed and agreed: every model serves through every instance again, the capped one too
    # (the chaos soak found it refused for up to 10 s after a heal: its holder still marked
    # unreachable, though etcd said it was alive).
    assert row.failed_after_agreement == 0, row.errors
    if not hit_may_fail:
        assert row.failed_hit == 0, row.errors
    assert not row.duplicated, row.duplicated
    assert not row.lost, row.lost
    assert not [e for e in row.errors if e.startswith("no agreement")], row.errors


def _gone_from_others(net: Net, iid: str) -> None:
    for other in INSTANCES:
        if other != iid:
            c = net.clients[other]
            wait_until(lambda c=c: _quiet(lambda: iid not in c.listed_instances()), WAIT_S, f"{iid} to expire")


def _quiet(check: Callable[[], bool]) -> bool:
    try:
        return check()
    except (grpc.RpcError, StoreError, OSError):
        return False


def test_instance_cut_off_from_etcd_but_not_peers(net: Net) -> None:
    """Its lease runs out; it keeps serving what it holds and forwarding to its peers."""
    row, _ = run_fault(
        net, "instance cut off from etcd (not from peers), 3 leases", "inst-a",
        lambda: net.lab.cut("inst-a", ETCD), during=lambda: _gone_from_others(net, "inst-a"),
    )  # fmt: skip
    check(row)


def test_instance_cut_off_from_peers_but_not_etcd(net: Net) -> None:
    """Its lease holds: the others must route around it without its record going."""
    others = [i for i in INSTANCES if i != "inst-a"]
    row, _ = run_fault(net, "instance cut off from its peers (not from etcd)", "inst-a",
                       lambda: net.lab.cut("inst-a", others))  # fmt: skip
    # Through the cut instance, a model it does not hold cannot be served: its copies are on
    # peers it cannot reach, and a third copy would exceed the model's max.
    check(row, hit_may_fail=True)


def test_asymmetric_partition_can_send_not_receive(net: Net) -> None:
    """Nothing reaches it from peers or etcd (nor clients), while what it sends arrives."""
    others = [i for i in INSTANCES if i != "inst-a"]

    def apply() -> None:
        net.lab.block("inst-a", [*others, *ETCD])
        net.lab.block("inst-a", ["observer"], port=GRPC_PORT)  # clients; the observer still asks

    row, _ = run_fault(net, "asymmetric: sends, receives nothing", "inst-a", apply, ingress_during=others)
    check(row)


def test_leader_isolated_from_everything(net: Net) -> None:
    leader = net.leader_in_etcd()
    assert leader is not None
    others = [i for i in INSTANCES if i != leader]

    def apply() -> None:
        net.lab.cut(leader, [*others, *ETCD])
        net.lab.block(leader, ["observer"], port=GRPC_PORT)

    def new_leader() -> None:
        wait_until(lambda: _quiet(lambda: net.leader_in_etcd() in others), WAIT_S, "another leader")

    row, _ = run_fault(net, "leader isolated from everything", leader, apply, ingress_during=others, during=new_leader)
    check(row)


def test_minority_etcd_member_partitioned_away(net: Net) -> None:
    """etcd1, first in every instance's KV_STORE list, loses everyone; the other two keep a
    quorum, so no instance may lose its lease: the mesh should not notice."""
    hosts = [*INSTANCES, "etcd2", "etcd3"]
    leases = net.instance_leases()
    row, _ = run_fault(net, "minority etcd member partitioned away", "etcd1",
                       lambda: net.lab.cut("etcd1", hosts), hold_s=4 * LEASE_S)  # fmt: skip
    check(row)
    assert net.instance_leases() == leases  # the same leases: none ran out


def test_delay_and_loss_on_one_instance_link(net: Net) -> None:
    row, _ = run_fault(
        net, "100 ms each way (200 ms round trip) and 5 % loss each way on one instance's link", "inst-a",
        lambda: net.lab.shape("inst-a", 100, 0.05), hold_s=4 * LEASE_S, undo=lambda: net.lab.unshape("inst-a"),
    )  # fmt: skip
    check(row)
