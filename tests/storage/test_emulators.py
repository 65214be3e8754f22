"""The storage helper against the stores' emulators, started here: gcp-storage-emulator (GCS's
JSON API, in-process) and Azurite (Azure Blob, npm). Each skips with its reason when the
emulator is not installed."""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import http.client
import json
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from meshd.storage import StorageError, StorageHelper
from meshd.testing import azurite as azurite_install
from meshd.testing.certs import TestCA
from meshd.testing.procs import free_port, port_open, wait_until
from tests.storage.test_helper import KIB, blob, content, settings, write_config

# Azurite's well-known development account (published in its README; not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_FLAGS = ("--silent", "--skipApiVersionCheck", "--loose")
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def put(
    url: str, path: str, body: bytes, headers: dict[str, str] | None = None, tls: ssl.SSLContext | None = None
) -> int:
    host = url.split("://", 1)[1]
    conn = (
        http.client.HTTPSConnection(host, timeout=30, context=tls)
        if url.startswith("https:")
        else http.client.HTTPConnection(host, timeout=30)
    )
    conn.request("PUT", path, body=body, headers=headers or {})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status


# ---- GCS -----------------------------------------------------------------------------


@pytest.fixture
def gcs(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from gcp_storage_emulator import server as server_mod  # a dev dependency: missing, this fails

    port = free_port()
    server = server_mod.create_server("127.0.0.1", port, in_memory=True, default_bucket="gbkt")
    server.start()
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
    try:
        yield url
    finally:
        server.stop()


async def test_gcs_folder_model_with_ranged_parts(gcs: str, tmp_path: Path) -> None:
    files = {"g/m/config.json": b"{}", "g/m/w.bin": blob(700 * KIB), "g/mx": b"not mine"}
    for name, body in files.items():
        assert put(gcs, f"/gbkt/{name}", body) == 200
    helper = StorageHelper(settings(tmp_path))
    await helper.start()
    assert await helper.predict_size("gm", "gs://gbkt/g/m", "") == 2 + 700 * KIB
    pulled = await helper.pull("gm", "gs://gbkt/g/m", "")
    assert pulled is not None and content(Path(pulled.local_path) / "w.bin") == files["g/m/w.bin"]
    assert content(Path(pulled.local_path) / "config.json") == b"{}"
    with pytest.raises(StorageError, match="no such object") as e:
        await helper.pull("gx", "gs://gbkt/absent", "")
    assert "gcs bucket gbkt" in str(e.value)


async def test_gcs_object_changed_since_it_was_listed_is_listed_again(gcs: str, tmp_path: Path) -> None:
    # This emulator ignores ifGenerationMatch: the listed md5Hash is what shows the object changed.
    assert put(gcs, "/gbkt/c/w.bin", blob(100 * KIB, 1)) == 200
    helper = StorageHelper(settings(tmp_path))
    await helper.start()
    assert await helper.predict_size("gc", "gs://gbkt/c/w.bin", "") == 100 * KIB
    assert put(gcs, "/gbkt/c/w.bin", blob(100 * KIB, 2)) == 200  # the same size, other bytes
    pulled = await helper.pull("gc", "gs://gbkt/c/w.bin", "")
    assert pulled is not None and content(pulled.local_path) == blob(100 * KIB, 2)


def test_gcs_listing_gives_the_generation_that_the_gets_send(gcs: str) -> None:
    """Each GET sends the listed generation as ifGenerationMatch (real GCS answers 412 once the
    object is another generation; this emulator ignores the parameter, so only the listing's
    generation and a GET that still succeeds with it are checked here)."""
    from meshd.storage.stores import GCSStore

    assert put(gcs, "/gbkt/g/w.bin", blob(10 * KIB)) == 200
    store = GCSStore({"bucket": "gbkt"}, 10)
    try:
        [listed] = store.list_objects("g/w.bin")
        assert listed.version.isdigit()
        sent: list[str] = []
        request = store.transport.request

        def recorded(method: str, url: str, *args: Any, **kw: Any) -> Any:
            sent.append(url)
            return request(method, url, *args, **kw)

        store.transport.request = recorded  # type: ignore[method-assign]
        resp = store.get("g/w.bin", None, listed.version)
        assert resp.status == 200 and sent[-1].endswith(f"&ifGenerationMatch={listed.version}")
        store.transport.discard(resp)
    finally:
        store.transport.close()


class TokenEndpoint:
    """An OAuth token endpoint of our own (Google's JWT-bearer grant): checks the assertion's
    RS256 signature against the service account's public key and records its claims."""

    def __init__(self, public_key: object, refuse: bool = False) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import parse_qs

        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        self.claims: list[dict[str, object]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                return

            def do_POST(self) -> None:
                form = parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
                head, body, sig = form["assertion"][0].split(".")
                pad = lambda x: base64.urlsafe_b64decode(x + "=" * (-len(x) % 4))  # noqa: E731
                public_key.verify(pad(sig), f"{head}.{body}".encode(), padding.PKCS1v15(), hashes.SHA256())  # type: ignore[attr-defined]
                owner.claims.append(json.loads(pad(body)))
                ok = form["grant_type"] == ["urn:ietf:params:oauth:grant-type:jwt-bearer"] and not refuse
                answer = {"access_token": "tok-meshd", "expires_in": 3600} if ok else {"error": "invalid_grant"}
                data = json.dumps(answer).encode()
                self.send_response(200 if ok else 400)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/token"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("refuse", [False, True])
async def test_gcs_service_account_gets_its_token_from_the_token_uri(gcs: str, tmp_path: Path, refuse: bool) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    assert put(gcs, "/gbkt/sa/w.bin", blob(700 * KIB)) == 200
    tokens = TokenEndpoint(key.public_key(), refuse)
    try:
        email = "puller@meshd-test.iam.gserviceaccount.com"
        entry = {"type": "gcs", "bucket": "gbkt", "private_key": pem, "client_email": email, "token_uri": tokens.url}
        write_config(tmp_path, "sa", entry)
        helper = StorageHelper(settings(tmp_path))
        await helper.start()
        key_json = json.dumps({"storage_key": "sa"})
        if refuse:
            with pytest.raises(StorageError, match="invalid_grant") as e:
                await helper.pull("gsa", "sa/w.bin", key_json)
            assert "PRIVATE KEY" not in str(e.value) and not (tmp_path / "models" / "gsa").exists()
            return
        pulled = await helper.pull("gsa", "sa/w.bin", key_json)
        assert pulled is not None and content(pulled.local_path) == blob(700 * KIB)
        # One token for the listing and three 256 KiB parts (the two stores the pull opened),
        # and for the next pulls with the same account, also by another helper: kept per
        # credential until near its expiry. Signed by the account's key.
        assert len(tokens.claims) == 1
        again = await StorageHelper(settings(tmp_path)).pull("gsa2", "sa/w.bin", key_json)
        assert again is not None and content(again.local_path) == blob(700 * KIB) and len(tokens.claims) == 1
        claims = tokens.claims[0]
        assert claims["iss"] == email and claims["aud"] == tokens.url and "devstorage.read_only" in str(claims["scope"])
    finally:
        tokens.stop()


# ---- Azure Blob (Azurite) ------------------------------------------------------------


@pytest.fixture
def azurite(tmp_path: Path) -> Iterator[str]:
    binary = azurite_install.find_or_install()
    if binary is None:
        pytest.skip("no node and npm here to install Azurite with (docs/storage.md)")
    port = free_port()
    where = ("--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(tmp_path / "azurite"))
    proc = subprocess.Popen(
        [str(binary), *where, *AZURITE_FLAGS],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: port_open(port), 60, "azurite listening")
        yield f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
    finally:
        proc.kill()
        proc.wait()


def _azure_put(
    endpoint: str, path: str, body: bytes, query: str = "", blob_type: bool = True, tls: ssl.SSLContext | None = None
) -> int:
    """Create a container or a block blob with Shared Key (the test's own, independent of meshd's)."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%a, %d %b %Y %H:%M:%S GMT")
    headers = {"x-ms-date": stamp, "x-ms-version": "2021-08-06", "Content-Length": str(len(body))}
    if blob_type:
        headers["x-ms-blob-type"] = "BlockBlob"
    ms = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()) if k.startswith("x-ms-"))
    resource = f"/{AZURITE_ACCOUNT}/{AZURITE_ACCOUNT}{path}"
    if query:
        resource += "".join(f"\n{k}:{v}" for k, v in sorted(p.split("=") for p in query.split("&")))
    length = str(len(body)) if body else ""
    to_sign = f"PUT\n\n\n{length}\n\n\n\n\n\n\n\n\n{ms}{resource}"
    sig = base64.b64encode(hmac.new(base64.b64decode(AZURITE_KEY), to_sign.encode(), hashlib.sha256).digest())
    headers["Authorization"] = f"SharedKey {AZURITE_ACCOUNT}:{sig.decode()}"
    return put(
        endpoint.rsplit("/", 1)[0], f"/{AZURITE_ACCOUNT}{path}" + (f"?{query}" if query else ""), body, headers, tls
    )


@pytest.mark.slow  # Azurite's first use installs it with npm (about a minute)
async def test_azure_blob_with_a_connection_string(azurite: str, tmp_path: Path) -> None:
    assert _azure_put(azurite, "/models", b"", "restype=container", blob_type=False) == 201
    data = blob(700 * KIB)
    assert _azure_put(azurite, "/models/a/m/w.bin", data) == 201
    assert _azure_put(azurite, "/models/a/m/cfg", b"cfg") == 201
    conn = (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};BlobEndpoint={azurite};"
    )
    write_config(
        tmp_path,
        "azure",
        {"type": "azure", "account_name": AZURITE_ACCOUNT, "container": "models", "connection_string": conn},
    )
    helper = StorageHelper(settings(tmp_path))
    await helper.start()
    key = json.dumps({"storage_key": "azure"})
    pulled = await helper.pull("az", "a/m", key)
    assert pulled is not None and content(Path(pulled.local_path) / "w.bin") == data
    write_config(
        tmp_path,
        "wrong",
        {
            "type": "azure",
            "account_name": AZURITE_ACCOUNT,
            "container": "models",
            "connection_string": conn.replace(AZURITE_KEY, base64.b64encode(b"x" * 64).decode()),
        },
    )
    with pytest.raises(StorageError) as e:
        await helper.pull("az2", "a/m", json.dumps({"storage_key": "wrong"}))
    assert e.value.kind == "auth" and AZURITE_KEY not in str(e.value)


@pytest.mark.slow  # Azurite
def test_azure_gets_are_refused_412_once_the_blob_is_another_than_listed(azurite: str) -> None:
    """The listed ETag goes back as If-Match (signed with Shared Key): a blob rewritten since
    the listing answers 412, whole or a range of it, so a pull lists again rather than join
    two versions (a blob uploaded in blocks lists no Content-MD5 to check instead)."""
    from meshd.decisions.storage_plan import Part
    from meshd.storage.stores import AzureStore

    assert _azure_put(azurite, "/models", b"", "restype=container", blob_type=False) == 201
    assert _azure_put(azurite, "/models/c/w.bin", blob(100 * KIB, 1)) == 201
    conn = f"AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};BlobEndpoint={azurite};"
    store = AzureStore({"container": "models", "connection_string": conn}, 10)
    try:
        [listed] = store.list_objects("c/w.bin")
        assert listed.version
        for part, ok in ((None, 200), (Part(0, 1023), 206)):
            resp = store.get("c/w.bin", part, listed.version)
            assert resp.status == ok  # the signature covers If-Match: Azurite checks it
            store.transport.discard(resp)
        assert _azure_put(azurite, "/models/c/w.bin", blob(100 * KIB, 2)) == 201  # the same size
        for part in (None, Part(0, 1023)):
            resp = store.get("c/w.bin", part, listed.version)
            assert resp.status == 412
            store.transport.discard(resp)
        [relisted] = store.list_objects("c/w.bin")
        resp = store.get("c/w.bin", None, relisted.version)
        assert relisted.version != listed.version and resp.status == 200
        store.transport.discard(resp)
    finally:
        store.transport.close()


# ---- Azure Blob with a service principal (Azurite over HTTPS, OAuth on) ---------------

# What Azurite's "basic" OAuth accepts (its BlobTokenAuthenticator): a JWT, signature not
# checked, with an Entra ID issuer, a storage audience, and nbf <= now <= exp; over HTTPS only.
ENTRA_ISSUER = "https://sts.windows.net/{tenant}/"
STORAGE_AUDIENCE = "https://storage.azure.com"
TENANT = "11111111-2222-3333-4444-555555555555"


@dataclass
class EntraAzurite:
    endpoint: str  # https://127.0.0.1:<port>/devstoreaccount1
    ca_pem: str
    tls: ssl.SSLContext  # trusts Azurite's certificate, for the test's own uploads


@pytest.fixture
def azurite_oauth(tmp_path: Path) -> Iterator[EntraAzurite]:
    binary = azurite_install.find_or_install()
    if binary is None:
        pytest.skip("no node and npm here to install Azurite with (docs/storage.md)")
    ca = TestCA(tmp_path / "ca")
    issued = ca.issue("azurite")
    port = free_port()
    where = ("--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(tmp_path / "azurite"))
    tls = ("--cert", str(issued.cert), "--key", str(issued.key), "--oauth", "basic")
    proc = subprocess.Popen(
        [str(binary), *where, *tls, *AZURITE_FLAGS], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_until(lambda: port_open(port), 60, "azurite listening")
        yield EntraAzurite(
            f"https://127.0.0.1:{port}/{AZURITE_ACCOUNT}",
            ca.cert.read_text(),
            ssl.create_default_context(cafile=str(ca.cert)),
        )
    finally:
        proc.kill()
        proc.wait()


class EntraTokens:
    """Entra ID's token endpoint for the client-credentials grant, our own: `/<tenant>/oauth2/
    v2.0/token` answers a JWT Azurite accepts when the form names the app and its secret, else
    401 `invalid_client` (Entra's answer to a wrong secret). Records each form."""

    def __init__(self, client_id: str, secret: str) -> None:
        self.forms: list[dict[str, list[str]]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                return

            def do_POST(self) -> None:
                from urllib.parse import parse_qs

                form = parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
                owner.forms.append(form)
                ok = (
                    self.path == f"/{TENANT}/oauth2/v2.0/token"
                    and form.get("grant_type") == ["client_credentials"]
                    and form.get("client_id") == [client_id]
                    and form.get("client_secret") == [secret]
                )
                answer: dict[str, object] = (
                    {"token_type": "Bearer", "expires_in": 3599, "access_token": _jwt(client_id)}
                    if ok
                    else {"error": "invalid_client", "error_description": "AADSTS7000215: Invalid client secret"}
                )
                data = json.dumps(answer).encode()
                self.send_response(200 if ok else 401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.authority = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _jwt(client_id: str) -> str:
    def b64(value: dict[str, object]) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")

    now = int(time.time())
    claims: dict[str, object] = {
        "aud": STORAGE_AUDIENCE,
        "iss": ENTRA_ISSUER.format(tenant=TENANT),
        "tid": TENANT,
        "appid": client_id,
        "nbf": now - 60,
        "iat": now - 60,
        "exp": now + 3600,
    }
    return f"{b64({'alg': 'RS256', 'typ': 'JWT'})}.{b64(claims)}.c2lnbmF0dXJlLW5vdC1jaGVja2Vk"


@pytest.mark.slow  # Azurite's first use installs it with npm (about a minute)
@pytest.mark.parametrize("secret_ok", [True, False], ids=["right-secret", "wrong-secret"])
async def test_azure_blob_with_a_service_principal(
    azurite_oauth: EntraAzurite, tmp_path: Path, secret_ok: bool
) -> None:
    """Upstream's service-principal fields: a bearer token from the tenant's token endpoint
    (client credentials, storage scope) on every request, over HTTPS with the entry's CA. The
    container is private: without the token Azurite refuses the listing, so the pull fails."""
    az = azurite_oauth
    assert _azure_put(az.endpoint, "/models", b"", "restype=container", blob_type=False, tls=az.tls) == 201
    data = blob(700 * KIB)
    assert _azure_put(az.endpoint, "/models/sp/w.bin", data, tls=az.tls) == 201
    client_id, secret = "0b5e3f1c-meshd-puller", "s3cr3t-value-from-the-secret"
    tokens = EntraTokens(client_id, secret)
    try:
        entry = {
            "type": "azure",
            "account_name": AZURITE_ACCOUNT,
            "container": "models",
            "endpoint_url": az.endpoint,
            "certificate": az.ca_pem,
            "tenant_id": TENANT,
            "client_id": client_id,
            "client_secret": secret if secret_ok else "not-the-secret",
            "authority_host": tokens.authority,
        }
        write_config(tmp_path, "sp", entry)
        write_config(tmp_path, "anon", {k: v for k, v in entry.items() if k not in ("client_id", "client_secret")})
        helper = StorageHelper(settings(tmp_path))
        await helper.start()
        with pytest.raises(StorageError) as anon:  # the same container without the app: refused
            await helper.pull("az-anon", "sp", json.dumps({"storage_key": "anon"}))
        assert anon.value.kind == "auth" and tokens.forms == []
        if not secret_ok:
            with pytest.raises(StorageError, match=r"invalid_client|401") as e:
                await helper.pull("az-sp", "sp", json.dumps({"storage_key": "sp"}))
            assert e.value.kind == "auth" and "not-the-secret" not in str(e.value)
            assert not (tmp_path / "models" / "az-sp").exists() and len(tokens.forms) == 1
            return
        pulled = await helper.pull("az-sp", "sp", json.dumps({"storage_key": "sp"}))
        assert pulled is not None and content(Path(pulled.local_path) / "w.bin") == data
        # One token for the listing and the three 256 KiB parts; the grant upstream's adapter asks.
        assert len(tokens.forms) == 1
        form = tokens.forms[0]
        assert form["grant_type"] == ["client_credentials"] and form["client_id"] == [client_id]
        assert form["scope"] == ["https://storage.azure.com/.default"]
    finally:
        tokens.stop()
