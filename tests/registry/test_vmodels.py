"""VModels on MemoryStore-backed tables: setVModel / deleteVModel / getVModelStatus
semantics (SPEC §2), reference counting, auto-deletion and transitions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from meshd.core.errors import AlreadyExists, DataLoss, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from meshd.core.records import ModelRecord, VModelRecord
from meshd.decisions.ids import ModelInfo
from meshd.kv.memory import MemoryStore
from meshd.kv.store import Compare, Op, StoreUnavailable, TxnResult
from meshd.kv.table import Table
from meshd.registry.models import REGISTER_AGE_LOAD_NOW_MS, REGISTER_AGE_NO_LOAD_MS, Registry
from meshd.registry.vmodels import (
    VMODEL_NOT_FOUND,
    SetVModel,
    VModels,
    VModelStatus,
    VModelStatusView,
    transition,
)

NOW = 50_000_000


class FlakyStore:
    """Delegates to a MemoryStore; transactions fail while `down` is set."""

    def __init__(self) -> None:
        self.inner = MemoryStore()
        self.down = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Op]) -> TxnResult:
        if self.down:
            raise StoreUnavailable("etcd is down")
        return await self.inner.txn(compares, ops)


@dataclass
class Rig:
    store: FlakyStore
    registry: Registry
    vm: VModels
    copies: dict[str, int] = field(default_factory=dict)
    loads: list[str] = field(default_factory=list)
    now: list[int] = field(default_factory=lambda: [NOW])

    def model(self, model_id: str) -> ModelRecord | None:
        return self.registry.get(model_id)

    def refs(self, model_id: str) -> int | None:
        rec = self.registry.get(model_id)
        return rec.refs if rec is not None else None

    async def register(self, model_id: str, auto_delete: bool = False, last_used: int = 0) -> None:
        await self.registry.register(model_id, ModelInfo("demo", f"/{model_id}"), last_used or NOW - 1000)
        if auto_delete:
            await self.registry.models.update(model_id, lambda r: _with_autodel(r))

    async def set(self, vmodel_id: str, target: str, **kw: Any) -> VModelStatusView:
        return await self.vm.set_vmodel(SetVModel(vmodel_id, target, **kw))


def _with_autodel(rec: ModelRecord | None) -> ModelRecord:
    assert rec is not None
    rec.auto_delete = True
    return rec


async def make_rig(default_owner: str = "") -> Rig:
    store = FlakyStore()
    models = Table(store, "/t/registry/", ModelRecord.decode, ModelRecord.encode)
    vmodels = Table(store, "/t/vmodels/", VModelRecord.decode, VModelRecord.encode)
    await models.start()
    await vmodels.start()
    registry = Registry(models, vmodels)
    copies: dict[str, int] = {}
    loads: list[str] = []
    now = [NOW]

    async def ensure_loading(model_id: str) -> None:
        loads.append(model_id)

    vm = VModels(
        registry,
        default_owner,
        lambda m: copies.get(m, 0),
        ensure_loading,
        clock=lambda: now[0],
        failure_expiry_ms=900_000,
    )
    return Rig(store, registry, vm, copies, loads, now)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = await make_rig()
    try:
        yield r
    finally:
        await r.registry.models.stop()
        await r.registry.vmodels.stop()
        await r.store.inner.close()


INFO = ModelInfo("demo", "/new")


# ---- the pure transition rule ------------------------------------------------------------
@pytest.mark.parametrize(
    ("active", "target", "target_copies", "active_copies", "force", "switches"),
    [
        ("a", "a", 5, 5, True, False),  # not in transition
        ("a", "b", 0, 2, False, False),
        ("a", "b", 1, 2, False, False),  # upstream would switch at 1 copy; meshd waits for 2
        ("a", "b", 2, 2, False, True),
        ("a", "b", 3, 2, False, True),
        ("a", "b", 0, 0, False, True),  # the active has no copies
        ("a", "b", 1, 0, False, True),
        ("a", "b", 0, 3, True, True),  # force
        ("", "b", 0, 0, False, True),  # no active model recorded
    ],
)
def test_transition_rule(
    active: str, target: str, target_copies: int, active_copies: int, force: bool, switches: bool
) -> None:
    vm = VModelRecord(owner="o", active_model=active, target_model=target, failed=True, extra={"x": 1})
    out = transition(vm, target_copies, active_copies, force)
    if not switches:
        assert out is None
    else:
        assert out == VModelRecord(owner="o", active_model=target, target_model=target, failed=False, extra={"x": 1})
        assert vm.active_model == active  # input untouched


# ---- create ------------------------------------------------------------------------------
async def test_create_makes_target_active_and_counts_a_reference(rig: Rig) -> None:
    await rig.register("a")
    st = await rig.set("v", "a")
    assert st == VModelStatusView(VModelStatus.DEFINED, "a", "a", "")
    assert rig.refs("a") == 1
    assert rig.registry.vmodels.get("v") == VModelRecord(owner="", active_model="a", target_model="a")
    assert rig.loads == []  # no loadNow: nothing loaded
    # Idempotent: the same request again changes nothing.
    rev = rig.store.inner.revision
    assert await rig.set("v", "a") == st
    assert rig.store.inner.revision == rev and rig.refs("a") == 1


async def test_default_owner_applies_to_new_vmodels() -> None:
    r = await make_rig(default_owner="team")
    try:
        await r.register("a")
        assert (await r.set("v", "a")).owner == "team"
        assert (await r.set("w", "a", owner="me")).owner == "me"
    finally:
        await r.registry.models.stop()
        await r.registry.vmodels.stop()


async def test_ids_and_info_are_validated(rig: Rig) -> None:
    with pytest.raises(InvalidArgument, match="vmodel id"):
        await rig.set("", "a")
    with pytest.raises(InvalidArgument, match="target model id"):
        await rig.set("v", "")
    with pytest.raises(InvalidArgument, match="control"):
        await rig.set("v\n", "a")
    with pytest.raises(InvalidArgument, match="type"):
        await rig.set("v", "a", model_info=ModelInfo(""))
    with pytest.raises(InvalidArgument):
        rig.vm.status("")
    with pytest.raises(InvalidArgument):
        await rig.vm.delete_vmodel("")


async def test_load_now_triggers_loading_of_the_target(rig: Rig) -> None:
    await rig.register("a")
    await rig.set("v", "a", load_now=True)
    assert rig.loads == ["a"]


async def test_missing_target_without_info_is_not_found(rig: Rig) -> None:
    with pytest.raises(NotFound, match="target model 'a' not found") as e:
        await rig.set("v", "a")
    assert e.value.code is grpc.StatusCode.NOT_FOUND
    assert rig.registry.vmodels.get("v") is None


async def test_info_registers_the_target_in_the_same_transaction(rig: Rig) -> None:
    rev = rig.store.inner.revision
    st = await rig.set("v", "m", model_info=INFO, auto_delete_target=True)
    assert st.status is VModelStatus.DEFINED
    m = rig.model("m")
    assert m is not None and (m.type, m.path, m.refs, m.auto_delete) == ("demo", "/new", 1, True)
    assert m.last_used == NOW - REGISTER_AGE_NO_LOAD_MS
    assert rig.store.inner.revision == rev + 1  # vmodel and model: one revision
    await rig.set("w", "n", model_info=INFO, load_now=True)
    n = rig.model("n")
    assert n is not None and not n.auto_delete and n.last_used == NOW - REGISTER_AGE_LOAD_NOW_MS
    # Identical info for a registered model is fine (and its autoDel is left as it was).
    await rig.set("x", "m", model_info=INFO, auto_delete_target=False)
    assert rig.refs("m") == 2 and rig.model("m").auto_delete  # type: ignore[union-attr]


async def test_info_differing_from_the_registered_model_is_already_exists(rig: Rig) -> None:
    await rig.register("a")
    with pytest.raises(AlreadyExists, match="different model info"):
        await rig.set("v", "a", model_info=ModelInfo("demo", "/elsewhere"))
    assert rig.registry.vmodels.get("v") is None and rig.refs("a") == 0


# ---- owner, updateOnly, compare-and-set ------------------------------------------------
async def test_owner(rig: Rig) -> None:
    await rig.register("a")
    await rig.register("b")
    await rig.set("v", "a", owner="alice")
    with pytest.raises(AlreadyExists, match="different owner 'alice'"):
        await rig.set("v", "b", owner="bob")
    assert rig.vm.status("v", "bob") == VMODEL_NOT_FOUND  # someone else's vmodel is not visible
    assert rig.vm.status("v", "alice").status is VModelStatus.DEFINED
    assert rig.vm.status("v").owner == "alice"  # no owner given: no check (upstream)
    assert (await rig.set("v", "b")).target_model_id == "b"  # likewise for setVModel
    await rig.vm.delete_vmodel("v", "bob")  # not bob's: a no-op, as upstream
    assert rig.registry.vmodels.get("v") is not None
    await rig.vm.delete_vmodel("v", "alice")
    assert rig.registry.vmodels.get("v") is None


async def test_update_only(rig: Rig) -> None:
    await rig.register("a")
    await rig.register("b")
    with pytest.raises(NotFound, match="vmodel 'v' not found"):
        await rig.set("v", "a", update_only=True)
    assert rig.registry.vmodels.get("v") is None and rig.refs("a") == 0
    await rig.set("v", "a")
    assert (await rig.set("v", "b", update_only=True)).target_model_id == "b"


async def test_expected_target_is_a_compare_and_set(rig: Rig) -> None:
    for m in "abc":
        await rig.register(m)
    # Absent vmodel: only expected == target may create it.
    with pytest.raises(FailedPrecondition, match="not found") as e:
        await rig.set("v", "a", expected_target_model_id="x")
    assert e.value.code is grpc.StatusCode.FAILED_PRECONDITION
    await rig.set("v", "a", expected_target_model_id="a")
    # Existing vmodel: the current target must be the expected one.
    with pytest.raises(FailedPrecondition, match="targets model 'a', not the expected 'x'"):
        await rig.set("v", "b", expected_target_model_id="x")
    assert rig.vm.status("v").target_model_id == "a"
    await rig.set("v", "b", expected_target_model_id="a")
    assert rig.vm.status("v").target_model_id == "b"
    # Repeating a request that already took effect is fine (upstream).
    await rig.set("v", "b", expected_target_model_id="a")
    with pytest.raises(FailedPrecondition):
        await rig.set("v", "c", expected_target_model_id="a")


# ---- references and auto-deletion ------------------------------------------------------
async def test_refs_count_vmodels_sharing_a_model(rig: Rig) -> None:
    await rig.register("a")
    await rig.register("b")
    await rig.set("v1", "a")
    await rig.set("v2", "a")
    assert rig.refs("a") == 2
    await rig.set("v1", "b")  # a has no copies: switches at once
    assert rig.vm.status("v1").status is VModelStatus.DEFINED
    assert (rig.refs("a"), rig.refs("b")) == (1, 1)
    await rig.vm.delete_vmodel("v2")
    assert rig.refs("a") == 0 and rig.model("a") is not None  # not autoDel: stays registered
    await rig.registry.unregister("a")
    assert rig.model("a") is None


async def test_concurrent_vmodels_on_one_model_count_every_reference(rig: Rig) -> None:
    await rig.register("a")
    await asyncio.gather(*(rig.set(f"v{i}", "a") for i in range(8)))
    assert rig.refs("a") == 8
    await asyncio.gather(*(rig.vm.delete_vmodel(f"v{i}") for i in range(8)))
    assert rig.refs("a") == 0 and len(rig.registry.vmodels) == 0


async def test_unregistering_a_referenced_model_fails(rig: Rig) -> None:
    await rig.set("v", "m", model_info=INFO)
    with pytest.raises(FailedPrecondition, match="referenced by 1 vmodel"):
        await rig.registry.unregister("m")
    assert rig.model("m") is not None
    await rig.vm.delete_vmodel("v")
    await rig.registry.unregister("m")
    assert rig.model("m") is None


async def test_autodelete_on_delete(rig: Rig) -> None:
    await rig.set("v", "m", model_info=INFO, auto_delete_target=True)
    await rig.set("w", "m")
    await rig.vm.delete_vmodel("v")
    assert rig.refs("m") == 1  # still referenced by w
    rev = rig.store.inner.revision
    await rig.vm.delete_vmodel("w")
    assert rig.model("m") is None and rig.registry.vmodels.get("w") is None
    assert rig.store.inner.revision == rev + 1  # one transaction
    await rig.vm.delete_vmodel("w")  # absent: no-op
    assert rig.store.inner.revision == rev + 1


async def test_delete_in_transition_releases_active_and_target(rig: Rig) -> None:
    await rig.set("v", "a", model_info=ModelInfo("demo", "/a"), auto_delete_target=True)
    rig.copies["a"] = 1
    await rig.set("v", "b", model_info=ModelInfo("demo", "/b"), auto_delete_target=True)
    assert rig.vm.status("v").status is VModelStatus.TRANSITIONING
    assert (rig.refs("a"), rig.refs("b")) == (1, 1)
    await rig.vm.delete_vmodel("v")
    assert rig.model("a") is None and rig.model("b") is None


# ---- transitions -------------------------------------------------------------------------
async def test_retarget_waits_for_the_actives_copy_count(rig: Rig) -> None:
    await rig.set("v", "a", model_info=ModelInfo("demo", "/a"), auto_delete_target=True)
    await rig.register("b", last_used=NOW - 10_000_000)
    await rig.registry.touch("a", NOW - 5)
    rig.copies["a"] = 2
    st = await rig.set("v", "b")
    assert st == VModelStatusView(VModelStatus.TRANSITIONING, "a", "b", "")
    assert rig.vm.resolve("v") == "a"  # traffic stays on the active
    assert (rig.refs("a"), rig.refs("b")) == (1, 1)
    assert rig.loads == ["b"]  # loading of the target starts
    assert rig.model("b").last_used == NOW - 5  # type: ignore[union-attr]  # inherits the active's recency
    assert rig.vm.transition_targets() == {"b": 2}

    rig.copies["b"] = 1
    assert await rig.vm.complete_transitions() == []  # upstream would switch here
    assert rig.vm.status("v").status is VModelStatus.TRANSITIONING
    rig.copies["b"] = 2
    assert await rig.vm.complete_transitions() == ["v"]
    assert rig.vm.status("v") == VModelStatusView(VModelStatus.DEFINED, "b", "b", "")
    assert rig.vm.resolve("v") == "b"
    assert rig.model("a") is None  # autoDel and no longer referenced: deleted with the switch
    assert rig.refs("b") == 1
    assert await rig.vm.complete_transitions() == []  # idempotent
    assert rig.vm.transition_targets() == {}


async def test_transition_keeps_a_model_other_vmodels_reference(rig: Rig) -> None:
    await rig.set("v", "a", model_info=ModelInfo("demo", "/a"), auto_delete_target=True)
    await rig.set("w", "a")
    await rig.register("b")
    rig.copies.update(a=1, b=0)
    await rig.set("v", "b")
    rig.copies["b"] = 1
    assert await rig.vm.complete_transitions() == ["v"]
    assert rig.refs("a") == 1 and rig.vm.resolve("w") == "a"


async def test_active_without_copies_switches_at_once(rig: Rig) -> None:
    await rig.set("v", "a", model_info=ModelInfo("demo", "/a"), auto_delete_target=True)
    await rig.register("b")
    st = await rig.set("v", "b")
    assert st == VModelStatusView(VModelStatus.DEFINED, "b", "b", "")
    assert rig.model("a") is None and rig.refs("b") == 1
    assert rig.loads == []


async def test_target_already_loaded_enough_switches_at_once(rig: Rig) -> None:
    await rig.register("a")
    await rig.register("b")
    await rig.set("v", "a")
    rig.copies.update(a=2, b=2)
    assert (await rig.set("v", "b")).status is VModelStatus.DEFINED
    assert rig.refs("a") == 0


async def test_force(rig: Rig) -> None:
    for m in "abc":
        await rig.register(m)
    await rig.set("v", "a")
    rig.copies["a"] = 3
    assert (await rig.set("v", "b", force=True)).status is VModelStatus.DEFINED
    assert (rig.refs("a"), rig.refs("b")) == (0, 1)
    # Force on the current target of a vmodel in transition completes it.
    rig.copies["b"] = 3
    assert (await rig.set("v", "c")).status is VModelStatus.TRANSITIONING
    assert (await rig.set("v", "c")).status is VModelStatus.TRANSITIONING  # no force: no change
    assert (await rig.set("v", "c", force=True)) == VModelStatusView(VModelStatus.DEFINED, "c", "c", "")
    assert (rig.refs("b"), rig.refs("c")) == (0, 1)


async def test_retarget_during_a_transition(rig: Rig) -> None:
    await rig.register("a")
    await rig.set("v", "b", model_info=ModelInfo("demo", "/b"), auto_delete_target=True)
    await rig.set("v", "a", force=True)  # v: a, b auto-deleted
    assert rig.model("b") is None
    await rig.set("v", "b", model_info=ModelInfo("demo", "/b"), auto_delete_target=True)
    rig.copies["b"] = 1
    await rig.register("c")
    assert (await rig.set("v", "c")).status is VModelStatus.TRANSITIONING
    assert (await rig.set("v", "a")).status is VModelStatus.TRANSITIONING  # b -> c -> a: a still loading
    assert (rig.refs("b"), rig.refs("c"), rig.refs("a")) == (1, 0, 1)
    # Back to the active model: the transition is over, no double count.
    assert (await rig.set("v", "b")) == VModelStatusView(VModelStatus.DEFINED, "b", "b", "")
    assert (rig.refs("b"), rig.refs("a")) == (1, 0)


async def test_failed_target_marks_the_transition_failed(rig: Rig) -> None:
    await rig.register("a")
    await rig.register("b")
    await rig.set("v", "a")
    rig.copies["a"] = 1
    await rig.set("v", "b")
    assert await rig.vm.complete_transitions() == []
    assert rig.vm.status("v").status is VModelStatus.TRANSITIONING  # no failure yet
    await rig.registry.record_failure("b", "i1", "boom", NOW)
    await rig.vm.complete_transitions()
    assert rig.vm.status("v") == VModelStatusView(VModelStatus.TRANSITION_FAILED, "a", "b", "")
    assert rig.vm.resolve("v") == "a"
    assert rig.vm.transition_targets() == {}
    # A copy loading somewhere: not failed (any more).
    await rig.registry.add_copy("b", "i2", NOW)
    await rig.vm.complete_transitions()
    assert rig.vm.status("v").status is VModelStatus.TRANSITIONING
    await rig.registry.remove_copy("b", "i2")
    await rig.vm.complete_transitions()
    assert rig.vm.status("v").status is VModelStatus.TRANSITION_FAILED
    # The failure expires: retried.
    rig.now[0] = NOW + 900_000
    await rig.vm.complete_transitions()
    assert rig.vm.status("v").status is VModelStatus.TRANSITIONING
    # A new target clears the mark too.
    rig.now[0] = NOW
    await rig.vm.complete_transitions()
    assert rig.vm.status("v").status is VModelStatus.TRANSITION_FAILED
    await rig.register("c")
    assert (await rig.set("v", "c")).status is VModelStatus.TRANSITIONING


async def test_wait_transition(rig: Rig) -> None:
    await rig.register("a")
    await rig.register("b")
    await rig.set("v", "a")
    rig.copies["a"] = 1
    await rig.set("v", "b")
    st = await rig.vm.wait_transition("v", "b", timeout_s=0.05)
    assert st.status is VModelStatus.TRANSITIONING
    waiter = asyncio.create_task(rig.vm.wait_transition("v", "b", timeout_s=5))
    await asyncio.sleep(0)
    rig.copies["b"] = 1
    await rig.vm.complete_transitions()
    assert (await waiter) == VModelStatusView(VModelStatus.DEFINED, "b", "b", "")
    assert rig.registry.vmodels.listeners == []


# ---- reads -------------------------------------------------------------------------------
async def test_status_and_resolve(rig: Rig) -> None:
    assert rig.vm.status("nope") == VMODEL_NOT_FOUND
    assert VMODEL_NOT_FOUND.status == 0
    with pytest.raises(NotFound, match="vmodel 'nope' not found"):
        rig.vm.resolve("nope")
    await rig.register("a")
    await rig.set("v", "a")
    assert rig.vm.resolve("v") == "a"


async def test_resolve_strong_reads_the_store_when_the_mirror_lags(rig: Rig) -> None:
    await rig.register("a")
    # A second instance whose mirrors have not seen anything yet.
    models = Table(rig.store, "/t/registry/", ModelRecord.decode, ModelRecord.encode)
    vmodels = Table(rig.store, "/t/vmodels/", VModelRecord.decode, VModelRecord.encode)
    other = VModels(Registry(models, vmodels), "", lambda m: 0)
    await rig.set("v", "a")
    with pytest.raises(NotFound):
        other.resolve("v")
    assert await other.resolve_strong("v") == "a"
    with pytest.raises(NotFound):
        await other.resolve_strong("w")


# ---- stale reads, corrupt records, store outages -------------------------------------------
async def test_stale_view_of_the_vmodel_is_replanned(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    await rig.register("a")
    await rig.set("v", "a")

    async def stale(vmodel_id: str) -> VModelRecord | None:
        return None  # as if the vmodel did not exist yet

    monkeypatch.setattr(rig.vm, "_peek", stale)
    await rig.vm.delete_vmodel("v")
    assert rig.registry.vmodels.get("v") is None and rig.refs("a") == 0


async def test_corrupt_records_are_data_loss_and_left_untouched(rig: Rig) -> None:
    rev = await rig.store.inner.put("/t/vmodels/v", b"garbage")
    await rig.registry.vmodels.wait_for(rev)
    await rig.register("a")
    with pytest.raises(DataLoss, match="corrupt"):
        rig.vm.status("v")
    with pytest.raises(DataLoss):
        rig.vm.resolve("v")
    with pytest.raises(DataLoss):
        await rig.set("v", "a")
    with pytest.raises(DataLoss):
        await rig.vm.delete_vmodel("v")
    kv = await rig.store.inner.get("/t/vmodels/v")
    assert kv is not None and kv.value == b"garbage" and rig.refs("a") == 0
    # A corrupt model record referenced by a vmodel: the vmodel change is refused whole.
    await rig.set("w", "a")
    rev = await rig.store.inner.put("/t/registry/a", b"[]")
    await rig.registry.models.wait_for(rev)
    with pytest.raises(DataLoss):
        await rig.vm.delete_vmodel("w")
    assert rig.registry.vmodels.get("w") is not None
    await rig.vm.complete_transitions()  # skips what it cannot read, never raises


async def test_store_outage_is_unavailable(rig: Rig) -> None:
    await rig.register("a")
    rig.store.down = True
    with pytest.raises(Unavailable):
        await rig.set("v", "a")
    assert rig.registry.vmodels.get("v") is None
    rig.store.down = False
    await rig.set("v", "a")
