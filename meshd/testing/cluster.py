"""A mesh of real processes on loopback: one etcd, reference runtimes, meshd instances.

Used by the demo, the integration tests and the benchmarks, so all three start
processes the same way and stop every one of them by PID.
"""

from __future__ import annotations

import signal
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from meshd._proto.inference import grpc_predict_v2_pb2_grpc as v2_grpc
from meshd._proto.meshd import peer_pb2 as peer
from meshd._proto.meshd import peer_pb2_grpc as peer_grpc
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc
from meshd.config import env_for
from meshd.kv.embedded import EmbeddedEtcd
from meshd.testing.procs import Child, Children, free_port, free_ports, port_open, wait_until

START_TIMEOUT_S = 60.0


class StartFailed(RuntimeError):
    pass


def sized_runtime_args(models: int, model_size_bytes: int, load_delay_ms: int = 0) -> list[str]:
    """Reference-runtime flags for room for `models` models of `model_size_bytes`. Its
    default model size is set to that size too: meshd reserves the default size for a load
    until the runtime reports the real one, so a right estimate never over-commits the cache."""
    return [
        "--capacity-bytes",
        str(models * model_size_bytes),
        "--load-delay-ms",
        str(load_delay_ms),
        "--default-model-size",
        str(model_size_bytes),
    ]


@dataclass
class Node:
    instance_id: str
    grpc_port: int
    peer_port: int
    runtime_port: int
    meshd: Child
    runtime: Child
    http_port: int = 0  # KServe V2 REST (0: disabled by the node's settings)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@dataclass
