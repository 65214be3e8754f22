"""TLS settings and start-up checks (meshd.security.tls, through meshd.config), with certificates
made in the test; and the credentials on an in-process grpc server."""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from meshd.config import ConfigError, add_serve_arguments, load_config
from meshd.security import peer_auth, tls
from meshd.testing.certs import Issued, TestCA, self_signed


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("pki")
    ca, other = TestCA(d, "mesh"), TestCA(d, "other")
    return {
        "ca": ca,
        "other": other,
        "inst": ca.issue("inst"),
        "dns_only": ca.issue("dns-only", dns=("meshd-peers.test",), ips=()),
        "encrypted": ca.issue("encrypted", passphrase="s3cret"),
        "outsider": other.issue("outsider"),
        "app": ca.issue("app"),  # a client application's certificate from the mesh CA
    }


def ca(pki: dict[str, object], name: str = "ca") -> TestCA:
    found = pki[name]
    assert isinstance(found, TestCA)
    return found


def cert(pki: dict[str, object], name: str) -> Issued:
    found = pki[name]
    assert isinstance(found, Issued)
    return found


def env_for(issued: Issued, trust: TestCA | None, **more: str) -> dict[str, str]:
    env = {"MM_TLS_KEY_CERT_PATH": str(issued.cert), "MM_TLS_PRIVATE_KEY_PATH": str(issued.key)}
    if trust is not None:
        env["MM_TLS_TRUST_CERT_PATH"] = str(trust.cert)
    return env | more


def config_error(env: dict[str, str], argv: tuple[str, ...] = ()) -> str:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    with pytest.raises(ConfigError) as e:
        load_config(p.parse_args(list(argv)), env)
    message = str(e.value)
    assert "\n" not in message
    return message


# ---- parsing (pure) ------------------------------------------------------------------------
def test_tls_is_off_without_settings() -> None:
    assert tls.parse_settings(None, None) is None
    assert tls.parse_settings("", "", "NONE", "", "", "") is None
    assert load_config(None, {}).tls is None


