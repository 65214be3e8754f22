"""Virtual models (SPEC §2 setVModel / deleteVModel / getVModelStatus): a stable id that
routes to an active concrete model and moves to a new target once the target is ready.

Bookkeeping follows upstream's records (SPEC §5): a vmodel record holds owner, active and
target model ids and a `failed` flag; a model record's `refs` counts the vmodels that
reference it (as active, target or both: one reference per vmodel). Every change to a
vmodel and to the reference counts it implies is one etcd transaction (`update_many`),
and a model whose count drops to 0 while it is marked `autoDel` is deleted in that same
transaction. Unregistering a model a vmodel references is refused by `Registry.unregister`.

A transition (active != target) completes when the target has at least as many loaded
copies as the active (at least one), when the active has none, or on `force`. Upstream
waits for a single target copy, which users reported as a bug; meshd waits for the
active's count. `complete_transitions` applies that rule to every vmodel in transition;
it is idempotent and safe to run on every instance (each switch is a CAS).

Reads (`status`, `resolve`) are local to the watch-fed mirror, like getModelStatus.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from meshd.core.clock import Clock, wall_ms
from meshd.core.errors import AlreadyExists, DataLoss, FailedPrecondition, NotFound, Unavailable
from meshd.core.records import REGISTERED_LU, ModelRecord, RecordError, VModelRecord
from meshd.decisions.ids import ModelInfo, check_id
from meshd.decisions.status import recent_failures
from meshd.kv.health import for_client
from meshd.kv.store import StoreError
from meshd.kv.table import KEEP, MAX_CAS_ATTEMPTS, Keep, Table
from meshd.kv.txn import update_many
from meshd.registry.models import Registry, default_last_used

log = logging.getLogger(__name__)

# Upstream MM_LOAD_FAILURE_EXPIRY_TIME_MS default (SPEC §6).
DEFAULT_FAILURE_EXPIRY_MS = 900_000


class VModelStatus(enum.IntEnum):
    """Values of mmesh VModelStatusInfo.VModelStatus (SPEC §2)."""

    NOT_FOUND = 0
    DEFINED = 1
    TRANSITIONING = 2
    TRANSITION_FAILED = 3
    UNKNOWN = 5


@dataclass(frozen=True, slots=True)
class VModelStatusView:
    """What getVModelStatus / setVModel report; the transport adds the models' statuses."""

    status: VModelStatus
    active_model_id: str = ""
    target_model_id: str = ""
    owner: str = ""


VMODEL_NOT_FOUND = VModelStatusView(VModelStatus.NOT_FOUND)


@dataclass(frozen=True, slots=True)
class SetVModel:
    """SetVModelRequest (SPEC §2). `model_info` is None when the request carries none
    (upstream treats an all-default ModelInfo as absent). `sync` is the caller's business:
    `VModels.set_vmodel` never waits; see `VModels.wait_transition`."""

    vmodel_id: str
    target_model_id: str
    update_only: bool = False
    model_info: ModelInfo | None = None
    auto_delete_target: bool = False
    load_now: bool = False
    force: bool = False
    sync: bool = False
    expected_target_model_id: str = ""
    owner: str = ""


def view_of(rec: VModelRecord | None) -> VModelStatusView:
    if rec is None:
        return VMODEL_NOT_FOUND
    if rec.active_model == rec.target_model:
        status = VModelStatus.DEFINED
    elif rec.failed:
        status = VModelStatus.TRANSITION_FAILED
    else:
        status = VModelStatus.TRANSITIONING
    return VModelStatusView(status, rec.active_model, rec.target_model, rec.owner)


def transition(
    vmodel: VModelRecord, target_loaded_copies: int, active_loaded_copies: int, force: bool
) -> VModelRecord | None:
    """The vmodel with its active model switched to the target, or None (no change).

    Switches when the target has at least as many loaded copies as the active (and at
    least one), when the active has no loaded copies (or no active is set), or on force.
    The returned record is a new object with `failed` cleared.
    """
    if vmodel.active_model == vmodel.target_model:
        return None
    ready = target_loaded_copies >= max(1, active_loaded_copies)
    if not (force or ready or active_loaded_copies <= 0 or not vmodel.active_model):
        return None
    switched = VModelRecord.decode(vmodel.encode())
    switched.active_model = vmodel.target_model
    switched.failed = False
    return switched


def referenced(rec: VModelRecord | None) -> list[str]:
    """The model ids a vmodel record references (each once; it counts once in `refs`)."""
    if rec is None:
        return []
    return list(dict.fromkeys(m for m in (rec.active_model, rec.target_model) if m))


