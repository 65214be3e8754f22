"""TLS for meshd's gRPC ports: the MM_TLS_* settings, the PEM material read and checked at
start-up, and the gRPC credentials made from it.

- External port: TLS with this instance's certificate; client certificates per
  MM_TLS_CLIENT_AUTH, checked against MM_TLS_TRUST_CERT_PATH.
- Internal (peer) port: whenever TLS is on, a client certificate signed by the mesh's trust
  certificates is required; meshd.security.peer_auth then admits only mesh instances' certificates.
- Peer channels present this instance's certificate and check the peer's against the same
  trust, under MESHD_TLS_PEER_NAME when set, else the dialed address when the certificate
  holds it, else a DNS name the (shared) certificate holds (peers dial a pod IP; certificates
  usually name a service, and upstream's internal links check no host name).
- `client_credentials` / `read_client_credentials` for tools that dial meshd (CLI, tests).

The runtime connection is local (loopback or unix socket) and stays plaintext.
"""

from __future__ import annotations

import errno
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import grpc

CERT_ENV = "MM_TLS_KEY_CERT_PATH"
KEY_ENV = "MM_TLS_PRIVATE_KEY_PATH"
PASSPHRASE_ENV = "MM_TLS_PRIVATE_KEY_PASSPHRASE"
CLIENT_AUTH_ENV = "MM_TLS_CLIENT_AUTH"
TRUST_ENV = "MM_TLS_TRUST_CERT_PATH"
PEER_NAME_ENV = "MESHD_TLS_PEER_NAME"

PEM_CERT = b"-----BEGIN CERTIFICATE-----"
PEM_KEY_END = b"PRIVATE KEY-----"
HANDSHAKE_ROUNDS = 8  # a TLS 1.2/1.3 handshake needs at most 3 flights each way
WILDCARD_FILL = "meshd-peer"  # the label put in a wildcard DNS name to dial peers under it


class TlsConfigError(ValueError):
    """A TLS setting or file that cannot be used; the message is one line naming the setting."""


class _NameMismatch(TlsConfigError):
    """The certificate verifies but does not hold the name it was checked under."""


class ClientAuth(StrEnum):
    """MM_TLS_CLIENT_AUTH (upstream values) for the external port."""

    NONE = "NONE"
    REQUIRE = "REQUIRE"
    # Callers may come without a certificate. grpc's Python API cannot ask for a certificate
    # without requiring it, so none is asked for; meshd bases no decision on one.
    OPTIONAL = "OPTIONAL"


@dataclass(frozen=True, slots=True)
class TlsSettings:
    key_cert_path: str
    private_key_path: str
    client_auth: ClientAuth = ClientAuth.NONE
    trust_cert_paths: tuple[str, ...] = ()
    private_key_passphrase: str | None = None
    peer_name: str | None = None


def parse_settings(
    key_cert_path: str | None,
    private_key_path: str | None,
    client_auth: str | None = None,
    trust_cert_paths: str | None = None,
    private_key_passphrase: str | None = None,
    peer_name: str | None = None,
) -> TlsSettings | None:
    """The TLS settings as given (pure: no file is read); None when TLS is off."""
    auth_text = (client_auth or "NONE").strip().upper()
    try:
        auth = ClientAuth(auth_text)
    except ValueError:
        raise TlsConfigError(f"{CLIENT_AUTH_ENV} must be NONE, REQUIRE or OPTIONAL (got {client_auth!r})") from None
    trust = tuple(p.strip() for p in (trust_cert_paths or "").split(",") if p.strip())
    if not key_cert_path and not private_key_path:
        others = {
            CLIENT_AUTH_ENV: auth is not ClientAuth.NONE,
            TRUST_ENV: bool(trust),
            PASSPHRASE_ENV: bool(private_key_passphrase),
            PEER_NAME_ENV: bool(peer_name),
        }
        given = [name for name, on in others.items() if on]
        if given:
            raise TlsConfigError(f"{given[0]} is set but TLS is off: set {CERT_ENV} and {KEY_ENV}")
        return None
    if not key_cert_path or not private_key_path:
        missing = CERT_ENV if not key_cert_path else KEY_ENV
        raise TlsConfigError(f"TLS needs both {CERT_ENV} and {KEY_ENV} ({missing} is not set)")
    if auth is not ClientAuth.NONE and not trust:
        raise TlsConfigError(
            f"{CLIENT_AUTH_ENV}={auth.value} needs {TRUST_ENV} (CA certificates to check client certificates with)"
        )
    return TlsSettings(
        key_cert_path, private_key_path, auth, trust, private_key_passphrase or None, (peer_name or "").strip() or None
    )


