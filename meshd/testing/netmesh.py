"""A mesh of real processes on a `NetLab`: a three-member etcd cluster and meshd instances
(each with its reference runtime), every member and every instance on its own host
(namespace and address). The test process is the observer and the client: it reaches every
host from the root namespace. Every process is stopped by PID (and the lab removes what is
left by name)."""

from __future__ import annotations

import functools
import json
import signal
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from meshd.config import env_for
from meshd.kv.embedded import find_etcd_binary
from meshd.testing.netns import SUBNET, NetLab
from meshd.testing.procs import Child, port_open, wait_until

ETCD_CLIENT_PORT, ETCD_PEER_PORT = 2379, 2380
GRPC_PORT, PEER_PORT, RUNTIME_PORT = 8033, 8080, 8085
START_TIMEOUT_S = 60.0


@dataclass
class NetNode:
    instance_id: str
    host: str
    addr: str
    meshd: Child
    runtime: Child
    runtime_args: list[str] = field(default_factory=list)
    settings: dict[str, str | int] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return f"{self.addr}:{GRPC_PORT}"

    @property
    def peer_target(self) -> str:
        return f"{self.addr}:{PEER_PORT}"

    @property
    def runtime_target(self) -> str:
        return f"{self.addr}:{RUNTIME_PORT}"


@dataclass
class NetMesh:
    lab: NetLab
    service: str
    etcd_members: list[str] = field(default_factory=list)  # host names
    nodes: dict[str, NetNode] = field(default_factory=dict)
    etcd_argv: dict[str, list[str]] = field(default_factory=dict)
    etcd_procs: dict[str, Child] = field(default_factory=dict)  # the running process of each member

    def etcd_url(self, member: str) -> str:
        return f"http://{self.lab.hosts[member].addr}:{ETCD_CLIENT_PORT}"

    @property
    def etcd_urls(self) -> str:
        return ",".join(self.etcd_url(m) for m in self.etcd_members)

    def start_etcd(self, members: int = 3) -> None:
        names = [f"etcd{i + 1}" for i in range(members)]
        for i, name in enumerate(names):
            self.lab.add_host(name, f"{SUBNET}.{11 + i}")
        cluster = ",".join(f"{n}=http://{self.lab.hosts[n].addr}:{ETCD_PEER_PORT}" for n in names)
        binary = str(find_etcd_binary())
        for name in names:
            addr = self.lab.hosts[name].addr
            client, peer = f"http://{addr}:{ETCD_CLIENT_PORT}", f"http://{addr}:{ETCD_PEER_PORT}"
            argv = [
                binary, "--name", name, "--data-dir", str(self.lab.workdir / name),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", cluster, "--initial-cluster-state", "new",
                "--initial-cluster-token", self.lab.tag, "--unsafe-no-fsync",
            ]  # fmt: skip
            self.etcd_argv[name] = argv
            self.etcd_procs[name] = self.lab.children.start(name, self.lab.argv(name, argv))
        self.etcd_members = names
        for name in names:
            wait_until(functools.partial(self.etcd_healthy, name), START_TIMEOUT_S, f"{name} healthy")

    def restart_etcd(self, member: str) -> Child:
        """The member again, on its data directory (its cluster flags are ignored then)."""
        self.etcd_procs[member] = self.lab.children.start(member, self.lab.argv(member, self.etcd_argv[member]))
        return self.etcd_procs[member]

    def etcd_healthy(self, member: str) -> bool:
        try:
            with urllib.request.urlopen(f"{self.etcd_url(member)}/health", timeout=1.0) as resp:
                return str(json.loads(resp.read() or b"{}").get("health")) == "true"
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def add_node(self, instance_id: str, addr: str, runtime_args: list[str], settings: dict[str, str | int]) -> NetNode:
        host = instance_id
        self.lab.add_host(host, addr)
        runtime = self._runtime(host, addr, runtime_args)
        meshd = self._meshd(instance_id, host, addr, settings)
        node = NetNode(instance_id, host, addr, meshd, runtime, runtime_args, settings)
        self.nodes[instance_id] = node
        return node

    def restart_runtime(self, node: NetNode) -> None:
        """The node's runtime again, on its host and port (the old one stopped or killed)."""
        node.runtime = self._runtime(node.host, node.addr, node.runtime_args)

    def restart_meshd(self, node: NetNode) -> None:
        """The node's meshd again, with its settings (the old one stopped or killed)."""
        node.meshd = self._meshd(node.instance_id, node.host, node.addr, node.settings)

    def _runtime(self, host: str, addr: str, runtime_args: list[str]) -> Child:
        runtime = self.lab.children.start(
            f"{host}-runtime",
            self.lab.argv(host, [sys.executable, "-m", "meshd.runtimes.demo", "--host", "0.0.0.0",
                                 "--port", str(RUNTIME_PORT), *runtime_args]),
        )  # fmt: skip
        self._wait_port(runtime, addr, RUNTIME_PORT)
        return runtime

    def _meshd(self, instance_id: str, host: str, addr: str, settings: dict[str, str | int]) -> Child:
        env = env_for(
            {
                "service_name": self.service,
                "kv_store": f"etcd:{self.etcd_urls}",
                "instance_id": instance_id,
                "advertise_host": addr,
                "grpc_port": GRPC_PORT,
                "peer_port": PEER_PORT,
                "http_port": "off",
                "runtime_port": RUNTIME_PORT,
                "data_dir": str(self.lab.workdir / instance_id),
                "metrics": "disabled",
                **settings,
            }
        )
        meshd = self.lab.children.start(instance_id, self.lab.argv(host, [sys.executable, "-m", "meshd", "serve"]), env)
        meshd.teardown_signal = signal.SIGINT  # tearing a test mesh down: no drain
        self._wait_port(meshd, addr, GRPC_PORT)
        return meshd

    @staticmethod
    def _wait_port(child: Child, addr: str, port: int) -> None:
        def up() -> bool:
            if not child.alive():
                raise RuntimeError(f"{child.name} exited with {child.proc.returncode}:\n{child.log_tail()}")
            return port_open(port, addr)

        wait_until(up, START_TIMEOUT_S, f"{child.name} on {addr}:{port}")

    def stop(self) -> None:
        self.lab.close()


def start_netmesh(workdir: Path, service: str, etcd_members: int = 3) -> NetMesh:
    """An open lab with the etcd cluster running; the caller adds nodes and `stop()`s it."""
    lab = NetLab(workdir).open()
    mesh = NetMesh(lab, service)
    try:
        mesh.start_etcd(etcd_members)
    except BaseException:
        lab.close()
        raise
    return mesh