# decide(current vmodel or None, {model id: fresh model record or None}) -> new vmodel,
# None to delete it, KEEP for no change. It may create or edit entries of the dict (they
# are fresh copies); reference counts are adjusted afterwards from the vmodel change.
Decide = Callable[[VModelRecord | None, dict[str, ModelRecord | None]], VModelRecord | Keep | None]


class _Replan(Exception):
    """The vmodel now references models the transaction did not read: read them too."""

    def __init__(self, vmodel: VModelRecord | None) -> None:
        super().__init__("vmodel changed")
        self.vmodel = vmodel


@dataclass(frozen=True, slots=True)
class _Outcome:
    vmodel: VModelRecord | None
    auto_deleted: tuple[str, ...]


class VModels:
    def __init__(
        self,
        registry: Registry,
        default_owner: str,
        loaded_copies: Callable[[str], int],
        ensure_loading: Callable[[str], Awaitable[None]] | None = None,
        *,
        clock: Clock = wall_ms,
        failure_expiry_ms: int = DEFAULT_FAILURE_EXPIRY_MS,
    ) -> None:
        """`default_owner`: MM_DEFAULT_VMODEL_OWNER ("" when unset), given to vmodels
        created without an owner. `loaded_copies(model_id)`: live loaded copies across the
        mesh. `ensure_loading(model_id)`: start loading a model somewhere (idempotent)."""
        self.registry = registry
        self.default_owner = default_owner
        self.loaded_copies = loaded_copies
        self.ensure_loading = ensure_loading
        self.clock = clock
        self.failure_expiry_ms = failure_expiry_ms

    @property
    def _vmodels(self) -> Table[VModelRecord]:
        return self.registry.vmodels

    @property
    def _models(self) -> Table[ModelRecord]:
        return self.registry.models

    # ---- reads ---------------------------------------------------------------------------
    def _mirror(self, vmodel_id: str) -> VModelRecord | None:
        rec = self._vmodels.get(vmodel_id)
        if rec is None:
            corrupt = self._vmodels.corrupt.get(vmodel_id)
            if corrupt is not None:
                raise DataLoss(f"stored record for vmodel {vmodel_id!r} is corrupt and was left untouched: {corrupt}")
        return rec

    def status(self, vmodel_id: str, owner: str = "") -> VModelStatusView:
        """NOT_FOUND (a status, not an error) when absent or owned by someone else."""
        check_id(vmodel_id, "vmodel id")
        rec = self._mirror(vmodel_id)
        if rec is None or (owner and rec.owner != owner):
            return VMODEL_NOT_FOUND
        return view_of(rec)

    def resolve(self, vmodel_id: str) -> str:
        """The active model id, for routing (local mirror). NOT_FOUND when absent."""
        rec = self._mirror(vmodel_id)
        if rec is None or not rec.active_model:
            raise NotFound(f"vmodel {vmodel_id!r} not found")
        return rec.active_model

    async def resolve_strong(self, vmodel_id: str) -> str:
        """Like `resolve`, but asks the store when the mirror does not have the vmodel yet
        (created through another instance a moment ago), as upstream does."""
        try:
            return self.resolve(vmodel_id)
        except NotFound:
            pass
        rec = await self._peek(vmodel_id)
        if rec is None or not rec.active_model:
            raise NotFound(f"vmodel {vmodel_id!r} not found")
        return rec.active_model

    def transition_targets(self) -> dict[str, int]:
        """Copies each pending transition target needs ({model id: count}), for placement:
        the active's loaded copies, at least one. Failed transitions are left out."""
        wanted: dict[str, int] = {}
        for _, rec in self._vmodels.items():
            if rec.active_model != rec.target_model and not rec.failed and rec.target_model:
                need = max(1, self.loaded_copies(rec.active_model) if rec.active_model else 1)
                wanted[rec.target_model] = max(wanted.get(rec.target_model, 0), need)
        return wanted

    async def wait_transition(self, vmodel_id: str, target_model_id: str, timeout_s: float) -> VModelStatusView:
        """Wait (at most `timeout_s`) until the vmodel no longer transitions to
        `target_model_id`: switched, failed, retargeted or deleted. Returns its status."""

        def settled() -> bool:
            rec = self._vmodels.get(vmodel_id)
            return (
                rec is None or rec.failed or rec.target_model != target_model_id or rec.active_model == rec.target_model
            )

        if not settled():
            done = asyncio.Event()

            def listener(item_id: str, old: VModelRecord | None, new: VModelRecord | None) -> None:
                if item_id == vmodel_id and settled():
                    done.set()

            self._vmodels.listeners.append(listener)
            try:
                async with asyncio.timeout(timeout_s):
                    await done.wait()
            except TimeoutError:
                pass
            finally:
                self._vmodels.listeners.remove(listener)
        return view_of(self._vmodels.get(vmodel_id))

    # ---- writes --------------------------------------------------------------------------
    async def set_vmodel(self, req: SetVModel) -> VModelStatusView:
        """Create a vmodel or set its target (SPEC §2)."""
        vid = check_id(req.vmodel_id, "vmodel id")
        tid = check_id(req.target_model_id, "target model id")
        expected = req.expected_target_model_id
        if expected:
            check_id(expected, "expected target model id")
        info = req.model_info.check() if req.model_info is not None else None
        now = self.clock()

        def decide(vm: VModelRecord | None, models: dict[str, ModelRecord | None]) -> VModelRecord | Keep:
            if vm is not None:
                if req.owner and vm.owner != req.owner:
                    raise AlreadyExists(f"vmodel {vid!r} already exists with a different owner {vm.owner!r}")
                if expected and expected != vm.target_model and tid != vm.target_model:
                    raise FailedPrecondition(
                        f"vmodel {vid!r} targets model {vm.target_model!r}, not the expected {expected!r}"
                    )
            else:
                if expected and expected != tid:
                    raise FailedPrecondition(f"vmodel {vid!r} not found (expected target model {expected!r})")
                if req.update_only:
                    raise NotFound(f"vmodel {vid!r} not found")
            target = models[tid]
            if info is None:
                if target is None:
                    raise NotFound(f"target model {tid!r} not found")
            elif target is not None and not target.same_info(info.type, info.path, info.key):
                raise AlreadyExists(f"target model {tid!r} already exists with different model info")

            if vm is not None and vm.target_model == tid and (vm.active_model == tid or not req.force):
                return KEEP  # already targeting it (a transition in progress continues)

            prev_active = models.get(vm.active_model) if vm is not None and vm.active_model else None
            inherited = prev_active.last_used if prev_active is not None else 0
            if target is None:
                assert info is not None
                target = ModelRecord(
                    type=info.type,
                    path=info.path,
                    key=info.key,
                    auto_delete=req.auto_delete_target,
                    last_used=inherited or default_last_used(now, req.load_now),
                )
                if not inherited:
                    target.extra[REGISTERED_LU] = target.last_used
                models[tid] = target
            elif inherited > target.last_used:
                # The target takes over the active's traffic: do not let it be evicted first.
                target.last_used = inherited
            if vm is None:
                # Upstream makes the first target active at once.
                return VModelRecord(owner=req.owner or self.default_owner, active_model=tid, target_model=tid)
            vm.target_model = tid
            vm.failed = False
            active_copies = self.loaded_copies(vm.active_model) if vm.active_model else 0
            switched = transition(vm, self.loaded_copies(tid), active_copies, req.force)
            return switched if switched is not None else vm

        outcome = await self._change(vid, decide, extra=(tid,))
        if outcome.auto_deleted:
            log.info("vmodel %s: models auto-deleted: %s", vid, list(outcome.auto_deleted))
        view = view_of(outcome.vmodel)
        if self.ensure_loading is not None and (req.load_now or view.status is not VModelStatus.DEFINED):
            # A transition completes only once the target is loaded: start it now.
            await self.ensure_loading(tid)
        return view

    async def delete_vmodel(self, vmodel_id: str, owner: str = "") -> None:
        """Delete the vmodel and release its models' references (auto-deleting `autoDel`
        models left unreferenced). Absent, or owned by someone else: a no-op, as upstream."""
        check_id(vmodel_id, "vmodel id")

        def decide(vm: VModelRecord | None, models: dict[str, ModelRecord | None]) -> VModelRecord | Keep | None:
            if vm is None or (owner and vm.owner != owner):
                return KEEP
            return None

        outcome = await self._change(vmodel_id, decide)
        if outcome.auto_deleted:
            log.info("vmodel %s deleted; models auto-deleted: %s", vmodel_id, list(outcome.auto_deleted))

    async def complete_transitions(self) -> list[str]:
        """Switch every vmodel whose target is ready (see `transition`); mark a transition
        `failed` while its target has unexpired load failures and no copy loaded or loading
        anywhere, and clear the mark once that no longer holds. Returns the switched ids."""
        switched: list[str] = []
        for vid, rec in self._vmodels.items():
            if rec.active_model == rec.target_model:
                continue
            try:
                outcome = await self._change(vid, self._progress)
            except DataLoss as e:
                log.error("vmodel transition skipped: %s", e.message)
                continue
            new = outcome.vmodel
            if new is not None and new.active_model == new.target_model == rec.target_model:
                switched.append(vid)
                log.info("vmodel %s completed its transition from %s to %s", vid, rec.active_model, rec.target_model)
            if outcome.auto_deleted:
                log.info("models auto-deleted by the transition of vmodel %s: %s", vid, list(outcome.auto_deleted))
        return switched

    def _progress(self, vm: VModelRecord | None, models: dict[str, ModelRecord | None]) -> VModelRecord | Keep:
        if vm is None or vm.active_model == vm.target_model:
            return KEEP
        active_copies = self.loaded_copies(vm.active_model) if vm.active_model else 0
        switched = transition(vm, self.loaded_copies(vm.target_model), active_copies, False)
        if switched is not None:
            return switched
        failed = self._target_failed(vm.target_model, models.get(vm.target_model))
        if failed == vm.failed:
            return KEEP
        vm.failed = failed
        return vm

    def _target_failed(self, model_id: str, rec: ModelRecord | None) -> bool:
        if rec is None:
            return True  # the target is gone: this transition cannot complete
        if rec.instance_ids or self.loaded_copies(model_id) > 0:
            return False  # loaded or loading somewhere
        now = self.clock()
        return bool(recent_failures(rec.failed_in, now, self.failure_expiry_ms))

    # ---- the transaction -----------------------------------------------------------------
    async def _peek(self, vmodel_id: str) -> VModelRecord | None:
        """The vmodel from the mirror, or from the store when the mirror lacks it."""
        rec = self._mirror(vmodel_id)
        if rec is not None:
            return rec
        try:
            kv = await for_client(self._vmodels.store, self._vmodels.store.get(self._vmodels.key(vmodel_id)))
            return VModelRecord.decode(kv.value) if kv is not None else None
        except RecordError as e:
            raise DataLoss(f"stored record for vmodel {vmodel_id!r} is corrupt and was left untouched: {e}") from None
        except StoreError as e:
            raise Unavailable(f"vmodel registry unavailable: {e}") from None

    async def _change(self, vmodel_id: str, decide: Decide, extra: Sequence[str] = ()) -> _Outcome:
        """Apply `decide` to the vmodel and the models it references (plus `extra`), adjust
        reference counts, auto-delete, and write it all in one transaction."""
        known = await self._peek(vmodel_id)
        for _ in range(MAX_CAS_ATTEMPTS):
            ids = list(dict.fromkeys([*referenced(known), *extra]))
            auto_deleted: list[str] = []

            def fn(values: list[Any | None], ids: list[str] = ids, auto_deleted: list[str] = auto_deleted) -> list[Any]:
                auto_deleted.clear()
                vm: VModelRecord | None = values[0]
                if not set(referenced(vm)) <= set(ids):
                    raise _Replan(vm)
                models: dict[str, ModelRecord | None] = dict(zip(ids, values[1:], strict=True))
                before = {m: (r.encode() if r is not None else None) for m, r in models.items()}
                old_refs = set(referenced(vm))  # before decide, which may edit vm in place
                new_vm = decide(vm, models)
                if isinstance(new_vm, Keep):
                    if vm is not None and set(referenced(vm)) != old_refs:
                        raise RuntimeError(f"vmodel {vmodel_id!r}: KEEP after changing its references")
                    new_refs = old_refs
                else:
                    new_refs = set(referenced(new_vm))
                for m in new_refs - old_refs:
                    if m not in models:
                        raise RuntimeError(f"vmodel {vmodel_id!r}: model {m!r} was not read in the transaction")
                    rec = models[m]
                    if rec is None:
                        raise NotFound(f"model {m!r} not found")
                    rec.refs += 1
                for m in old_refs - new_refs:
                    rec = models[m]
                    if rec is None:
                        continue  # already gone (the transaction still checks it stays absent)
                    rec.refs = max(0, rec.refs - 1)
                    if rec.refs == 0 and rec.auto_delete:
                        models[m] = None
                        auto_deleted.append(m)
                out: list[Any] = [new_vm]
                for m in ids:
                    rec = models[m]
                    if rec is None:
                        out.append(None if before[m] is not None else KEEP)
                    elif before[m] is not None and rec.encode() == before[m]:
                        out.append(KEEP)
                    else:
                        out.append(rec)
                return out

            pairs: list[tuple[Table[Any], str]] = [(self._vmodels, vmodel_id)]
            pairs += [(self._models, m) for m in ids]
            try:
                results = await for_client(self._vmodels.store, update_many(pairs, fn))
            except _Replan as replan:
                known = replan.vmodel
                continue
            except RecordError as e:
                raise DataLoss(
                    f"a stored record for vmodel {vmodel_id!r} or its models is corrupt and was left untouched: {e}"
                ) from None
            except StoreError as e:
                raise Unavailable(f"vmodel registry unavailable: {e}") from None
            return _Outcome(results[0], tuple(auto_deleted))
        raise Unavailable(f"gave up updating vmodel {vmodel_id!r}: its references kept changing")
