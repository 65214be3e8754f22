"""Shared fixtures: one etcd per test session, and a key prefix per test to share it safely."""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator

import grpc
import pytest

from meshd.kv.embedded import EmbeddedEtcd
from meshd.testing import haproxy, procs
from meshd.testing.etcd import start_test_etcd

DATA_PLANES = ("python", "native")
LOGS_SHOWN = 8  # children whose log tails a failed test's report carries, latest first (a three-instance test runs six)
LOG_LINES = 40
_FIRST_CHILD = pytest.StashKey[int]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_FIRST_CHILD] = len(procs.STARTED)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report carries the log tails of the processes it ran (meshd, runtimes,
    etcd: its own, and those of wider fixtures still running): a failure seen once in CI can be
    read from CI's output."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if not report.failed:
        return
    first = item.stash.get(_FIRST_CHILD, len(procs.STARTED))
    shown = [c for i, c in enumerate(procs.STARTED) if i >= first or c.alive()][-LOGS_SHOWN:]
    for child in reversed(shown):
        report.sections.append(
            (f"log of {child.name} (pid {child.pid}, last {LOG_LINES} lines)", child.log_tail(LOG_LINES))
        )


def pytest_collection_finish(session: pytest.Session) -> None:
    """Find, build or fetch the tests' HAProxy before any test runs, when a test may use one:
    on a fresh machine that is a build from source (~75 s on 2 cores), which inside the first
    native test's set-up would count against that test's timeout."""
    if any({"haproxy_path", "data_plane"} & set(getattr(item, "fixturenames", ())) for item in session.items):
        haproxy.find_or_fetch()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests marked `both_data_planes` that use `data_plane` run once on each."""
    if "data_plane" in metafunc.fixturenames and metafunc.definition.get_closest_marker("both_data_planes"):
        metafunc.parametrize("data_plane", DATA_PLANES)


@pytest.fixture
def data_plane() -> str:
    """The data plane of the meshd processes a test starts (MESHD_DATAPLANE)."""
    return "python"


@pytest.fixture(scope="session")
def haproxy_path() -> str:
    """An HAProxy for the native data plane: found, or fetched from Debian packages once."""
    found = haproxy.find_or_fetch()
    if found is None:
        pytest.skip("no HAProxy here and no apt-get to fetch one: the native data plane cannot run (docs/native.md)")
    return found


def stream_error_codes(data_plane: str, code: grpc.StatusCode) -> set[grpc.StatusCode]:
    """The statuses a client may see when meshd or a runtime ends a stream with `code` while
    the client is still sending. Through HAProxy 2.6 (native data plane) the server's early end
    (trailers, then RST_STREAM(NO_ERROR)) can reach the client as RST_STREAM(CANCEL) instead:
    haproxy/haproxy#1219, fixed in later HAProxy releases; docs/native.md says so."""
    return {code} if data_plane == "python" else {code, grpc.StatusCode.CANCELLED}


def lost_in_flight(data_plane: str, failures: list[str], in_flight: int) -> list[str]:
    """The failures a fault may cause beyond the Python path's (none): through the native data
    plane, requests HAProxy had already sent to a runtime or peer that is killed are answered
    UNAVAILABLE (RST_STREAM(REFUSED_STREAM)), and those arriving at a runtime as it stops are
    answered CANCELLED or UNKNOWN "Stream removed", at most one per request then in flight;
    HAProxy 2.6 does not retry them (docs/native.md). Returns the failures not of that kind."""
    if data_plane == "python":
        return failures
    signs = ("RST_STREAM with error code 7", "CANCELLED: CANCELLED", "UNKNOWN: Stream removed")
    refused = [f for f in failures if any(s in f for s in signs)]
    other = [f for f in failures if f not in refused]
    return other if len(refused) <= in_flight else failures


def data_plane_settings(data_plane: str, request: pytest.FixtureRequest) -> dict[str, str | int]:
    """meshd settings for `data_plane`: MESHD_DATAPLANE, and MESHD_HAPROXY for native."""
    if data_plane == "python":
        return {}
    return {"data_plane": data_plane, "haproxy": request.getfixturevalue("haproxy_path")}


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


@pytest.fixture(scope="session")
def moto_server_url() -> Iterator[str]:
    """An S3-protocol server (moto's, a dev dependency) on loopback, for the storage tests."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def moto_url(moto_server_url: str) -> str:
    """moto's server, emptied first: its buckets live in the test process, shared by every server
    started in it, so one test's bucket would otherwise be another's BucketAlreadyOwnedByYou."""
    reset = urllib.request.Request(f"{moto_server_url}/moto-api/reset", method="POST")
    urllib.request.urlopen(reset, timeout=10).close()
    return moto_server_url
