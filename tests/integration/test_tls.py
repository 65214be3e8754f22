"""TLS and mutual TLS on real `meshd serve` processes, with certificates made by the test:
the external port per MM_TLS_CLIENT_AUTH, the internal port open to mesh members only (not
to other certificates from the mesh CA), a peer hop over mTLS, and bad TLS settings as one-line start-up errors."""

from __future__ import annotations

import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshd._proto.inference import grpc_predict_v2_pb2_grpc as v2_grpc
from meshd._proto.meshd import peer_pb2, peer_pb2_grpc
from meshd.runtimes.models import GeneratedModel, make_infer_request
from meshd.security.tls import client_credentials, read_client_credentials
from meshd.testing.certs import Issued, TestCA, mesh_tls_settings
from meshd.testing.cluster import LocalMesh, MeshClient, Node
from meshd.testing.procs import free_port

from .conftest import MODEL_SIZE, Client, close_enough, expected

pytestmark = [pytest.mark.slow, pytest.mark.both_data_planes]

ROWS = [[1.0, 2.0, 3.0, 4.0]]
PEER_NAME = "meshd-peers.test"  # the only name in the instance certificate (no IP)


@dataclass
class Pki:
    ca: TestCA
    instance: Issued  # every instance of the mesh shares it, as pods share one Secret
    instance_ip: Issued  # the same names plus the IP peers dial (127.0.0.1)
    instance_b: Issued  # a second instance's own certificate, holding the peer name
    app: Issued  # a client application's certificate from the mesh CA
    outsider: Issued  # signed by another CA

    def creds(self, who: Issued | None) -> grpc.ChannelCredentials:
        ca = str(self.ca.cert)
        return read_client_credentials(ca, str(who.cert), str(who.key)) if who else read_client_credentials(ca)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca = TestCA(d, "mesh")
    return Pki(
        ca,
        ca.issue("instance", dns=(PEER_NAME,), ips=()),
        ca.issue("instance-ip", dns=(PEER_NAME,), ips=("127.0.0.1",)),
        ca.issue("instance-b", dns=(PEER_NAME,), ips=()),
        ca.issue("app"),
        TestCA(d, "other").issue("outsider"),
    )


def secure(target: str, creds: grpc.ChannelCredentials | None) -> grpc.Channel:
    if creds is None:
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, creds, options=[("grpc.ssl_target_name_override", PEER_NAME)])


def client(node: Node, creds: grpc.ChannelCredentials | None) -> Client:
    return Client(node, secure(node.target, creds), grpc.insecure_channel(f"127.0.0.1:{node.runtime_port}"))