class LocalMesh:
    workdir: Path
    service: str = "meshd-test"
    # Settings every meshd of this mesh gets (e.g. TLS: meshd.testing.certs.mesh_tls_settings).
    settings: dict[str, str | int] = field(default_factory=dict)
    children: Children = field(init=False)
    etcd: EmbeddedEtcd | None = field(default=None)
    etcd_url: str = ""
    nodes: list[Node] = field(default_factory=list)
    # Every process dies with the thread that started it (`meshd demo`: a demo killed or its
    # terminal closed leaves nothing running); tests stop theirs by PID instead.
    die_with_parent: bool = False

    def __post_init__(self) -> None:
        self.children = Children(self.workdir / "logs", self.die_with_parent)

    # ---- processes -------------------------------------------------------------------
    def start_etcd(self) -> str:
        logs = self.workdir / "logs"
        self.etcd = EmbeddedEtcd(
            self.workdir / "etcd", unsafe_no_fsync=True, log_dir=logs, die_with_parent=self.die_with_parent
        )
        self.etcd.start()
        self.etcd_url = self.etcd.url
        return self.etcd_url

    def start_runtime(self, name: str, args: list[str] | None = None, port: int | None = None) -> tuple[Child, int]:
        port = port or free_port()
        child = self.children.python(name, "meshd.runtimes.demo", ["--port", str(port), *(args or [])])
        self._wait_port(child, port)
        return child, port

    def start_meshd(
        self,
        instance_id: str,
        runtime_port: int,
        settings: dict[str, str | int] | None = None,
        grpc_port: int | None = None,
        peer_port: int | None = None,
        name: str | None = None,
        http_port: int | None = None,
    ) -> Child:
        if not self.etcd_url:
            raise StartFailed("start etcd (or set etcd_url) before meshd")
        given = [p for p in (grpc_port, peer_port, http_port) if p]
        spare = iter(free_ports(5, avoid=given))  # distinct: start-up refuses two settings on one port
        grpc_port = grpc_port or next(spare)
        peer_port = peer_port or next(spare)
        probe_port, prestop_port = next(spare), next(spare)
        # Never the defaults: several instances share this host.
        http_port = http_port or next(spare)
        env = env_for(
            {
                "service_name": self.service,
                "kv_store": f"etcd:{self.etcd_url}",
                "instance_id": instance_id,
                "grpc_port": grpc_port,
                "peer_port": peer_port,
                "http_port": http_port,
                "runtime_port": runtime_port,
                "data_dir": str(self.workdir / instance_id),
                "metrics": "disabled",  # several instances on one host: no two on port 2112
                "drain_grace_ms": 0,  # a test's SIGTERM stops at once unless the test asks for a grace
                "probe_port": probe_port,  # nor on 8089 and 8090
                "prestop_port": prestop_port,
                **self.settings,
                **(settings or {}),
            }
        )
        child = self.children.start(name or instance_id, [sys.executable, "-m", "meshd", "serve"], env)
        child.teardown_signal = signal.SIGINT  # tearing a test mesh down: no drain
        self._wait_port(child, grpc_port)
        if str((settings or {}).get("probe_port", self.settings.get("probe_port", probe_port))) == str(probe_port):
            # Ready (/ready 200) comes after the instance record is published: peers know it.
            self._wait_ready(child, probe_port)
        return child

    def add_node(
        self,
        instance_id: str,
        runtime_args: list[str] | None = None,
        settings: dict[str, str | int] | None = None,
    ) -> Node:
        runtime, runtime_port = self.start_runtime(f"{instance_id}-runtime", runtime_args)
        grpc_port, peer_port, http_port = free_ports(3, avoid=[runtime_port])
        meshd = self.start_meshd(instance_id, runtime_port, settings, grpc_port, peer_port, http_port=http_port)
        node = Node(instance_id, grpc_port, peer_port, runtime_port, meshd, runtime, http_port)
        self.nodes.append(node)
        return node

    def restart_meshd(self, node: Node, settings: dict[str, str | int] | None = None) -> None:
        node.meshd.stop()
        node.meshd = self.start_meshd(
            node.instance_id,
            node.runtime_port,
            settings,
            node.grpc_port,
            node.peer_port,
            name=f"{node.instance_id}-restarted",
            http_port=node.http_port,
        )

    def _wait_port(self, child: Child, port: int) -> None:
        def up() -> bool:
            if not child.alive():
                raise StartFailed(f"{child.name} exited with {child.proc.returncode}:\n{child.log_tail()}")
            return port_open(port)

        try:
            wait_until(up, START_TIMEOUT_S, f"{child.name} on port {port}")
        except TimeoutError as e:
            raise StartFailed(f"{e}\n{child.log_tail()}") from None

    def _wait_ready(self, child: Child, probe_port: int) -> None:
        def ready() -> bool:
            if not child.alive():
                raise StartFailed(f"{child.name} exited with {child.proc.returncode}:\n{child.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{probe_port}/ready", timeout=5) as r:
                    return bool(r.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        try:
            wait_until(ready, START_TIMEOUT_S, f"{child.name} ready")
        except TimeoutError as e:
            raise StartFailed(f"{e}\n{child.log_tail()}") from None

    def stop(self) -> None:
        try:
            self.children.stop_all()
        finally:
            if self.etcd is not None:
                self.etcd.stop()

    def __enter__(self) -> LocalMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- clients ---------------------------------------------------------------------------
@dataclass
class MeshClient:
    """Stubs for one instance's external and internal ports."""

    node: Node
    channel: grpc.aio.Channel
    peer_channel: grpc.aio.Channel

    @classmethod
    def open(
        cls,
        node: Node,
        max_message_bytes: int = 64 << 20,
        credentials: grpc.ChannelCredentials | None = None,
        peer_credentials: grpc.ChannelCredentials | None = None,
        tls_name: str | None = None,
    ) -> MeshClient:
        """Plaintext unless credentials are given (meshd.security.tls.client_credentials); the internal
        port of a TLS mesh needs `peer_credentials` with a certificate the mesh trusts.
        `tls_name`: the name to check in the server certificate (MESHD_TLS_PEER_NAME)."""
        opts: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]

        def dial(target: str, creds: grpc.ChannelCredentials | None, options: list[tuple[str, Any]]) -> Any:
            if creds is None:
                return grpc.aio.insecure_channel(target, options=options)
            named = [("grpc.ssl_target_name_override", tls_name)] if tls_name else []
            return grpc.aio.secure_channel(target, creds, options=[*options, *named])

        peer_target = f"127.0.0.1:{node.peer_port}"
        return cls(node, dial(node.target, credentials, opts), dial(peer_target, peer_credentials, []))

    @property
    def mm(self) -> mm_grpc.ModelMeshStub:
        return mm_grpc.ModelMeshStub(self.channel)

    @property
    def v2(self) -> v2_grpc.GRPCInferenceServiceStub:
        return v2_grpc.GRPCInferenceServiceStub(self.channel)

    async def stats(self) -> Any:
        return await peer_grpc.MeshPeerStub(self.peer_channel).InstanceStats(peer.InstanceStatsRequest(), timeout=10)

    async def close(self) -> None:
        await self.channel.close()
        await self.peer_channel.close()
