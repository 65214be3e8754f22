"""Shared fixtures: one etcd per test session, and a key prefix per test to share it safely."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from meshd.kv.embedded import EmbeddedEtcd
from meshd.testing.etcd import start_test_etcd


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    """A real etcd for the whole session, started on first use and always stopped (by PID)."""
    etcd = start_test_etcd(tmp_path_factory.mktemp("etcd"))
    try:
        yield etcd
    finally:
        etcd.stop()


@pytest.fixture
def etcd_prefix() -> str:
    """A key prefix no other test uses, so tests can share `etcd_server`."""
    return f"/test/{uuid.uuid4().hex[:12]}/"
