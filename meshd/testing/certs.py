"""Certificates made on the spot for tests and demos: a CA, and certificates it issues
(server + client use, with DNS/IP names), written as PEM files. Needs `cryptography`
(the `dev` or `tls` extra). Short-lived keys; never for production use."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_FOR = datetime.timedelta(days=2)
CLOCK_SKEW = datetime.timedelta(hours=1)


@dataclass(frozen=True, slots=True)
class Issued:
    cert: Path  # PEM certificate (leaf only)
    key: Path  # PEM private key (PKCS8, encrypted when a passphrase was given)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path, passphrase: str | None = None) -> None:
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(passphrase.encode()) if passphrase else serialization.NoEncryption()
    )
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption))


class TestCA:
    """A self-signed CA writing its certificate to `<dir>/<name>-ca.pem`."""

    __test__ = False  # not a pytest class

    def __init__(self, directory: Path, name: str = "meshd-test") -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._subject = _name(f"{name} CA")
        self.certificate = (
            x509.CertificateBuilder()
            .subject_name(self._subject)
            .issuer_name(self._subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + VALID_FOR)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert = directory / f"{name}-ca.pem"
        self.cert.write_bytes(self.certificate.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        name: str,
        dns: tuple[str, ...] = ("localhost",),
        ips: tuple[str, ...] = ("127.0.0.1",),
        passphrase: str | None = None,
    ) -> Issued:
        """A certificate for server and client use, named `name` plus the given SANs."""
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _leaf(_name(name), key, self._subject, self._key, dns, ips)
        return _write(self.directory, name, cert, key, passphrase)


def self_signed(
    directory: Path, name: str, dns: tuple[str, ...] = ("localhost",), ips: tuple[str, ...] = ("127.0.0.1",)
) -> Issued:
    """A self-signed certificate for server and client use (its own trust anchor)."""
    key = ec.generate_private_key(ec.SECP256R1())
    return _write(directory, name, _leaf(_name(name), key, _name(name), key, dns, ips), key, None)


def _leaf(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    dns: tuple[str, ...],
    ips: tuple[str, ...],
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + VALID_FOR)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(
    directory: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, passphrase: str | None
) -> Issued:
    directory.mkdir(parents=True, exist_ok=True)
    issued = Issued(directory / f"{name}.pem", directory / f"{name}.key")
    issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, issued.key, passphrase)
    return issued


def mesh_tls_settings(
    ca: TestCA, instance: Issued, client_auth: str = "NONE", peer_name: str | None = None
) -> dict[str, str | int]:
    """`meshd serve` settings (config dest names, as LocalMesh takes them) for TLS with
    `instance`'s certificate, trusting `ca`."""
    settings: dict[str, str | int] = {
        "tls_key_cert": str(instance.cert),
        "tls_private_key": str(instance.key),
        "tls_client_auth": client_auth,
        "tls_trust_certs": str(ca.cert),
    }
    if peer_name:
        settings["tls_peer_name"] = peer_name
    return settings
