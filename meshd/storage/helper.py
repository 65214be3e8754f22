"""The storage helper: pulls a model's files onto local disk before the runtime loads it, and
keeps them there afterwards as a cache tier.

On disk (`ROOT_MODEL_DIR`, upstream's layout): `<root>/<modelId>/<name>` is the model (a file
or a directory), `<root>/<modelId>/.meshd-done` the done marker (JSON: size, pull time, last
use, the source it came from). A pull writes into `<root>/.<modelId>.partial/`, checks each
file's size (and MD5 where the store lists one), writes the marker there, and renames the whole
directory into place: a model directory is complete or absent, and its files need no rename
each (with 1,000 small files the renames' directory lock was ~14 % of a pull's CPU). A copy
pulled from another source stays until its replacement is complete. At
start-up a `.partial` directory, or a model directory without its marker, is a half-written
pull and is removed; entries starting with `_` belong to the runtime adapters and are left
alone.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import random
import shutil
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from meshd.decisions.storage import (
    STAGING_SUFFIX,
    FilePlan,
    ModelPlan,
    Source,
    StorageConfigError,
    check_model_id,
    parse_key,
    plan_files,
    redact,
    resolve,
    rewritten_key,
    safe_relpath,
    schema_name,
    staging_name,
    within,
)
from meshd.decisions.storage_plan import (
    MAX_PARTS_IN_FLIGHT,
    PART_BYTES,
    PART_THRESHOLD,
    RETRIES_PER_PART,
    STALL_TIMEOUT_MS,
    DiskEntry,
    DiskTier,
    Failure,
    ObjectWorkers,
    Part,
    allocate_first,
    backoff_ms,
    default_budget,
    plan_parts,
    retryable,
)
from meshd.storage.errors import ObjectChanged, StorageError, TransferError
from meshd.storage.stores import Store, open_store
from meshd.storage.transport import check_status

log = logging.getLogger(__name__)

DONE_MARKER = ".meshd-done"
PARTIAL_SUFFIX = ".partial"
DEFAULT_ROOT_MODEL_DIR = "/models"  # upstream's ROOT_MODEL_DIR
DEFAULT_STORAGE_CONFIG_DIR = "/storage-config"  # upstream's STORAGE_CONFIG_DIR
DEFAULT_PVC_MOUNTS_DIR = "/pvc_mounts"  # upstream's (hard-coded there; PVC_MOUNTS_DIR here)
CONFIG_KIND = "config"
PROGRESS_LOG_S = 5.0
# One worker's read buffer, and so the size of each write. Not larger: measured on this
# project's VM (Linux 6.18, memory given back to the host when idle), a 1 GiB file written in
# 4 MiB writes took 2.9-3.9 s after the memory had idled and 0.2-0.3 s right after a free;
# in writes of <= 512 KiB, 0.14-0.3 s either way (docs/storage.md).
BUFFER_BYTES = 512 << 10
MD5_LIMIT = 64 << 20  # checked for single-GET objects up to this size (an MD5 costs ~2 ms/MiB of CPU)
# Stores whose listing gives each object's content MD5 by contract (GCS md5Hash, Azure
# Content-MD5). Not S3's or a web server's ETag: SSE-KMS and SSE-C objects, and MinIO's
# encrypted ones, have 32-hex ETags that are not the MD5, and no response header tells them
# apart reliably (AWS now encrypts every object and says so; some S3-compatible stores say
# nothing). Upstream checks no MD5; sizes are checked for every store.
MD5_STORES = ("gcs", "azure")
# How long a listing made by predictModelSize serves the pull that follows it (modelmesh sends
# loadModel right after): one LIST saved per load (a round trip per 1,000 objects), and no
# older listing is trusted, as its objects may have changed or been added to since. A pull
# that finds an object changed under its listing lists again, once.
PLAN_FRESH_S = 10.0


@dataclass(frozen=True)
class StorageSettings:
    root_dir: Path
    config_dir: Path = Path(DEFAULT_STORAGE_CONFIG_DIR)
    pvc_dir: Path = Path(DEFAULT_PVC_MOUNTS_DIR)
    budget_bytes: int | None = None  # None: DISK_BUDGET_SHARE of the volume holding root_dir
    stall_ms: int = STALL_TIMEOUT_MS
    parts_in_flight: int = MAX_PARTS_IN_FLIGHT
    # Workers for a pull whose every file comes in one GET (many small files): 0 adapts them to
    # the store (`ObjectWorkers`); a number fixes them (MESHD_PULL_OBJECTS).
    objects_in_flight: int = 0
    part_bytes: int = PART_BYTES
    part_threshold: int = PART_THRESHOLD
    # fdatasync each file before its rename, so a marker never outlives its bytes after a power
    # loss or kernel crash. Off by default: a process crash (kill -9, OOM) loses nothing from
    # the page cache, and the usual volume (an emptyDir) does not outlive the node anyway.
    # On for a hostPath or PV cache (docs/storage.md).
    fsync: bool = False

    @classmethod
    def from_env(cls, root_dir: str | Path | None = None, env: Mapping[str, str] | None = None) -> StorageSettings:
        """ROOT_MODEL_DIR, STORAGE_CONFIG_DIR, PVC_MOUNTS_DIR (upstream's), MESHD_DISK_CACHE_BYTES,
        MESHD_PULL_STALL_MS, MESHD_PULL_PARALLEL, MESHD_PULL_OBJECTS, MESHD_PULL_FSYNC."""
        e = os.environ if env is None else env
        budget = e.get("MESHD_DISK_CACHE_BYTES", "")
        return cls(
            Path(root_dir or e.get("ROOT_MODEL_DIR", DEFAULT_ROOT_MODEL_DIR)),
            Path(e.get("STORAGE_CONFIG_DIR", DEFAULT_STORAGE_CONFIG_DIR)),
            Path(e.get("PVC_MOUNTS_DIR", DEFAULT_PVC_MOUNTS_DIR)),
            int(budget) if budget else None,
            int(e.get("MESHD_PULL_STALL_MS", STALL_TIMEOUT_MS)),
            int(e.get("MESHD_PULL_PARALLEL", MAX_PARTS_IN_FLIGHT)),
            objects_in_flight=int(e.get("MESHD_PULL_OBJECTS", "0") or 0),
            fsync=e.get("MESHD_PULL_FSYNC", "0") in ("1", "true", "yes", "on"),
        )


@dataclass(frozen=True)
class Pulled:
    """A model ready on local disk: the path and key to hand the runtime."""

    model_id: str
    local_path: str
    key: str  # the rewritten key: storage fields removed, disk_size_bytes measured
    disk_size_bytes: int
    pull_ms: int  # how long its pull took (the first time, when it came from the disk tier)
    from_disk: bool  # found complete on disk: no byte moved


@dataclass(frozen=True)
class DiskModel:
    model_id: str
    size_bytes: int
    pull_ms: int
    last_used_ms: int


@dataclass(frozen=True)
class PullProgress:
    """A pull running now: bytes so far of the listing's total (0 of 0 while listing), how long
    it has run and since its last byte (meshd keeps a load pulling past its timeout)."""

    model_id: str
    bytes_done: int
    bytes_total: int
    elapsed_ms: int
    idle_ms: int


@dataclass(frozen=True)
class Inventory:
    models: tuple[DiskModel, ...]
    budget_bytes: int
    used_bytes: int
    version: int
    pulls: tuple[PullProgress, ...] = ()


@dataclass
class _Progress:
    total: int
    done: int = 0
    arrived: int = 0  # bytes read off the wire, a retried part's again: may pass `total`
    last_ms: float = field(default_factory=lambda: time.monotonic() * 1000)
    lock: threading.Lock = field(default_factory=threading.Lock)
    failed: BaseException | None = None

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            self.last_ms = time.monotonic() * 1000

    def heard(self, n: int) -> None:
        """Bytes arrived (written later, then counted in `done`): what inventory() reports."""
        with self.lock:
            self.arrived += n
            self.last_ms = time.monotonic() * 1000


@dataclass
class _Running:
    """A pull from its start (listing included); its bytes' progress once the download begins."""

    started_ms: float = field(default_factory=lambda: time.monotonic() * 1000)
    progress: _Progress | None = None


def _now_ms() -> int:
    return int(time.time() * 1000)


class StorageHelper:
    """Pulls models (one pull per model at a time, however many ask) and keeps the disk tier."""

    def __init__(self, settings: StorageSettings) -> None:
        self.settings = settings
        self.root = settings.root_dir
        self.root.mkdir(parents=True, exist_ok=True)
        budget = settings.budget_bytes
        if budget is None:
            budget = default_budget(shutil.disk_usage(self.root).total)
        self.tier = DiskTier(budget)
        self._held: set[str] = set()
        self._pulls: dict[str, asyncio.Future[Pulled]] = {}
        self._progress: dict[str, _Running] = {}  # under _lock: the pulls running, for inventory()
        self._plans: dict[str, tuple[str, ModelPlan, float]] = {}  # model: (source, plan, when listed)
        self._lock = threading.Lock()
        self._started = False
        self._closing = threading.Event()
        self._running: set[tuple[threading.Event, Store]] = set()  # each pull's stop and store

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.to_thread(self.scan)

    def scan(self) -> None:
        """Remove half-written pulls, restore complete ones into the tier (oldest first)."""
        found = []
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith(".") and entry.name.endswith(STAGING_SUFFIX) and entry.is_dir():
                log.info("storage: removing a half-written pull (%s)", entry.name)
                shutil.rmtree(entry, ignore_errors=True)
                continue
            if entry.name.startswith(("_", ".")) or not entry.is_dir() or entry.is_symlink():
                continue
            marker = _read_marker(entry / DONE_MARKER)
            if marker is None:
                log.info("storage: removing the half-written pull of %s", entry.name)
                shutil.rmtree(entry, ignore_errors=True)
                continue
            if marker.get("pvc"):
                shutil.rmtree(entry, ignore_errors=True)  # a link, remade on each load
                continue
            found.append((_int(marker, "last_used_ms"), entry.name, marker))
        for last_used, model_id, marker in sorted(found, reverse=True):
            if not self.tier.restore(model_id, _int(marker, "size_bytes"), _int(marker, "pull_ms"), last_used):
                log.info("storage: %s is over the disk budget, removed", model_id)
                shutil.rmtree(self.root / model_id, ignore_errors=True)
        self._started = True

    async def close(self) -> None:
        """Stop: running pulls end now (their connections shut, their files removed, their
        loads failed as retryable), and no new one starts. Files already pulled stay."""
        self._closing.set()
        with self._lock:
            running = list(self._running)
        for stop, store in running:
            stop.set()
            store.transport.abort()
        pulls = list(self._pulls.values())
        if pulls:
            await asyncio.gather(*pulls, return_exceptions=True)

    # ---- the API -----------------------------------------------------------------------
    def source_of(self, model_id: str, model_path: str, model_key: str) -> Source | None:
        """The model's source, or None when its path is local (no storage fields)."""
        try:
            key = parse_key(model_key)
            return resolve(model_path, key, self._read_config)
        except StorageConfigError as e:
            raise StorageError(model_id, "storage-config", model_path, CONFIG_KIND, str(e)) from None

    async def predict_size(self, model_id: str, model_path: str, model_key: str) -> int | None:
        """The model's size from its store's listing (before a byte moves), or None for a
        local path. A model already on disk answers from the disk."""
        source = self.source_of(model_id, model_path, model_key)
        if source is None:
            return None
        marker = _read_marker(self.root / model_id / DONE_MARKER)
        if marker is not None and marker.get("source") == _fingerprint(source):
            return _int(marker, "size_bytes")
        if source.type == "pvc":
            return await asyncio.to_thread(self._pvc_size, model_id, source)
        plan = await asyncio.to_thread(self._plan, model_id, source)
        return plan.total_bytes

    async def pull(self, model_id: str, model_path: str, model_key: str) -> Pulled | None:
        """The model on local disk (pulled now, or found there), or None for a local path.
        The same model asked for twice at once is pulled once."""
        check = self.source_of(model_id, model_path, model_key)
        if check is None:
            return None
        try:
            check_model_id(model_id)
        except StorageConfigError as e:
            raise StorageError(model_id, check.store, model_path, CONFIG_KIND, str(e)) from None
        running = self._pulls.get(model_id)
        if running is None:
            loop = asyncio.get_running_loop()
            running = loop.create_future()
            self._pulls[model_id] = running
            with self._lock:
                self._progress[model_id] = _Running()

            async def run() -> None:
                assert running is not None
                try:
                    running.set_result(await asyncio.to_thread(self._pull_sync, model_id, check, model_key))
                except BaseException as e:  # handed to every waiter
                    running.set_exception(e)
                finally:
                    self._pulls.pop(model_id, None)
                    with self._lock:
                        self._progress.pop(model_id, None)

            task = loop.create_task(run())
            running.add_done_callback(lambda _f: task)  # keep the task referenced until done
        return await asyncio.shield(running)

    def release(self, model_id: str) -> None:
        """The runtime unloaded the model: its files stay, and may now be evicted."""
        self._held.discard(model_id)

    async def remove(self, model_id: str) -> None:
        """Delete the model's files now (unless a pull of it is running)."""
        if model_id in self._pulls:
            return
        self._held.discard(model_id)
        with self._lock:
            self.tier.drop(model_id)
        await asyncio.to_thread(shutil.rmtree, self.root / model_id, True)

    def inventory(self) -> Inventory:
        now = time.monotonic() * 1000
        with self._lock:
            entries = [e for e in self.tier.entries() if e.complete]
            running = list(self._progress.items())
            inventory = Inventory(
                tuple(DiskModel(e.model_id, e.size_bytes, e.pull_ms, e.last_used_ms) for e in entries),
                self.tier.budget_bytes,
                self.tier.used_bytes,
                self.tier.version,
            )
        pulls = []
        for model_id, r in running:
            done = total = 0
            last = r.started_ms
            if r.progress is not None:
                with r.progress.lock:
                    done, total, last = min(r.progress.arrived, r.progress.total), r.progress.total, r.progress.last_ms
            pulls.append(PullProgress(model_id, done, total, int(now - r.started_ms), int(max(0.0, now - last))))
        return replace(inventory, pulls=tuple(pulls))

    # ---- internals ---------------------------------------------------------------------
    def _read_config(self, name: str) -> Mapping[str, object] | None:
        path = self.settings.config_dir / name
        try:
            text = path.read_text(encoding="utf-8")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise StorageConfigError(f"storage config {name!r} is not JSON") from None
        if not isinstance(value, dict):
            raise StorageConfigError(f"storage config {name!r} is not a JSON object")
        return value

    def _error(self, model_id: str, source: Source, obj: str, kind: str, detail: str) -> StorageError:
        return StorageError(model_id, source.store, obj, kind, redact(detail, source.config))

    def _plan(self, model_id: str, source: Source, fresh_s: float | None = None) -> ModelPlan:
        """The model's files from a listing made at most `fresh_s` ago (PLAN_FRESH_S), or now."""
        fp = _fingerprint(source)
        now = time.monotonic()
        fresh_s = PLAN_FRESH_S if fresh_s is None else fresh_s
        with self._lock:
            cached = self._plans.get(model_id)
        if cached is not None and cached[0] == fp and now - cached[2] <= fresh_s:
            return cached[1]
        plan = self._list_plan(model_id, source, source.path, None)
        with self._lock:
            for mid in [m for m, c in self._plans.items() if now - c[2] > PLAN_FRESH_S]:
                del self._plans[mid]  # never used by a pull: a model only sized here
            self._plans[model_id] = (fp, plan, now)
        return plan

    def _list_plan(self, model_id: str, source: Source, path: str, name: str | None) -> ModelPlan:
        """The files at `path` in the model's store (the model's, or its schema's under `name`);
        a path naming nothing is NOT_FOUND."""
        store = self._store(model_id, source)
        try:
            listed = store.list_objects(path)
        except (TransferError, StorageError) as e:
            raise self._error(model_id, source, e.object or path, e.kind, e.detail) from None
        except Exception as e:  # a reply no store parser could read: still this model's failure
            raise self._error(
                model_id, source, path, Failure.BAD, f"the store's reply to the listing is unreadable ({_what(e)})"
            ) from None
        finally:
            store.transport.close()
        try:
            plan = plan_files(path, listed, name)
        except StorageConfigError as e:
            raise self._error(model_id, source, path, Failure.BAD, str(e)) from None
        if not plan.files:
            raise self._error(model_id, source, path, Failure.NOT_FOUND, "no such object or folder")
        return plan

    def _store(self, model_id: str, source: Source) -> Store:
        try:
            return open_store(source, self.settings.stall_ms / 1000)
        except (OSError, ValueError) as e:  # a CA or client certificate that does not load
            raise self._error(
                model_id, source, "", Failure.TLS, f"bad certificate in the storage config: {e}"
            ) from None

    def _pull_sync(self, model_id: str, source: Source, model_key: str) -> Pulled:
        if self._closing.is_set():
            raise self._stopped(model_id, source)
        key = parse_key(model_key)
        fp = _fingerprint(source)
        mdir = self.root / model_id
        marker = _read_marker(mdir / DONE_MARKER)
        if source.type == "pvc":
            return self._link_pvc(model_id, source, key)
        if marker is not None and marker.get("source") == fp and model_id in self.tier:
            now = _now_ms()
            with self._lock:
                self.tier.touch(model_id, now)
                self._held.add(model_id)
            _write_marker(mdir / DONE_MARKER, {**marker, "last_used_ms": now})
            log.info("storage: %s from the disk tier (%d bytes)", model_id, marker["size_bytes"])
            return self._pulled(model_id, key, marker, from_disk=True)
        old = self._set_aside(model_id, marker)
        try:
            try:
                return self._pull_files(model_id, source, key, fp, PLAN_FRESH_S)
            except ObjectChanged as e:
                log.info("storage: %s: %s; listing %s again", model_id, e.detail, source.store)
            try:
                return self._pull_files(model_id, source, key, fp, 0.0)
            except ObjectChanged as e:
                raise self._error(model_id, source, e.object, e.kind, f"{e.detail} (again, listed anew)") from None
        except BaseException:
            with self._lock:
                self._plans.pop(model_id, None)  # the next try lists the store again
            self._keep(model_id, old)
            raise

    def _set_aside(self, model_id: str, marker: Mapping[str, object] | None) -> DiskEntry | None:
        """Before a pull: a complete copy from another source leaves the tier's count but stays
        on disk (its tier entry returned) until the pull replaces it; anything else is removed."""
        with self._lock:
            entry = next((e for e in self.tier.entries() if e.model_id == model_id and e.complete), None)
            self.tier.drop(model_id)
        if entry is not None and marker is not None:
            return entry
        shutil.rmtree(self.root / model_id, ignore_errors=True)
        return None

    def _keep(self, model_id: str, old: DiskEntry | None) -> None:
        """A pull failed: the copy it was to replace goes back into the tier (or, with no room
        left for it, away)."""
        if old is None or not (self.root / model_id).is_dir():
            return
        with self._lock:
            kept = model_id not in self.tier and self.tier.restore(
                model_id, old.size_bytes, old.pull_ms, old.last_used_ms
            )
        if not kept:
            shutil.rmtree(self.root / model_id, ignore_errors=True)

    def _pull_files(self, model_id: str, source: Source, key: Mapping[str, object], fp: str, fresh_s: float) -> Pulled:
        """One pull from a listing at most `fresh_s` old; ObjectChanged when an object no longer
        matches it (nothing of the pull left)."""
        mdir = self.root / model_id
        plan = self._plan(model_id, source, fresh_s)
        schema_plan: ModelPlan | None = None
        if source.schema_path:
            # Upstream pulls the schema as one more target: a file, or a folder's every object.
            name = schema_name(source.schema_path, plan.name)
            schema_plan = self._list_plan(model_id, source, source.schema_path.lstrip("/"), name)
        files = list(plan.files) + (list(schema_plan.files) if schema_plan else [])
        total = sum(f.size for f in files)
        free = self._admit(model_id, source, total)
        with self._lock:
            pulling = sum(e.size_bytes for e in self.tier.entries() if not e.complete and e.model_id != model_id)
        first = allocate_first(free, total, pulling)
        started = time.monotonic()
        staging = self._staging(model_id)
        try:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            self._download(model_id, source, staging, files, first)
            pull_ms = max(1, int((time.monotonic() - started) * 1000))
            now = _now_ms()
            marker = {
                "size_bytes": total,
                "pull_ms": pull_ms,
                "last_used_ms": now,
                "source": fp,
                "name": plan.name,
                "schema": schema_plan.name if schema_plan else None,
            }
            _write_marker(staging / DONE_MARKER, marker)
            _fsync_dir(staging)  # its entries on the disk before it is renamed into place
            _replace_dir(staging, mdir, self.root / _replaced_name(model_id))
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            with self._lock:
                self.tier.drop(model_id)
            raise
        shutil.rmtree(self.root / _replaced_name(model_id), ignore_errors=True)
        with self._lock:
            self.tier.done(model_id, total, pull_ms, now)
            self._held.add(model_id)
            self._plans.pop(model_id, None)
        mib = total / (1 << 20)
        log.info(
            "storage: pulled %s from %s: %d files, %.1f MiB in %d ms (%.0f MiB/s)",
            model_id,
            source.store,
            len(files),
            mib,
            pull_ms,
            mib / (pull_ms / 1000),
        )
        return self._pulled(model_id, key, marker, from_disk=False)

    def _admit(self, model_id: str, source: Source, total: int) -> int:
        """Room for `total` bytes in the tier's budget and on the volume, or the DISK failure;
        models are evicted only for a pull that will run. The volume's free bytes."""
        with self._lock:
            sizes = {e.model_id: e for e in self.tier.entries()}
            admission = self.tier.admit(model_id, total, _now_ms(), held=self._held)
            if not admission.admitted:
                raise self._error(
                    model_id, source, source.path, Failure.DISK, f"too large for the disk: {admission.reason}"
                )
            freed = sum(sizes[v].size_bytes for v in admission.evict if v in sizes)
            free = shutil.disk_usage(self.root).free
            if free + freed < total:
                self.tier.drop(model_id)
                for v in admission.evict:  # still on disk: back in the tier
                    e = sizes[v]
                    if not self.tier.restore(v, e.size_bytes, e.pull_ms, e.last_used_ms):
                        shutil.rmtree(self.root / v, ignore_errors=True)
                raise self._error(
                    model_id, source, source.path, Failure.DISK, f"needs {total} bytes, the volume has {free} free"
                )
        for victim in admission.evict:
            log.info("storage: evicting %s from the disk tier for %s", victim, model_id)
            shutil.rmtree(self.root / victim, ignore_errors=True)
        free = shutil.disk_usage(self.root).free
        if free < total:
            with self._lock:
                self.tier.drop(model_id)
            raise self._error(
                model_id, source, source.path, Failure.DISK, f"needs {total} bytes, the volume has {free} free"
            )
        return free

    def _staging(self, model_id: str) -> Path:
        """Where a pull writes until it is complete (hidden, so no model id can name it)."""
        return self.root / staging_name(model_id)

    def _pulled(
        self, model_id: str, key: Mapping[str, object], marker: Mapping[str, object], from_disk: bool
    ) -> Pulled:
        mdir = self.root / model_id
        schema = marker.get("schema")
        size = int(str(marker["size_bytes"]))
        return Pulled(
            model_id,
            str(mdir / str(marker["name"])),
            rewritten_key(key, size, str(mdir / str(schema)) if schema else None),
            size,
            int(str(marker.get("pull_ms", 0))),
            from_disk,
        )

    # ---- PVC ---------------------------------------------------------------------------
    def _pvc_target(self, model_id: str, source: Source, path: str | None = None) -> Path:
        """The file or folder at `path` (the model's by default) on the model's volume."""
        path = source.path if path is None else path
        root = self.settings.pvc_dir / str(source.config["name"])
        try:
            rel = safe_relpath(path)
            check_model_id(str(source.config["name"]))
        except StorageConfigError as e:
            raise self._error(model_id, source, path, Failure.BAD, str(e)) from None
        target = (root / rel).resolve()
        if not within(str(root.resolve()), str(target)):
            raise self._error(model_id, source, path, Failure.BAD, "the path leaves the volume (a link out of it)")
        if not target.exists():
            raise self._error(model_id, source, path, Failure.NOT_FOUND, "no such file or folder on the volume")
        return target

    def _pvc_size(self, model_id: str, source: Source) -> int:
        return _tree_size(self._pvc_target(model_id, source))

    def _link_pvc(self, model_id: str, source: Source, key: Mapping[str, object]) -> Pulled:
        """The model (and its schema, upstream's way) as links into its volume."""
        target = self._pvc_target(model_id, source)
        name = target.name or "_model"
        schema: tuple[str, Path] | None = None
        if source.schema_path:
            schema = (schema_name(source.schema_path, name), self._pvc_target(model_id, source, source.schema_path))
        mdir = self.root / model_id
        with self._lock:
            self.tier.drop(model_id)  # a copy pulled from a store before
        shutil.rmtree(mdir, ignore_errors=True)
        mdir.mkdir(parents=True)
        (mdir / name).symlink_to(target)
        if schema is not None:
            (mdir / schema[0]).symlink_to(schema[1])
        size = _tree_size(target)
        marker = {
            "size_bytes": size,
            "pull_ms": 0,
            "name": name,
            "schema": schema[0] if schema else None,
            "pvc": True,
            "source": _fingerprint(source),
        }
        _write_marker(mdir / DONE_MARKER, marker)
        return self._pulled(model_id, key, marker, from_disk=True)

    # ---- the download ------------------------------------------------------------------
    def _download(self, model_id: str, source: Source, into: Path, files: list[FilePlan], first: bool) -> None:
        """Every file's bytes into `into` (the pull's staging directory), each checked.
        `first` (`allocate_first`): every file is created and preallocated before the first
        GET; else each file fetched in one GET is created by the worker that fetches it (one of
        many parts: still here)."""
        progress = _Progress(sum(f.size for f in files))
        with self._lock:
            if (r := self._progress.get(model_id)) is not None:
                r.progress = progress
        tasks: list[_Task] = []
        parted: list[tuple[FilePlan, Path]] = []  # files of many parts: checked after them all
        parents: set[Path] = set()
        for f in files:
            path = into / f.local
            if path.parent not in parents:
                path.parent.mkdir(parents=True, exist_ok=True)
                parents.add(path.parent)
            parts = plan_parts(f.size, self.settings.part_bytes, self.settings.part_threshold)
            whole = len(parts) <= 1
            if first or not whole:
                try:
                    _create(path, f.size)
                except OSError as e:
                    raise self._disk_error(model_id, source, f.key, e) from None
            if whole:
                tasks.append(_Task(f, path, None, create=not first))
            else:
                tasks.extend(_Task(f, path, part, create=False) for part in parts)
                parted.append((f, path))
        store = self._store(model_id, source)
        stop = threading.Event()
        with self._lock:
            self._running.add((stop, store))
            if self._closing.is_set():  # close() ran after the check at the start of the pull
                stop.set()
        watcher = threading.Thread(target=self._report, args=(model_id, progress, stop), daemon=True)
        watcher.start()
        try:
            if parted:
                failed = self._run_pool(model_id, source, store, tasks, progress, stop, self.settings.parts_in_flight)
            else:
                fixed = self.settings.objects_in_flight
                pace = ObjectWorkers(len(tasks), fixed, fixed) if fixed > 0 else ObjectWorkers(len(tasks))
                failed = self._run_lanes(model_id, source, store, tasks, progress, stop, pace)
            if self._closing.is_set():
                raise self._stopped(model_id, source)
            if failed is not None:
                raise failed
        finally:
            stop.set()
            with self._lock:
                self._running.discard((stop, store))
            store.transport.close()
        if progress.done != progress.total:  # the sizes below are the preallocated ones: count bytes
            raise self._error(
                model_id, source, source.path, Failure.TRANSIENT, f"got {progress.done} bytes of {progress.total}"
            )
        # Files of one GET were checked (and synced) by their worker; those of many parts now.
        if self.settings.fsync and parted:
            with ThreadPoolExecutor(max(1, min(self.settings.parts_in_flight, len(parted)))) as pool:
                # The model is renamed into place only once their bytes are on the disk.
                list(pool.map(_fsync_file, [path for _f, path in parted]))
        for f, path in parted:
            got = path.stat().st_size
            if got != f.size:
                raise self._error(model_id, source, f.key, Failure.TRANSIENT, f"got {got} bytes of {f.size}")

    def _run_pool(
        self,
        model_id: str,
        source: Source,
        store: Store,
        tasks: list[_Task],
        progress: _Progress,
        stop: threading.Event,
        workers: int,
    ) -> BaseException | None:
        """A fixed number of workers over all the GETs of a pull with large files: their parts
        (and any small files beside them) share them."""
        with ThreadPoolExecutor(max(1, min(workers, len(tasks))), thread_name_prefix=f"pull-{model_id[:16]}") as pool:
            futures = [pool.submit(self._fetch, model_id, source, store, t, progress, stop) for t in tasks]
            failed: BaseException | None = None
            for fut in futures:
                try:
                    fut.result()
                except BaseException as e:  # the first failure is the one reported
                    stop.set()
                    failed = failed or e
        return failed

    def _run_lanes(
        self,
        model_id: str,
        source: Source,
        store: Store,
        tasks: list[_Task],
        progress: _Progress,
        stop: threading.Event,
        pace: ObjectWorkers,
    ) -> BaseException | None:
        """Objects of one GET each, by as many workers as `pace` says: each takes the next
        object, measures its wall and CPU time, and starts the workers `pace` says to add."""
        lock = threading.Lock()
        taken = [0]
        failed: list[BaseException] = []
        lanes: list[threading.Thread] = []

        def lane() -> None:
            while not stop.is_set():
                with lock:
                    if taken[0] >= len(tasks):
                        return
                    task = tasks[taken[0]]
                    taken[0] += 1
                wall, cpu = time.perf_counter(), time.thread_time()
                try:
                    self._fetch(model_id, source, store, task, progress, stop)
                except BaseException as e:  # the first failure is the one reported
                    with lock:
                        failed.append(e)
                    stop.set()
                    return
                wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
                with lock:
                    for _ in range(pace.done(wall, cpu, len(tasks) - taken[0])):
                        start()

        def start() -> None:  # under `lock`
            t = threading.Thread(target=lane, name=f"pull-{model_id[:16]}_{len(lanes)}", daemon=True)
            lanes.append(t)
            t.start()

        with lock:
            for _ in range(pace.workers):
                start()
        joined = 0
        while True:  # a lane starts others only while it runs: all joined means none left
            with lock:
                if joined >= len(lanes):
                    break
                lane_ = lanes[joined]
            lane_.join()
            joined += 1
        log.debug("storage: %s: %d objects by %d workers", model_id, len(tasks), len(lanes))
        return failed[0] if failed else None

    def _stopped(self, model_id: str, source: Source) -> StorageError:
        # Retryable: the model's store is fine, this instance is going away.
        return self._error(model_id, source, source.path, Failure.TRANSIENT, "the storage helper is stopping")

    def _disk_error(self, model_id: str, source: Source, obj: str, e: OSError) -> StorageError:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return self._error(model_id, source, obj, Failure.DISK, "the disk is full")
        return self._error(model_id, source, obj, Failure.DISK, f"cannot write locally: {e.strerror}")

    def _fetch(
        self,
        model_id: str,
        source: Source,
        store: Store,
        task: _Task,
        progress: _Progress,
        stop: threading.Event,
    ) -> None:
        f, path, part = task.file, task.path, task.part
        if stop.is_set():
            return
        try:
            fd = _create(path, f.size, keep_open=True) if task.create else os.open(path, os.O_WRONLY)
        except OSError as e:
            raise self._disk_error(model_id, source, f.key, e) from None
        try:
            if f.size:
                self._fetch_all(model_id, source, store, f, fd, part, progress, stop)
            if part is None and not stop.is_set():
                self._finish(model_id, source, f, fd)
        except OSError as e:
            raise self._disk_error(model_id, source, f.key, e) from None
        except (StorageError, TransferError):
            raise
        except Exception as e:  # a reply no store code could read: still this model's failure
            raise self._error(model_id, source, f.key, Failure.BAD, f"unreadable reply ({_what(e)})") from None
        finally:
            os.close(fd)

    def _fetch_all(
        self,
        model_id: str,
        source: Source,
        store: Store,
        f: FilePlan,
        fd: int,
        part: Part | None,
        progress: _Progress,
        stop: threading.Event,
    ) -> None:
        start = part.start if part else 0
        end = part.end if part else f.size - 1
        done = [0]  # bytes of this part written so far: a retry resumes after them
        # Small single objects of a store that lists their content MD5 (MD5_STORES): summed as
        # the bytes arrive (an MD5 costs ~2 ms/MiB of CPU: not for large objects).
        digest = (
            hashlib.md5(usedforsecurity=False)
            if part is None
            and source.type in MD5_STORES
            and _plain_md5(f.etag)
            and f.size < min(self.settings.part_threshold, MD5_LIMIT)
            else None
        )
        attempt = 0
        while True:
            if stop.is_set():
                return
            attempt += 1
            try:
                ranged = part is not None or done[0] > 0
                rest = Part(start + done[0], end) if ranged else None
                left = end - start + 1 - done[0]
                self._fetch_once(store, f, fd, rest, start + done[0], left, progress, stop, done, digest)
                break
            except ObjectChanged:
                raise  # the pull lists the store again
            except TransferError as e:
                if not retryable(e.kind) or attempt > RETRIES_PER_PART or stop.is_set():
                    raise self._error(model_id, source, f.key, e.kind, e.detail) from None
                wait = backoff_ms(attempt, random.random()) / 1000
                log.info("storage: %s object %r: %s; retry %d in %.1f s", model_id, f.key, e.detail, attempt, wait)
                stop.wait(wait)
        if digest is not None and done[0] == f.size and digest.hexdigest() != f.etag.lower():
            raise ObjectChanged(f"{f.key!r}: the body does not match its listed MD5", f.key)

    def _finish(self, model_id: str, source: Source, f: FilePlan, fd: int) -> None:
        """A file of one GET, all its bytes in: its size checked, synced when asked."""
        got = os.fstat(fd).st_size
        if got != f.size:
            raise self._error(model_id, source, f.key, Failure.TRANSIENT, f"got {got} bytes of {f.size}")
        if self.settings.fsync:
            os.fdatasync(fd)  # the model is renamed into place only once its bytes are on the disk

    def _fetch_once(
        self,
        store: Store,
        f: FilePlan,
        fd: int,
        part: Part | None,
        start: int,
        size: int,
        progress: _Progress,
        stop: threading.Event,
        done: list[int],
        digest: hashlib._Hash | None,
    ) -> None:
        resp = store.get(f.key, part, f.version)
        if resp.status == 412:  # the object is no longer the listed one (its ETag, its generation)
            store.transport.abandon(resp)
            raise ObjectChanged(f"{f.key!r} changed since it was listed (HTTP 412)", f.key)
        check_status(resp, f"{f.key!r}" + (f" bytes {part.start}-{part.end}" if part else ""))
        if part is not None and resp.status != 206:
            store.transport.abandon(resp)
            raise TransferError(Failure.BAD, "the store ignores byte ranges")
        length = resp.header("Content-Length")
        if length.isdigit() and int(length) != size:
            store.transport.abandon(resp)
            detail = f"the store sends {length} bytes where {size} were listed"
            if part is None:  # the whole object: another one than was listed
                raise ObjectChanged(f"{f.key!r}: {detail}", f.key)
            raise TransferError(Failure.TRANSIENT, detail)
        buf = bytearray(min(BUFFER_BYTES, max(1, size)))
        view = memoryview(buf)
        written = 0
        while written < size:
            if stop.is_set():
                store.transport.abandon(resp)
                return
            want = min(len(buf), size - written)
            try:
                n = store.transport.read_into(resp, view[:want], progress.heard)
            except TransferError:
                store.transport.abandon(resp)
                raise
            if n == 0:
                store.transport.abandon(resp)
                raise TransferError(Failure.TRANSIENT, f"connection dropped mid-object after {written} of {size} bytes")
            _pwrite_all(fd, view[:n], start + written)
            if digest is not None:
                digest.update(view[:n])
            written += n
            done[0] += n
            progress.add(n)

    def _report(self, model_id: str, progress: _Progress, stop: threading.Event) -> None:
        started = time.monotonic()
        while not stop.wait(PROGRESS_LOG_S):
            elapsed = time.monotonic() - started
            log.info(
                "storage: pulling %s: %.0f of %.0f MiB (%.0f MiB/s)",
                model_id,
                progress.done / (1 << 20),
                progress.total / (1 << 20),
                progress.done / (1 << 20) / max(elapsed, 1e-3),
            )


@dataclass(frozen=True)
class _Task:
    """One GET of a pull: a whole file (`part` None) or one part of a large one."""

    file: FilePlan
    path: Path  # in the pull's staging directory
    part: Part | None
    create: bool  # the worker creates the file (else it was created before the first GET)


def _create(path: Path, size: int, keep_open: bool = False) -> int:
    """Create `path` with its whole size preallocated, so a full disk shows now and not
    mid-object; the open descriptor with `keep_open`, else -1."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    except BaseException:
        os.close(fd)
        raise
    if keep_open:
        return fd
    os.close(fd)
    return -1


def _int(marker: Mapping[str, object], name: str) -> int:
    value = marker.get(name, 0)
    return int(value) if isinstance(value, int | float | str) else 0


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n


def _what(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _plain_md5(etag: str) -> bool:
    return len(etag) == 32 and all(c in "0123456789abcdefABCDEF" for c in etag)


def _fingerprint(source: Source) -> str:
    """What identifies a model's bytes: the store and path, never a credential."""
    return hashlib.sha256(f"{source.store}\0{source.path}\0{source.schema_path}".encode()).hexdigest()[:32]


def _read_marker(path: Path) -> dict[str, object] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) and "size_bytes" in value and "name" in value else None


def _write_marker(path: Path, marker: Mapping[str, object]) -> None:
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _replaced_name(model_id: str) -> str:
    """Where a model's previous copy waits while its new one is renamed into place: hidden and
    ending in `.partial`, so a start-up after a crash there removes it."""
    return f".{hashlib.sha256(model_id.encode()).hexdigest()}.old{STAGING_SUFFIX}"


def _replace_dir(new: Path, path: Path, aside: Path) -> None:
    """Rename `new` to `path`, moving what is at `path` to `aside` first (removed by the caller)."""
    if path.exists() or path.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(path, aside)
    os.rename(new, path)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
