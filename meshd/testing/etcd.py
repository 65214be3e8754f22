"""A throwaway etcd for tests, benchmarks and the demo (pytest-agnostic)."""

from __future__ import annotations

from pathlib import Path

from meshd.kv.embedded import EmbeddedEtcd


def start_test_etcd(tmp: Path, timeout_s: float = 30.0) -> EmbeddedEtcd:
    """Start etcd with its data and log under `tmp`; fsync is off since the data is disposable.

    The caller must `stop()` it (or use it as a context manager).
    """
    etcd = EmbeddedEtcd(tmp / "etcd-data", unsafe_no_fsync=True, log_dir=tmp / "logs")
    return etcd.start(timeout_s)
