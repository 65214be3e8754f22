"""kv: the seam to etcd, the one outside world where the mesh's state lives.

Owns: `store` (the `KVStore` interface: revisions, compare-and-set transactions, leases,
prefix watches), `etcd` (over aetcd) and `memory` (in-process, same semantics, for unit
tests and the simulator), `embedded` (the private etcd child process), `lease`, `txn`,
`table` (watch-fed mirrors of a key prefix), `election` (leader election),
`watch_trace` (a trace file of applied revisions), `health` (whether the store answers;
caller-facing calls that give up at once when it does not).

May import: core, process.
"""

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
