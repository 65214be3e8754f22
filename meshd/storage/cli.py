"""`meshd pull`: pull one model as a runtime's load would (check a storage-config secret, warm a
node's disk tier), or list the disk tier. Also the storage flags the runtimes' commands share
(`add_arguments`, `settings_from_args`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict

from meshd.decisions.storage_plan import (
    DISK_BUDGET_SHARE,
    MAX_PARTS_IN_FLIGHT,
    OBJECTS_CAP,
    OBJECTS_START,
    STALL_TIMEOUT_MS,
)
from meshd.storage.errors import StorageError
from meshd.storage.helper import (
    DEFAULT_PVC_MOUNTS_DIR,
    DEFAULT_ROOT_MODEL_DIR,
    DEFAULT_STORAGE_CONFIG_DIR,
    StorageHelper,
    StorageSettings,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The storage helper's flags, each with its environment name."""
    g = p.add_argument_group("storage (docs/storage.md)")
    g.add_argument("--model-dir", help=f"where pulled models go (env ROOT_MODEL_DIR; default {DEFAULT_ROOT_MODEL_DIR})")
    g.add_argument(
        "--storage-config",
        help=f"the storage-config directory, one JSON file per key (env STORAGE_CONFIG_DIR; "
        f"default {DEFAULT_STORAGE_CONFIG_DIR})",
    )
    g.add_argument(
        "--pvc-mounts", help=f"where PVCs are mounted (env PVC_MOUNTS_DIR; default {DEFAULT_PVC_MOUNTS_DIR})"
    )
    g.add_argument(
        "--disk-cache-bytes",
        type=int,
        help=f"the disk tier's budget (env MESHD_DISK_CACHE_BYTES; "
        f"default {DISK_BUDGET_SHARE * 100:.0f} %% of the volume)",
    )
    g.add_argument(
        "--pull-stall-ms",
        type=int,
        help=f"fail a pull after this long without a byte (env MESHD_PULL_STALL_MS; default {STALL_TIMEOUT_MS})",
    )
    g.add_argument(
        "--pull-parallel",
        type=int,
        help=f"ranged GETs in flight per model (env MESHD_PULL_PARALLEL; default {MAX_PARTS_IN_FLIGHT})",
    )
    g.add_argument(
        "--pull-objects",
        type=int,
        help="workers fetching a folder's objects of one GET each, per model (env MESHD_PULL_OBJECTS; "
        f"default 0: adapted to the store, from {OBJECTS_START} up to {OBJECTS_CAP})",
    )
    g.add_argument(
        "--pull-fsync",
        choices=["on", "off"],
        help="sync each file before its rename, for a cache that must outlive a node crash "
        "(env MESHD_PULL_FSYNC=1 for on; default off)",
    )


def settings_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> StorageSettings:
    """Flags over the environment over the defaults; a bad value exits with a clear message."""
    e = dict(os.environ if env is None else env)
    for flag, name in (
        ("model_dir", "ROOT_MODEL_DIR"),
        ("storage_config", "STORAGE_CONFIG_DIR"),
        ("pvc_mounts", "PVC_MOUNTS_DIR"),
        ("disk_cache_bytes", "MESHD_DISK_CACHE_BYTES"),
        ("pull_stall_ms", "MESHD_PULL_STALL_MS"),
        ("pull_parallel", "MESHD_PULL_PARALLEL"),
        ("pull_objects", "MESHD_PULL_OBJECTS"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            e[name] = str(value)
    if getattr(args, "pull_fsync", None) is not None:
        e["MESHD_PULL_FSYNC"] = "1" if args.pull_fsync == "on" else "0"
    try:
        s = StorageSettings.from_env(env=e)
    except ValueError as err:
        raise SystemExit(f"meshd: a storage setting is not a number: {err}") from None
    if s.budget_bytes is not None and s.budget_bytes < 8192:
        raise SystemExit("meshd: MESHD_DISK_CACHE_BYTES must be at least 8192")
    if s.stall_ms < 1 or s.parts_in_flight < 1:
        raise SystemExit("meshd: MESHD_PULL_STALL_MS and MESHD_PULL_PARALLEL must be positive")
    if s.objects_in_flight < 0:
        raise SystemExit("meshd: MESHD_PULL_OBJECTS must be 0 (adapted to the store) or positive")
    return s


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meshd pull",
        description="Pull a model onto local disk as a runtime's load would, or list the disk tier "
        "(--inventory). Prints JSON: the local path, the key handed to the runtime, size and pull time.",
    )
    p.add_argument("model_id", nargs="?", help="the model's id (its directory under the model dir)")
    p.add_argument(
        "model_path", nargs="?", help="its path in the store, or a URI (s3://, gs://, hf://, pvc://, https://)"
    )
    p.add_argument("--key", default="", help="the model's key: JSON with storage_key, storage_params, ...")
    p.add_argument("--inventory", action="store_true", help="list the models on disk instead")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.inventory and not (args.model_id and args.model_path):
        p.error("give MODEL_ID and MODEL_PATH, or --inventory")
    settings = settings_from_args(args)

    async def run() -> int:
        try:
            helper = StorageHelper(settings)
        except OSError as e:
            print(f"meshd pull: cannot use the model dir {settings.root_dir}: {e.strerror}", file=sys.stderr)
            return 1
        await helper.start()
        if args.inventory:
            inv = helper.inventory()
            print(json.dumps({**asdict(inv), "models": [asdict(m) for m in inv.models]}, indent=2))
            return 0
        try:
            pulled = await helper.pull(args.model_id, args.model_path, args.key)
        except StorageError as e:
            print(f"meshd pull: {e}", file=sys.stderr)
            return 1
        if pulled is None:
            print("meshd pull: a local path with no storage fields: nothing to pull", file=sys.stderr)
            return 0
        print(json.dumps(asdict(pulled), indent=2))
        return 0

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
