"""The disk watch (issue 42): the runtime's diskInventory becomes the record's meshdDisk value;
an unchanged answer does nothing, a failed call keeps the last value, UNIMPLEMENTED is no tier."""

from __future__ import annotations

import grpc
import pytest

from meshd._proto.meshd import disk_pb2
from meshd.decisions.placement.disk import disk_reading
from meshd.loops.disk_watch import DiskWatch
from meshd.testing.fake_runtime import FakeRpcError


class Disk:
    """A runtime's disk tier: answers what it is told, or fails as told."""

    def __init__(self) -> None:
        self.answer: disk_pb2.DiskInventoryResponse | None = None
        self.error: grpc.StatusCode | None = None
        self.calls = 0

    def holds(self, version: int, *models: tuple[str, int, int]) -> None:
        self.answer = disk_pb2.DiskInventoryResponse(
            models=[disk_pb2.DiskModel(model_id=m, size_bytes=s, pull_ms=p) for m, s, p in models], version=version
        )

    async def disk_inventory(self) -> disk_pb2.DiskInventoryResponse | None:
        self.calls += 1
        if self.error is not None:
            raise FakeRpcError(self.error, "no")
        return self.answer


def watched(disk: Disk) -> tuple[DiskWatch, list[int]]:
    watch = DiskWatch(disk, interval_s=0)
    kicks: list[int] = []
    watch.on_change = lambda: kicks.append(1)
    return watch, kicks


async def test_the_inventory_becomes_the_record_value_and_only_a_change_kicks_the_publisher() -> None:
    disk = Disk()
    disk.holds(1, ("m1", 1 << 30, 4000), ("m2", 1 << 29, 2000))
    watch, kicks = watched(disk)
    await watch.check()
    reading = disk_reading({"meshdDisk": watch.value})
    assert reading is not None and reading.count == 2 and "m1" in reading and "m2" in reading
    assert reading.pull_ms_per_gib == pytest.approx(4000)
    assert watch.implemented is True and kicks == [1]
    await watch.check()  # the same version: nothing to publish
    assert kicks == [1]
    disk.holds(2, ("m1", 1 << 30, 4000))
    await watch.check()
    reading = disk_reading({"meshdDisk": watch.value})
    assert reading is not None and reading.count == 1 and kicks == [1, 1]


async def test_a_failed_call_keeps_what_the_disk_held() -> None:
    disk = Disk()
    disk.holds(1, ("m1", 1 << 30, 4000))
    watch, kicks = watched(disk)
    await watch.check()
    value = watch.value
    disk.error = grpc.StatusCode.UNAVAILABLE
    await watch.check()
    assert watch.value == value and watch.implemented is True and kicks == [1]


async def test_a_runtime_without_a_tier_publishes_nothing_and_is_not_asked_again() -> None:
    disk = Disk()  # answers None: the client's reading of UNIMPLEMENTED
    watch, kicks = watched(disk)
    await watch.run()  # returns: nothing to follow
    assert watch.value is None and watch.implemented is False and disk.calls == 1 and kicks == []
