"""The stores' request building, held against references: SigV4 against botocore's signer,
S3 path-style and virtual-host URLs, HTTP URLs with a query; and the stores against small
servers started here: an HTTP file without a HEAD or a length, replies that do not parse."""

from __future__ import annotations

import asyncio
import datetime
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from meshd.decisions.storage import Listed, local_name, resolve
from meshd.decisions.storage_plan import Failure
from meshd.storage import StorageError, StorageHelper, StorageSettings
from meshd.storage.errors import TransferError
from meshd.storage.stores import EMPTY_SHA256, AzureStore, GCSStore, HFStore, HTTPStore, S3Store, sigv4

BODY = bytes(range(256)) * 20  # 5120 bytes


def test_sigv4_matches_botocore() -> None:
    from botocore import auth, awsrequest, credentials  # boto3's, a dev dependency

    creds = ("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "session-token")
    url = "https://127.0.0.1:9000/my-bucket/dir%20x/m%2Bodel.bin?list-type=2&prefix=a%2Fb"
    req = awsrequest.AWSRequest("GET", url, headers={"Range": "bytes=0-9"})
    auth.S3SigV4Auth(credentials.Credentials(*creds), "s3", "eu-west-1").add_auth(req)
    assert req.headers["X-Amz-Content-SHA256"] == EMPTY_SHA256
    now = datetime.datetime.strptime(req.headers["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=datetime.UTC)
    path, query = "/my-bucket/dir%20x/m%2Bodel.bin", "list-type=2&prefix=a%2Fb"
    ours = sigv4(creds, "eu-west-1", "GET", "127.0.0.1:9000", path, query, {"Range": "bytes=0-9"}, now, EMPTY_SHA256)
    assert ours["Authorization"] == req.headers["Authorization"]
    assert ours["x-amz-security-token"] == "session-token"


def test_s3_addressing_styles() -> None:
    path_style = S3Store({"bucket": "b", "endpoint_url": "http://minio:9000", "anonymous": "true"}, 5)
    assert path_style._url("dir/m x.bin") == ("minio:9000", "/b/dir/m%20x.bin", "")
    assert path_style._url("", {"prefix": "a/b", "list-type": "2"}) == ("minio:9000", "/b", "list-type=2&prefix=a%2Fb")
    virtual = S3Store({"bucket": "b", "endpoint_url": "https://s3.example.com", "virtual_host": "true"}, 5)
    assert virtual._url("m") == ("b.s3.example.com", "/m", "")
    aws = S3Store({"bucket": "b", "region": "eu-west-1"}, 5)
    assert aws._url("m") == ("b.s3.eu-west-1.amazonaws.com", "/m", "") and aws.scheme == "https"


def test_http_urls_join_the_path_and_keep_the_query() -> None:
    # upstream's e2e storageUri: https://github.com/.../mnist-svm.joblib?raw=true, which the
    # controller maps to url https://github.com?raw=true and the path in the repository
    github = HTTPStore({"url": "https://github.com?raw=true"}, 5)
    assert github._url("kserve/x/blob/main/m.joblib") == "https://github.com/kserve/x/blob/main/m.joblib?raw=true"
    signed = HTTPStore({"url": "https://h/dir/?X-Amz-Signature=abc&b=1"}, 5)
    assert signed._url("m.bin") == "https://h/dir/m.bin?X-Amz-Signature=abc&b=1"
    assert signed._url("") == "https://h/dir/?X-Amz-Signature=abc&b=1"
    assert HTTPStore({"url": "http://h:8/a/"}, 5)._url("/b c.bin") == "http://h:8/a/b%20c.bin"


def test_an_http_uri_with_a_query_keeps_it_off_the_local_name_and_the_store_name() -> None:
    src = resolve("https://h/dir/m.bin?X-Amz-Signature=s3cr3t", {}, lambda _n: None)
    assert src is not None and src.type == "http" and src.path == "dir/m.bin"
    assert local_name(src.path) == "m.bin"
    assert HTTPStore(src.config, 5)._url(src.path) == "https://h/dir/m.bin?X-Amz-Signature=s3cr3t"
    assert "s3cr3t" not in src.store


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


class _Quiet(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass


class _GetOnly(_Quiet):
    """A presigned GET URL: a HEAD is signed differently and refused."""

    def do_HEAD(self) -> None:
        self.send_response(403)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.send_header("ETag", '"e1"')
        self.end_headers()
        self.wfile.write(BODY)


class _Streamed(_Quiet):
    """A streaming server: chunked bodies, no length in the HEAD either."""

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(0, len(BODY), 1000):
            chunk = BODY[i : i + 1000]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.wfile.write(b"0\r\n\r\n")


class _Missing(_Quiet):
    def do_HEAD(self) -> None:
        self.send_response(403)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.mark.parametrize("handler", [_GetOnly, _Streamed], ids=["head-refused", "no-length"])
def test_an_http_file_is_sized_by_a_get_where_the_head_does_not_say(handler: type[_Quiet]) -> None:
    with serving(handler) as url:
        store = HTTPStore({"url": url + "?sig=x"}, 5)
        try:
            etag = "e1" if handler is _GetOnly else ""  # a strong ETag: the pull's GETs send it as If-Match
            assert store.list_objects("m.bin") == [Listed("m.bin", len(BODY), etag, etag)]
        finally:
            store.transport.close()


def test_an_http_file_the_get_refuses_too_is_the_gets_error() -> None:
    with serving(_Missing) as url, pytest.raises(TransferError) as e:
        HTTPStore({"url": url}, 5).list_objects("m.bin")
    assert e.value.kind == Failure.NOT_FOUND and "HTTP 404" in e.value.detail


@pytest.mark.parametrize("handler", [_GetOnly, _Streamed], ids=["head-refused", "no-length"])
async def test_a_pull_from_an_http_server_without_a_sized_head(tmp_path: Path, handler: type[_Quiet]) -> None:
    with serving(handler) as url:
        helper = StorageHelper(StorageSettings(tmp_path / "models", tmp_path / "config", tmp_path / "pvc"))
        await helper.start()
        try:
            key = json.dumps({"storage_params": {"type": "http", "url": url}})
            pulled = await helper.pull("m", "dir/m.bin", key)
        finally:
            await helper.close()
    assert pulled is not None and await asyncio.to_thread(Path(pulled.local_path).read_bytes) == BODY


class _Console(_Quiet):
    """A web console where the store's API was meant (MinIO's 9001 for its 9000)."""

    def do_GET(self) -> None:
        page = b"<!doctype html><html><body>Console</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.do_GET()


def _stores(url: str) -> dict[str, Callable[[], object]]:
    s3 = S3Store({"bucket": "b", "endpoint_url": url, "anonymous": "true"}, 5)
    gcs = GCSStore({"bucket": "b", "endpoint_url": url}, 5)
    azure = AzureStore({"account_name": "a", "container": "c", "endpoint_url": url}, 5)
    azure_app = AzureStore(
        {
            "account_name": "a",
            "container": "c",
            "endpoint_url": url,
            "tenant_id": "t",
            "client_id": "i",
            "client_secret": "s",
            "authority_host": url,
        },
        5,
    )
    hf = HFStore({"repo": "o/n", "endpoint_url": url}, 5)
    return {
        "s3": lambda: s3.list_objects("m"),
        "gcs": lambda: gcs.list_objects("m"),
        "azure": lambda: azure.list_objects("m"),
        "azure token": lambda: azure_app.list_objects("m"),
        "hf": lambda: hf.list_objects("m"),
    }


@pytest.mark.parametrize("store", ["s3", "gcs", "azure", "azure token", "hf"])
def test_a_reply_that_does_not_parse_is_a_transfer_error_naming_it(store: str) -> None:
    with serving(_Console) as url, pytest.raises(TransferError) as e:
        _stores(url)[store]()
    assert e.value.kind == Failure.BAD
    assert e.value.detail.startswith("cannot parse ") and "text/html" in e.value.detail


async def test_an_unparseable_listing_reaches_the_caller_as_a_storage_error(tmp_path: Path) -> None:
    with serving(_Console) as url:
        helper = StorageHelper(StorageSettings(tmp_path / "models", tmp_path / "config", tmp_path / "pvc"))
        await helper.start()
        try:
            for params in (
                {"type": "s3", "bucket": "b", "endpoint_url": url, "anonymous": "true"},
                {"type": "gcs", "bucket": "b", "endpoint_url": url},
                {"type": "azure", "account_name": "a", "container": "c", "endpoint_url": url},
            ):
                with pytest.raises(StorageError, match="cannot parse the listing of 'm'") as e:
                    await helper.pull("m", "m", json.dumps({"storage_params": params}))
                assert e.value.kind == Failure.BAD and not e.value.retryable
        finally:
            await helper.close()