def test_parse_reads_upstream_values_case_insensitively_and_a_trust_list() -> None:
    s = tls.parse_settings("c.pem", "k.pem", "require", "a.pem, b.pem", None, " peers.svc ")
    assert s == tls.TlsSettings("c.pem", "k.pem", tls.ClientAuth.REQUIRE, ("a.pem", "b.pem"), None, "peers.svc")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("c", None), "needs both MM_TLS_KEY_CERT_PATH and MM_TLS_PRIVATE_KEY_PATH"),
        ((None, "k"), "MM_TLS_KEY_CERT_PATH is not set"),
        (("c", "k", "maybe"), "MM_TLS_CLIENT_AUTH must be NONE, REQUIRE or OPTIONAL (got 'maybe')"),
        (("c", "k", "REQUIRE"), "MM_TLS_CLIENT_AUTH=REQUIRE needs MM_TLS_TRUST_CERT_PATH"),
        (("c", "k", "OPTIONAL"), "MM_TLS_CLIENT_AUTH=OPTIONAL needs MM_TLS_TRUST_CERT_PATH"),
        ((None, None, "REQUIRE"), "MM_TLS_CLIENT_AUTH is set but TLS is off"),
        ((None, None, None, "ca.pem"), "MM_TLS_TRUST_CERT_PATH is set but TLS is off"),
        ((None, None, None, None, "pw"), "MM_TLS_PRIVATE_KEY_PASSPHRASE is set but TLS is off"),
    ],
)
def test_parse_errors_name_the_setting(args: tuple[str | None, ...], expected: str) -> None:
    with pytest.raises(tls.TlsConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        tls.parse_settings(*args)


# ---- loading and start-up checks ---------------------------------------------------------------
def test_flags_and_env_load_the_material(pki: dict[str, object]) -> None:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    inst = cert(pki, "inst")
    args = p.parse_args(["--tls-key-cert", str(inst.cert), "--tls-private-key", str(inst.key)])
    cfg = load_config(args, {"MM_TLS_TRUST_CERT_PATH": str(ca(pki).cert), "MM_TLS_CLIENT_AUTH": "REQUIRE"})
    assert cfg.tls is not None
    assert cfg.tls.settings.client_auth is tls.ClientAuth.REQUIRE
    assert cfg.tls.cert_chain == inst.cert.read_bytes()
    assert cfg.tls.trust == ca(pki).cert.read_bytes() == cfg.tls.internal_trust
    assert cfg.tls.peer_options() == []


def test_missing_file_is_one_line(pki: dict[str, object], tmp_path: Path) -> None:
    env = env_for(cert(pki, "inst"), ca(pki), MM_TLS_PRIVATE_KEY_PATH=str(tmp_path / "nope.key"))
    assert "MM_TLS_PRIVATE_KEY_PATH: cannot read" in config_error(env)
    env = env_for(cert(pki, "inst"), ca(pki), MM_TLS_TRUST_CERT_PATH=f"{ca(pki).cert},{tmp_path / 'gone.pem'}")
    assert "MM_TLS_TRUST_CERT_PATH: cannot read" in config_error(env)


def test_files_of_the_wrong_kind(pki: dict[str, object]) -> None:
    inst = cert(pki, "inst")
    assert "holds no PEM certificate" in config_error(env_for(inst, ca(pki), MM_TLS_KEY_CERT_PATH=str(inst.key)))
    assert "holds no PEM private key" in config_error(env_for(inst, ca(pki), MM_TLS_PRIVATE_KEY_PATH=str(inst.cert)))
    assert "MM_TLS_TRUST_CERT_PATH" in config_error(env_for(inst, None, MM_TLS_TRUST_CERT_PATH=str(inst.key)))


def test_key_not_matching_the_certificate(pki: dict[str, object]) -> None:
    env = env_for(cert(pki, "inst"), ca(pki), MM_TLS_PRIVATE_KEY_PATH=str(cert(pki, "dns_only").key))
    assert "does not match the certificate in MM_TLS_KEY_CERT_PATH" in config_error(env)


def test_client_auth_without_trust_via_config(pki: dict[str, object]) -> None:
    env = env_for(cert(pki, "inst"), None, MM_TLS_CLIENT_AUTH="REQUIRE")
    assert config_error(env).startswith("MM_TLS_CLIENT_AUTH=REQUIRE needs MM_TLS_TRUST_CERT_PATH")


def test_encrypted_key_needs_the_right_passphrase(pki: dict[str, object]) -> None:
    enc = cert(pki, "encrypted")
    assert "is encrypted: set MM_TLS_PRIVATE_KEY_PASSPHRASE" in config_error(env_for(enc, ca(pki)))
    wrong = config_error(env_for(enc, ca(pki), MM_TLS_PRIVATE_KEY_PASSPHRASE="wrong"))
    assert wrong.startswith("MM_TLS_PRIVATE_KEY_PASSPHRASE: cannot open")
    cfg = load_config(None, env_for(enc, ca(pki), MM_TLS_PRIVATE_KEY_PASSPHRASE="s3cret"))
    assert cfg.tls is not None
    assert b"ENCRYPTED" not in cfg.tls.private_key and b"PRIVATE KEY" in cfg.tls.private_key


def test_certificate_peers_cannot_verify(pki: dict[str, object]) -> None:
    # Signed by another CA than the mesh trusts.
    message = config_error(env_for(cert(pki, "outsider"), ca(pki)))
    assert "peers dialing '127.0.0.1' would refuse this instance's certificate" in message
    # No trust set: the leaf alone cannot anchor its own chain.
    message = config_error(env_for(cert(pki, "inst"), None))
    assert "MM_TLS_TRUST_CERT_PATH is not set" in message


def test_certificate_not_naming_the_dialed_address_is_dialed_under_a_name_it_holds(pki: dict[str, object]) -> None:
    # modelmesh-serving's documented certificate (docs/configuration/tls.md): DNS names of the
    # service and localhost, IP 0.0.0.0, no pod IP; shared by all pods. No extra setting needed.
    shared = ca(pki).issue("tls-md", dns=("modelmesh-serving.ns", "localhost"), ips=("0.0.0.0",))
    cfg = load_config(None, env_for(shared, ca(pki), MESHD_ADVERTISE_HOST="10.1.2.3"))
    assert cfg.tls is not None and cfg.tls.settings.peer_name is None
    assert cfg.tls.peer_options() == [("grpc.ssl_target_name_override", "modelmesh-serving.ns")]
    assert "'modelmesh-serving.ns'" in cfg.tls.describe()
    # A wildcard name serves with its star filled in.
    wild = ca(pki).issue("wild", dns=("*.ns.svc",), ips=())
    wild_tls = load_config(None, env_for(wild, ca(pki))).tls
    assert wild_tls is not None and wild_tls.dial_name == "meshd-peer.ns.svc"
    # The dialed address in the certificate: checked as it is, no override.
    inst = load_config(None, env_for(cert(pki, "inst"), ca(pki))).tls
    assert inst is not None and inst.peer_options() == []
    # Refused only when no name would do.
    no_name = ca(pki).issue("ip-only", dns=(), ips=("10.9.9.9",))
    message = config_error(env_for(no_name, ca(pki)))
    assert "peers dialing '127.0.0.1' would refuse" in message and "nor does any DNS name it holds" in message


def test_a_peer_name_is_checked_as_given(pki: dict[str, object]) -> None:
    dns_only = cert(pki, "dns_only")
    message = config_error(env_for(dns_only, ca(pki), MESHD_TLS_PEER_NAME="other.test"))
    assert "'other.test'" in message and "mismatch" in message and "set MESHD_TLS_PEER_NAME" in message
    cfg = load_config(None, env_for(dns_only, ca(pki), MESHD_TLS_PEER_NAME="meshd-peers.test"))
    assert cfg.tls is not None
    assert cfg.tls.peer_options() == [("grpc.ssl_target_name_override", "meshd-peers.test")]
    assert "shared certificate" not in cfg.tls.describe()


def test_upstreams_deprecated_tls_names_are_read(pki: dict[str, object]) -> None:
    inst, enc = cert(pki, "inst"), cert(pki, "encrypted")
    older = {"MM_SVC_GRPC_CA_CERT_PATH": str(inst.cert), "MM_SVC_GRPC_PRIVATE_KEY_PATH": str(inst.key)}
    cfg = load_config(None, older | {"MM_TLS_TRUST_CERT_PATH": str(ca(pki).cert)})
    assert cfg.tls is not None and cfg.tls.settings.key_cert_path == str(inst.cert)
    assert any("MM_SVC_GRPC_CA_CERT_PATH is a deprecated name" in w for w in cfg.warnings)
    assert not any("ignored" in w and "MM_SVC_GRPC" in w for w in cfg.warnings)
    # The older-still TAS_ names and the passphrase's older name.
    tas = {
        "TAS_SVC_GRPC_CA_CERT_PATH": str(enc.cert),
        "TAS_SVC_GRPC_PRIVATE_KEY_PATH": str(enc.key),
        "MM_SVC_GRPC_PRIVATE_KEY_PASSPHRASE": "s3cret",
    }
    tas_tls = load_config(None, tas | {"MM_TLS_TRUST_CERT_PATH": str(ca(pki).cert)}).tls
    assert tas_tls is not None and tas_tls.settings.private_key_passphrase == "s3cret"
    # Both given: the MM_TLS_* name wins, as upstream reads it first.
    both = load_config(None, env_for(enc, ca(pki), MM_TLS_PRIVATE_KEY_PASSPHRASE="s3cret") | older)
    assert both.tls is not None and both.tls.settings.key_cert_path == str(enc.cert)
    assert any(w.startswith("MM_SVC_GRPC_CA_CERT_PATH is ignored: MM_TLS_KEY_CERT_PATH") for w in both.warnings)


def test_metrics_never_ask_for_a_client_certificate(pki: dict[str, object]) -> None:
    import ssl

    cfg = load_config(None, env_for(cert(pki, "inst"), ca(pki), MM_TLS_CLIENT_AUTH="REQUIRE"))
    assert cfg.tls is not None
    assert cfg.tls.http_server_context().verify_mode == ssl.CERT_REQUIRED  # KServe REST: per MM_TLS_CLIENT_AUTH
    assert cfg.tls.metrics_server_context().verify_mode == ssl.CERT_NONE


def test_a_self_signed_certificate_is_its_own_trust(tmp_path: Path) -> None:
    solo = self_signed(tmp_path, "solo")
    cfg = load_config(None, env_for(solo, None))
    assert cfg.tls is not None and cfg.tls.trust is None
    assert cfg.tls.internal_trust == solo.cert.read_bytes()


def test_read_client_credentials_errors(pki: dict[str, object], tmp_path: Path) -> None:
    inst = cert(pki, "inst")
    with pytest.raises(tls.TlsConfigError, match="cannot read"):
        tls.read_client_credentials(str(tmp_path / "none.pem"))
    with pytest.raises(tls.TlsConfigError, match="needs its private key"):
        tls.read_client_credentials(str(ca(pki).cert), str(inst.cert))
    tls.read_client_credentials(str(ca(pki).cert), str(inst.cert), str(inst.key))


# ---- credentials on a real (in-process) grpc server ---------------------------------------------
async def health_check(port: int, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    target = f"127.0.0.1:{port}"
    channel = grpc.aio.secure_channel(target, credentials) if credentials else grpc.aio.insecure_channel(target)
    async with channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


async def serving(
    credentials: grpc.ServerCredentials, interceptors: list[grpc.aio.ServerInterceptor]
) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=interceptors)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = tls.bind(server, "127.0.0.1:0", credentials)
    await server.start()
    return server, port


async def test_external_client_auth_modes_and_the_internal_port(pki: dict[str, object]) -> None:
    inst, outsider, app = cert(pki, "inst"), cert(pki, "outsider"), cert(pki, "app")
    anonymous = tls.client_credentials(ca(pki).cert.read_bytes())
    callers = [None, anonymous] + [
        tls.read_client_credentials(str(ca(pki).cert), str(c.cert), str(c.key)) for c in (inst, outsider, app)
    ]
    results: dict[str, list[grpc.StatusCode]] = {}
    for mode in ("NONE", "OPTIONAL", "REQUIRE", "internal"):
        env = env_for(inst, ca(pki), MM_TLS_CLIENT_AUTH="REQUIRE" if mode == "internal" else mode)
        material = load_config(None, env).tls
        assert material is not None
        if mode == "internal":  # as meshd.mesh builds the internal server
            server, port = await serving(material.internal_server_credentials(), peer_auth.interceptors(material))
        else:
            server, port = await serving(material.external_server_credentials(), [])
        try:
            results[mode] = [await health_check(port, c) for c in callers]
        finally:
            await server.stop(None)
    ok, refused, denied = grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.PERMISSION_DENIED
    # callers:               plaintext, no cert, instance, other CA, app (mesh CA)
    assert results["NONE"] == [refused, ok, ok, ok, ok]
    assert results["OPTIONAL"] == [refused, ok, ok, ok, ok]  # no certificate is asked for (see ClientAuth)
    assert results["REQUIRE"] == [refused, refused, ok, refused, ok]
    # The internal port: the handshake refuses certificates from other CAs; among the mesh
    # CA's certificates, only mesh instances' (here: the instance's own) are admitted.
    assert results["internal"] == [refused, refused, ok, refused, denied]
