"""The storage helper's wiring, shared by `meshd adapter` and `meshd llm-runtime` (issue 42):
where pulled models go, a load's pull and its status, a stored model's size from its store's
listing, and `meshd.disk.DiskTier/diskInventory` (what the helper keeps on disk, which meshd
publishes for placement)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc

from meshd._proto.meshd import disk_pb2, disk_pb2_grpc
from meshd.storage import Pulled, StorageError, StorageHelper, StorageSettings

log = logging.getLogger(__name__)

ROOT_MODEL_DIR_HELP = (
    "pull models whose key or path names a store (storage-config, s3://, hf://, ...) into "
    "this folder first and keep them there as a disk tier (env ROOT_MODEL_DIR; its budget: env "
    "MESHD_DISK_CACHE_BYTES; the secret's folder: env STORAGE_CONFIG_DIR; docs/storage.md)"
)


class Failure(Exception):
    """A call's failure with its gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def add_root_model_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root-model-dir", type=Path, help=ROOT_MODEL_DIR_HELP)


def storage_root(a: argparse.Namespace, env: Mapping[str, str]) -> Path | None:
    """Where pulled models go (the flag, else upstream's ROOT_MODEL_DIR); None: no storage
    helper, model paths are local files."""
    if a.root_model_dir is not None:
        return Path(a.root_model_dir)
    value = env.get("ROOT_MODEL_DIR")
    return Path(value) if value else None


async def open_storage(root: Path | None) -> StorageHelper | None:
    """The started helper for `root` (None: none)."""
    if root is None:
        return None
    storage = StorageHelper(StorageSettings.from_env(root))
    await storage.start()  # half-written pulls removed, complete ones back in the tier
    return storage


async def pull(storage: StorageHelper | None, model_id: str, model_path: str, model_key: str) -> Pulled | None:
    """The model pulled onto local disk when its key or path names a store (or found on the
    disk tier); None when its path is local. A failed pull is the load's Failure, naming the
    model, the store and the object."""
    if storage is None:
        return None
    try:
        pulled = await storage.pull(model_id, model_path, model_key)
    except StorageError as e:
        # Not UNAVAILABLE: that would read as the runtime gone, not the model's store.
        code = grpc.StatusCode.INTERNAL if e.retryable else grpc.StatusCode.FAILED_PRECONDITION
        raise Failure(code, str(e)) from None
    if pulled is not None:
        how = "found on disk" if pulled.from_disk else f"pulled in {pulled.pull_ms} ms"
        log.info("%s: %s (%d bytes) at %s", model_id, how, pulled.disk_size_bytes, pulled.local_path)
    return pulled


async def listed_size(storage: StorageHelper | None, model_id: str, model_path: str, model_key: str) -> int | None:
    """A stored model's bytes from its store's listing (or the disk tier), before a byte
    moves; None: its path is local (or no helper)."""
    if storage is None:
        return None
    try:
        return await storage.predict_size(model_id, model_path, model_key)
    except StorageError as e:
        raise Failure(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None


class DiskTier(disk_pb2_grpc.DiskTierServicer):  # type: ignore[misc]
    """`meshd.disk.DiskTier`: what the storage helper keeps on disk, for meshd's placement."""

    def __init__(self, storage: StorageHelper) -> None:
        self.storage = storage

    async def diskInventory(
        self, request: disk_pb2.DiskInventoryRequest, context: Any
    ) -> disk_pb2.DiskInventoryResponse:
        inv = self.storage.inventory()
        models = [
            disk_pb2.DiskModel(
                model_id=m.model_id, size_bytes=m.size_bytes, pull_ms=m.pull_ms, last_used_ms=m.last_used_ms
            )
            for m in inv.models
        ]
        pulls = [
            disk_pb2.Pull(
                model_id=p.model_id,
                bytes_done=p.bytes_done,
                bytes_total=p.bytes_total,
                elapsed_ms=p.elapsed_ms,
                idle_ms=p.idle_ms,
            )
            for p in inv.pulls
        ]
        return disk_pb2.DiskInventoryResponse(
            models=models, budget_bytes=inv.budget_bytes, used_bytes=inv.used_bytes, version=inv.version, pulls=pulls
        )


def serve_disk_tier(server: grpc.aio.Server, storage: StorageHelper | None) -> None:
    """Without a helper diskInventory is UNIMPLEMENTED: meshd sees no tier."""
    if storage is not None:
        disk_pb2_grpc.add_DiskTierServicer_to_server(DiskTier(storage), server)