def refusal(channel: grpc.Channel) -> grpc.RpcError:
    """The error a caller sees when the port refuses it (the health service answers members)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with channel, pytest.raises(grpc.RpcError) as e:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return e.value


def member_call(node: Node, creds: grpc.ChannelCredentials | None, model_id: str) -> Any:
    """The internal load-here operation, as a peer (or an outsider) would call it."""
    with secure(f"127.0.0.1:{node.peer_port}", creds) as ch:
        req = peer_pb2.InternalOpRequest(modelId=model_id, load=True, sync=True)
        return peer_pb2_grpc.MeshPeerStub(ch).InternalOperation(req, timeout=30)


@pytest.fixture
def tls_mesh(mesh: LocalMesh, pki: Pki) -> Iterator[LocalMesh]:
    mesh.settings = mesh_tls_settings(pki.ca, pki.instance, "NONE", peer_name=PEER_NAME)
    yield mesh


def runtime_args() -> list[str]:
    return ["--capacity-bytes", str(4 * MODEL_SIZE)]


def test_tls_external_port_serves_with_the_ca_and_refuses_plaintext(
    tls_mesh: LocalMesh, pki: Pki, models: list[GeneratedModel]
) -> None:
    metrics_port = free_port()
    tls_mesh.settings = {**tls_mesh.settings, "metrics": f"prometheus:port={metrics_port};scheme=https"}
    node = tls_mesh.add_node("inst-a", runtime_args())
    a = client(node, pki.creds(None))
    try:
        m = models[0]
        a.register(m)
        assert close_enough(a.infer(m.id, ROWS), expected(m, ROWS))
    finally:
        a.close()
    plain = refusal(grpc.insecure_channel(node.target))
    assert plain.code() == grpc.StatusCode.UNAVAILABLE
    # The KServe REST port and the metrics port (MM_METRICS scheme=https) speak the same TLS.
    https = f"https://127.0.0.1:{node.http_port}/v2/health/ready"
    assert https_status(https, pki) == 200
    assert https_status(f"https://127.0.0.1:{metrics_port}/metrics", pki) == 200
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(https, timeout=10, context=ssl.create_default_context())  # not the mesh CA
    # A client that does not trust the mesh CA refuses the server.
    untrusting = grpc.ssl_channel_credentials(pki.outsider.cert.read_bytes())
    assert refusal(secure(node.target, untrusting)).code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_require_refuses_callers_without_a_trusted_certificate(
    mesh: LocalMesh, pki: Pki, models: list[GeneratedModel]
) -> None:
    mesh.settings = mesh_tls_settings(pki.ca, pki.instance, "REQUIRE", peer_name=PEER_NAME)
    node = mesh.add_node("inst-a", runtime_args())
    for who in (None, pki.outsider):
        assert refusal(secure(node.target, pki.creds(who))).code() == grpc.StatusCode.UNAVAILABLE
    a = client(node, pki.creds(pki.app))
    try:
        m = models[0]
        a.register(m)
        assert close_enough(a.infer(m.id, ROWS), expected(m, ROWS))
    finally:
        a.close()
    https = f"https://127.0.0.1:{node.http_port}/v2/health/live"
    assert https_status(https, pki, pki.app) == 200
    with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
        https_status(https, pki)  # no client certificate
    # The operator CLI dials the same port with the same files.
    tls = ["--tls-ca", str(pki.ca.cert), "--tls-server-name", PEER_NAME, "--address", node.target]
    mine = [*tls, "--tls-cert", str(pki.app.cert), "--tls-key", str(pki.app.key)]
    listed = ops_cli("models", "list", "--json", *mine)
    assert listed.returncode == 0, listed.stderr
    assert m.id in listed.stdout
    refused = ops_cli("models", "list", *tls)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"cannot reach meshd at {node.target}" in refused.stderr
    half = ops_cli("models", "list", *tls, "--tls-cert", str(pki.app.cert))
    assert half.returncode == 2 and "--tls-key" in half.stderr


def https_status(url: str, pki: Pki, who: Issued | None = None) -> int:
    ctx = ssl.create_default_context(cafile=str(pki.ca.cert))
    ctx.check_hostname = False  # the certificate names the mesh service, not 127.0.0.1
    if who is not None:
        ctx.load_cert_chain(str(who.cert), str(who.key))
    with urllib.request.urlopen(url, timeout=10, context=ctx) as r:
        status: int = r.status
        r.read()  # with TLS 1.3 a refused client certificate shows on the first read
    return status


def ops_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshd", *argv, "--timeout", "20"], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("peers_check", ["peer name", "dialed IP", "shared name", "per-instance certificates"])
def test_a_two_instance_tls_mesh_forwards_over_mtls_and_the_internal_port_refuses_non_members(
    mesh: LocalMesh, pki: Pki, models: list[GeneratedModel], peers_check: str
) -> None:
    if peers_check == "dialed IP":  # no peer name: peers check the advertised IP in the certificate
        shared = pki.instance_ip
        mesh.settings = mesh_tls_settings(pki.ca, shared)
    elif peers_check == "shared name":  # no IP, no peer name: peers check a DNS name the shared certificate holds
        shared = pki.instance
        mesh.settings = mesh_tls_settings(pki.ca, shared)
    else:  # MESHD_TLS_PEER_NAME: the certificate holds no IP
        shared = pki.instance
        mesh.settings = mesh_tls_settings(pki.ca, shared, peer_name=PEER_NAME)
    node_a = mesh.add_node("inst-a", runtime_args())
    # Per-instance certificates: b has its own; a's is a member there as it holds the peer name.
    own_b = mesh_tls_settings(pki.ca, pki.instance_b, peer_name=PEER_NAME) if peers_check.startswith("per") else None
    node_b = mesh.add_node("inst-b", runtime_args(), settings=own_b)
    a, b = client(node_a, pki.creds(None)), client(node_b, pki.creds(None))
    try:
        m = models[0]
        a.register(m)
        # A mesh member (the certificate the instances share) may call the internal port.
        assert member_call(node_b, pki.creds(shared), m.id).state == peer_pb2.InternalOpResponse.LOADED
        # Served through a by b's copy: the hop a -> b is mTLS under the peer name.
        assert close_enough(a.infer(m.id, ROWS), expected(m, ROWS))
        assert a.runtime_loaded() == [] and b.runtime_loaded() == [m.id]
        # Outside callers: plaintext, TLS without a certificate, a certificate from another CA.
        peer_target = f"127.0.0.1:{node_a.peer_port}"
        errors = [
            refusal(grpc.insecure_channel(peer_target)),
            refusal(secure(peer_target, pki.creds(None))),
            refusal(secure(peer_target, pki.creds(pki.outsider))),
        ]
        for e in errors:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            assert e.details(), e  # the caller is told why the connection failed
        with pytest.raises(grpc.RpcError) as outsider:
            member_call(node_a, pki.creds(pki.outsider), models[1].id)
        assert outsider.value.code() == grpc.StatusCode.UNAVAILABLE
        # A client certificate from the mesh CA (valid on the external port under REQUIRE)
        # passes the handshake but is no mesh instance: every internal service refuses it.
        app = pki.creds(pki.app)
        denied = [refusal(secure(peer_target, app))]
        with pytest.raises(grpc.RpcError) as loading:
            member_call(node_a, app, models[1].id)
        denied.append(loading.value)
        with pytest.raises(grpc.RpcError) as spoofed, secure(f"127.0.0.1:{node_b.peer_port}", app) as ch:
            hop = (("mm-model-id", m.id), ("meshd-hop", "inst-a"), ("meshd-mode", "serve"))
            v2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(make_infer_request(m.id, ROWS), metadata=hop, timeout=30)
        denied.append(spoofed.value)
        for e in denied:
            assert e.code() == grpc.StatusCode.PERMISSION_DENIED, e
            assert "admits mesh instances only: CN=app is not" in (e.details() or ""), e
        assert a.runtime_loaded() == []  # neither the outsider nor the app loaded anything
    finally:
        a.close()
        b.close()


def serve_error(env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "meshd", "serve", "--kv-store", "etcd:127.0.0.1:1", "--data-dir", str(tmp_path)]
    return subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("key mismatch", "does not match the certificate in MM_TLS_KEY_CERT_PATH"),
        ("missing cert", "MM_TLS_KEY_CERT_PATH: cannot read"),
        ("auth without trust", "MM_TLS_CLIENT_AUTH=REQUIRE needs MM_TLS_TRUST_CERT_PATH"),
        ("encrypted key", "set MM_TLS_PRIVATE_KEY_PASSPHRASE"),
        ("peer name", "set MESHD_TLS_PEER_NAME"),
        ("no usable name", "nor does any DNS name it holds"),
    ],
)
def test_bad_tls_settings_are_one_line_start_up_errors(pki: Pki, tmp_path: Path, case: str, expected: str) -> None:
    import os

    inst = pki.instance
    tls = {k: str(v) for k, v in mesh_tls_settings(pki.ca, inst, peer_name=PEER_NAME).items()}
    env = {
        "MM_TLS_KEY_CERT_PATH": tls["tls_key_cert"],
        "MM_TLS_PRIVATE_KEY_PATH": tls["tls_private_key"],
        "MM_TLS_TRUST_CERT_PATH": tls["tls_trust_certs"],
        "MESHD_TLS_PEER_NAME": PEER_NAME,
    }
    if case == "key mismatch":
        env["MM_TLS_PRIVATE_KEY_PATH"] = str(pki.app.key)
    elif case == "missing cert":
        env["MM_TLS_KEY_CERT_PATH"] = str(tmp_path / "absent.pem")
    elif case == "auth without trust":
        env["MM_TLS_CLIENT_AUTH"] = "REQUIRE"
        del env["MM_TLS_TRUST_CERT_PATH"]
    elif case == "encrypted key":
        enc = pki.ca.issue("encrypted", passphrase="pw", dns=(PEER_NAME,))
        env |= {"MM_TLS_KEY_CERT_PATH": str(enc.cert), "MM_TLS_PRIVATE_KEY_PATH": str(enc.key)}
    elif case == "peer name":
        env["MESHD_TLS_PEER_NAME"] = "not-in-the-certificate.test"
    elif case == "no usable name":
        bare = pki.ca.issue("bare", dns=(), ips=("10.9.9.9",))
        env |= {"MM_TLS_KEY_CERT_PATH": str(bare.cert), "MM_TLS_PRIVATE_KEY_PATH": str(bare.key)}
        del env["MESHD_TLS_PEER_NAME"]
    done = serve_error({"PATH": os.environ.get("PATH", "")} | env, tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("meshd serve: ") and expected in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


async def test_mesh_client_reaches_both_ports_of_a_tls_mesh(tls_mesh: LocalMesh, pki: Pki) -> None:
    """The testing client with the credentials helper (CA bytes in) on the external port and
    the instance certificate on the internal one."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    node = tls_mesh.add_node("inst-a", runtime_args())
    inst = pki.instance
    member = client_credentials(pki.ca.cert.read_bytes(), inst.cert.read_bytes(), inst.key.read_bytes())
    c = MeshClient.open(
        node, credentials=client_credentials(pki.ca.cert.read_bytes()), peer_credentials=member, tls_name=PEER_NAME
    )
    try:
        reply = await health_pb2_grpc.HealthStub(c.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert (await c.stats()).instanceId == "inst-a"
    finally:
        await c.close()
