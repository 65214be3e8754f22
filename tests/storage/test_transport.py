"""TLS contexts for the stores: built once per CA (loading CAs costs ~50 ms of CPU, twice a pull)."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import pytest

from meshd.storage.stores import S3Store
from meshd.storage.transport import tls_context, unverified_tls
from meshd.testing.certs import TestCA


def _subjects(ctx: ssl.SSLContext) -> set[str]:
    return {str(c.get("subject")) for c in ctx.get_ca_certs()}


def test_tls_context_is_kept_per_ca_and_rebuilt_when_its_file_changes(tmp_path: Path) -> None:
    one = TestCA(tmp_path / "one", name="one")
    two = TestCA(tmp_path / "two", name="two")
    pem = one.cert.read_text()
    assert tls_context(None) is None
    by_content = tls_context(pem)
    assert by_content is not None and tls_context(pem) is by_content
    assert "one CA" in str(_subjects(by_content))
    path = tmp_path / "ca.pem"
    path.write_text(pem)
    by_path = tls_context(str(path))
    assert by_path is not None and tls_context(str(path)) is by_path
    # The file replaced (another CA, as a rotated secret's mount): read again, trusts the new CA.
    path.write_text(two.cert.read_text())
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    rotated = tls_context(str(path))
    assert rotated is not None and rotated is not by_path
    assert "two CA" in str(_subjects(rotated)) and "one CA" not in str(_subjects(rotated))
    with pytest.raises(OSError):
        tls_context(str(tmp_path / "missing.pem"))  # the helper reports it as a bad certificate


def test_stores_share_the_ca_bundles_context(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ca = TestCA(tmp_path, name="bundle")
    monkeypatch.setenv("AWS_CA_BUNDLE", str(ca.cert))
    config = {"type": "s3", "endpoint_url": "https://127.0.0.1:9", "bucket": "b", "anonymous": "true"}
    listing, download = S3Store(config, 5), S3Store(config, 5)
    assert listing.transport.tls is not None and listing.transport.tls is download.transport.tls
    off = S3Store({**config, "verify_ssl": "false"}, 5).transport.tls
    assert off is not None and off.verify_mode == ssl.CERT_NONE and not off.check_hostname
    assert unverified_tls().get_ca_certs() == []