@dataclass(frozen=True, slots=True)
class MeshTls:
    """This instance's TLS material, read and checked; makes every credential meshd uses."""

    settings: TlsSettings
    cert_chain: bytes
    private_key: bytes  # PEM, never encrypted: grpc takes clear keys only
    trust: bytes | None  # MM_TLS_TRUST_CERT_PATH files, concatenated
    # The name peers check in each other's certificate (gRPC's target-name override) instead
    # of the dialed address: MESHD_TLS_PEER_NAME, or one the certificate holds (`load`).
    dial_name: str | None = None

    @property
    def internal_trust(self) -> bytes:
        """What the internal port and peer channels trust: the trust certificates, or when
        none are set, this instance's own chain (a self-signed or CA-including chain)."""
        return self.trust or self.cert_chain

    def external_server_credentials(self) -> grpc.ServerCredentials:
        auth = self.settings.client_auth
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.trust if auth is ClientAuth.REQUIRE else None,
            require_client_auth=auth is ClientAuth.REQUIRE,
        )

    def http_server_context(self) -> ssl.SSLContext:
        """The same TLS for meshd's KServe REST port as for the external gRPC port, client
        certificates per MM_TLS_CLIENT_AUTH (/metrics: `metrics_server_context`)."""
        ctx = _server_context(self.settings)
        auth = self.settings.client_auth
        if auth is ClientAuth.REQUIRE and self.trust is not None:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(cadata=self.trust.decode("ascii"))
        return ctx

    def internal_server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)], root_certificates=self.internal_trust, require_client_auth=True
        )

    def peer_credentials(self) -> grpc.ChannelCredentials:
        return client_credentials(self.internal_trust, self.cert_chain, self.private_key)

    def metrics_server_context(self) -> ssl.SSLContext:
        """The certificate for /metrics, never asking for a client certificate whatever
        MM_TLS_CLIENT_AUTH says: upstream's metrics endpoint asks for none, and Prometheus
        scrapes modelmesh-serving's pods (their annotations) without one."""
        return _server_context(self.settings)

    def peer_options(self) -> list[tuple[str, Any]]:
        name = self.dial_name
        return [("grpc.ssl_target_name_override", name)] if name else []

    def dial_peer(self, location: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
        """A peers.Dial: an mTLS channel to another instance's internal port."""
        return grpc.aio.secure_channel(location, self.peer_credentials(), options=[*options, *self.peer_options()])

    def describe(self) -> str:
        text = f"tls (client auth {self.settings.client_auth.value}), internal mtls"
        if self.dial_name and not self.settings.peer_name:
            text += f" (peers check the name {self.dial_name!r} of the shared certificate, which names no pod IP)"
        return text


def bind(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Add a listening port, TLS when credentials are given; returns the bound port.

    OSError (EADDRINUSE) when it cannot listen there (grpc raises a bare RuntimeError)."""
    try:
        if credentials is None:
            port: int = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as e:
        raise OSError(errno.EADDRINUSE, f"cannot listen for gRPC on {address}: {e}") from None
    return port


def client_credentials(
    ca: bytes | None = None, cert: bytes | None = None, key: bytes | None = None
) -> grpc.ChannelCredentials:
    """Credentials for dialing a TLS port: `ca` to check the server (None: system roots),
    `cert` + `key` to present a client certificate (mTLS)."""
    if (cert is None) != (key is None):
        raise TlsConfigError("a client certificate needs its private key (and the key its certificate)")
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def read_client_credentials(
    ca_path: str | None = None, cert_path: str | None = None, key_path: str | None = None
) -> grpc.ChannelCredentials:
    """`client_credentials` from PEM files; an unreadable file is a one-line TlsConfigError."""
    ca = _read(ca_path, "CA certificates", PEM_CERT) if ca_path else None
    cert = _read(cert_path, "client certificate", PEM_CERT) if cert_path else None
    key = _read(key_path, "client private key", PEM_KEY_END) if key_path else None
    return client_credentials(ca, cert, key)


def load(settings: TlsSettings, dialed_as: str) -> MeshTls:
    """Read and check the files: they parse, the key matches the certificate (and opens with
    the passphrase), and a peer dialing `dialed_as` would accept this instance's certificate
    and be accepted with it. Errors are one line.

    The name peers check: MESHD_TLS_PEER_NAME when set; else `dialed_as` when the certificate
    holds it; else the first DNS name of the certificate that verifies (modelmesh-serving's
    documented certificate names the service, localhost and 0.0.0.0, no pod IP, and upstream's
    internal links check no host name). Refused only when no name would do."""
    s = settings
    cert_chain = _read(s.key_cert_path, CERT_ENV, PEM_CERT)
    raw_key = _read(s.private_key_path, KEY_ENV, PEM_KEY_END)
    encrypted = b"ENCRYPTED" in raw_key
    if encrypted and not s.private_key_passphrase:
        raise TlsConfigError(f"{KEY_ENV}: {s.private_key_path} is encrypted: set {PASSPHRASE_ENV}")
    trust = b"\n".join(_read(p, TRUST_ENV, PEM_CERT) for p in s.trust_cert_paths) or None
    # Opened first: a wrong passphrase reads better from cryptography than from OpenSSL.
    key = _decrypt(raw_key, s.private_key_passphrase) if encrypted and s.private_key_passphrase else raw_key
    _check_pair(s)
    if trust is not None:
        try:
            ssl.create_default_context(cadata=trust.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError) as e:
            raise TlsConfigError(f"{TRUST_ENV}: not usable as CA certificates: {_reason(e)}") from None
    tls = MeshTls(s, cert_chain, key, trust, s.peer_name)
    if s.peer_name:
        try:
            _check_peers_accept(tls, s.peer_name)
        except _NameMismatch as e:
            raise TlsConfigError(f"{e} (set {PEER_NAME_ENV} to a name the certificate holds)") from None
        return tls
    try:
        _check_peers_accept(tls, dialed_as)
        return tls
    except _NameMismatch as mismatch:
        for name in dial_names(cert_chain):
            try:
                _check_peers_accept(tls, name)
            except _NameMismatch:
                continue
            return replace(tls, dial_name=name)
        raise TlsConfigError(
            f"{mismatch} (nor does any DNS name it holds: add the pod IP or a DNS name to it)"
        ) from None


def dial_names(cert_chain: bytes) -> list[str]:
    """Names peers could check the leaf certificate of `cert_chain` under, in its order: its
    DNS names (a wildcard's `*` filled in), or its common name when it has no alternative names."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    try:
        leaf = x509.load_pem_x509_certificate(cert_chain)
    except ValueError:
        return []
    try:
        sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = sans.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:  # names only in the subject: checkers fall back to its CN
        dns = [str(a.value) for a in leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    return [WILDCARD_FILL + d[1:] if d.startswith("*.") else d for d in dns]


# ---- checks ---------------------------------------------------------------------------------
def _read(path: str, what: str, marker: bytes) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TlsConfigError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    if marker not in data:
        kind = "certificate" if marker == PEM_CERT else "private key"
        raise TlsConfigError(f"{what}: {path} holds no PEM {kind}")
    return data


def _no_prompt() -> bytes:
    # Without a password callback OpenSSL would prompt on the terminal for an encrypted key.
    raise TlsConfigError(f"{KEY_ENV}: the key is encrypted: set {PASSPHRASE_ENV}")


def self_signed_server_context(host: str = "localhost") -> ssl.SSLContext:
    """A server context with a certificate made now and signed by itself: for MM_METRICS
    `scheme=https` without an MM_TLS_* certificate (modelmesh-serving's pods ask for https
    metrics by default; Prometheus scrapes such pods without verifying). cryptography is a
    core dependency for this."""
    import datetime
    import tempfile

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as d:  # ssl reads certificates from files only
        cert_path, key_path = f"{d}/cert.pem", f"{d}/key.pem"
        with open(cert_path, "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))
        with open(key_path, "wb") as f:
            f.write(
                key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            )
        ctx.load_cert_chain(cert_path, key_path)
    return ctx


def can_self_sign() -> bool:
    try:
        import cryptography  # noqa: F401
    except ImportError:
        return False
    return True


def _server_context(s: TlsSettings) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(s.key_cert_path, s.private_key_path, password=s.private_key_passphrase or _no_prompt)
    return ctx


def _check_pair(s: TlsSettings) -> None:
    try:
        _server_context(s)
    except ssl.SSLError as e:
        text = str(e)
        if "KEY_VALUES_MISMATCH" in text:
            raise TlsConfigError(
                f"{KEY_ENV}: {s.private_key_path} does not match the certificate in {CERT_ENV}"
            ) from None
        raise TlsConfigError(f"{CERT_ENV}/{KEY_ENV}: cannot use them together: {_reason(e)}") from None


def _decrypt(pem: bytes, passphrase: str) -> bytes:
    try:
        from cryptography.hazmat.primitives import serialization
    except ImportError:
        raise TlsConfigError(
            f"{PASSPHRASE_ENV} needs the 'cryptography' package (pip install 'meshd[tls]'), or give an unencrypted key"
        ) from None
    try:
        key = serialization.load_pem_private_key(pem, password=passphrase.encode())
    except (ValueError, TypeError) as e:
        raise TlsConfigError(f"{PASSPHRASE_ENV}: cannot open {KEY_ENV} with it: {e}") from None
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _check_peers_accept(tls: MeshTls, name: str) -> None:
    """An in-memory handshake of this instance with itself, as two peers will do it: the
    client checks the server certificate under `name`, the server requires the client's."""
    trust = tls.internal_trust.decode("ascii", errors="replace")
    server = _server_context(tls.settings)
    server.verify_mode = ssl.CERT_REQUIRED
    server.load_verify_locations(cadata=trust)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_verify_locations(cadata=trust)
    s = tls.settings
    client.load_cert_chain(s.key_cert_path, s.private_key_path, password=s.private_key_passphrase or _no_prompt)
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(c_in, c_out, server_hostname=name)
    srv = server.wrap_bio(s_in, s_out, server_side=True)
    trusted = TRUST_ENV if tls.trust else f"the chain in {CERT_ENV}, as {TRUST_ENV} is not set"
    c_done = s_done = False
    for _ in range(HANDSHAKE_ROUNDS):
        if not c_done:
            c_done = _step(c, f"peers dialing {name!r} would refuse this instance's certificate", trusted)
        s_in.write(c_out.read())
        if not s_done:
            s_done = _step(srv, "peers would refuse this instance's certificate as a client", trusted)
        c_in.write(s_out.read())
        if c_done and s_done:
            return
    raise TlsConfigError("the TLS self-check handshake did not finish")  # pragma: no cover - not expected


def _step(side: ssl.SSLObject, refusal: str, trusted: str) -> bool:
    try:
        side.do_handshake()
    except ssl.SSLWantReadError:
        return False
    except ssl.SSLError as e:
        reason = _reason(e)
        if "mismatch" in reason:  # "Hostname mismatch" / "IP address mismatch"
            raise _NameMismatch(f"{refusal}: {reason}") from None
        raise TlsConfigError(f"{refusal}: {reason} (the mesh trusts {trusted})") from None
    return True


def _reason(e: Exception) -> str:
    if isinstance(e, ssl.SSLCertVerificationError) and e.verify_message:
        return str(e.verify_message)
    if isinstance(e, ssl.SSLError) and e.reason:
        return str(e.reason)
    return str(e).splitlines()[0] if str(e) else type(e).__name__


__all__: Sequence[str] = [
    "ClientAuth",
    "MeshTls",
    "TlsConfigError",
    "TlsSettings",
    "bind",
    "client_credentials",
    "dial_names",
    "load",
    "parse_settings",
    "read_client_credentials",
]
