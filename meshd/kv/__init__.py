"""Key-value store seam (etcd and in-process), records and watch-fed mirrors."""

from meshd.kv.store import (
    Compacted,
    Compare,
    Delete,
    Event,
    KeyValue,
    KVStore,
    LeaseExpired,
    Op,
    Put,
    StoreError,
    StoreUnavailable,
    TxnResult,
    delete_if,
    put_if,
)

__all__ = [
    "Compacted",
    "Compare",
    "Delete",
    "Event",
    "KVStore",
    "KeyValue",
    "LeaseExpired",
    "Op",
    "Put",
    "StoreError",
    "StoreUnavailable",
    "TxnResult",
    "delete_if",
    "put_if",
]
