"""The object stores, each spoken over plain HTTP(S) (`transport`): list a model's objects
with their sizes, and GET an object or a byte range of it.

One HTTP stack for all of them rather than four SDKs: listing and ranged GETs are a few
requests each, S3's SigV4, Azure's Shared Key and GCS's service-account token are small, and
the pull engine controls parts, retries and buffers itself (docs/storage.md says why).
"""

from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import hmac
import json
import os
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

from meshd.decisions.storage import Listed, Source
from meshd.decisions.storage_plan import Failure, Part, token_fresh
from meshd.storage.errors import TransferError
from meshd.storage.transport import Response, Transport, check_status, tls_context, unverified_tls


class Store(Protocol):
    transport: Transport

    def list_objects(self, path: str) -> list[Listed]: ...

    def get(self, key: str, part: Part | None, version: str = "") -> Response:
        """GET the object (or `part` of it); with `version` (its `Listed.version`) the store
        answers 412 once the object is another than the one listed."""
        ...


def _flag(value: object) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def _str(config: Mapping[str, object], name: str, default: str = "") -> str:
    value = config.get(name)
    return value if isinstance(value, str) else default


class _Tokens:
    """Bearer tokens (GCS service accounts, Azure service principals) kept per credential for
    the process, so the stores a pull opens (its listing's, its download's) and the next pulls
    share one until it is near its expiry (`token_fresh`). Keyed by a hash of the secret,
    never the secret itself."""

    def __init__(self) -> None:
        self._tokens: dict[tuple[str, ...], tuple[str, float, float]] = {}  # token, fetched, expires
        self._lock = threading.Lock()  # one fetch at a time: they are rare

    def get(self, key: tuple[str, ...], fetch: Callable[[], tuple[str, float]]) -> str:
        """The cached token for `key`, or a new one from `fetch` (the token, its life in s)."""
        with self._lock:
            now = time.time()
            hit = self._tokens.get(key)
            if hit is not None and token_fresh(hit[1], hit[2], now):
                return hit[0]
            token, life = fetch()
            self._tokens[key] = (token, now, now + life)
            return token


TOKENS = _Tokens()


def _secret_id(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def open_store(source: Source, timeout_s: float) -> Store:
    c = source.config
    if source.type == "s3":
        return S3Store(c, timeout_s)
    if source.type == "http":
        return HTTPStore(c, timeout_s)
    if source.type == "gcs":
        return GCSStore(c, timeout_s)
    if source.type == "azure":
        return AzureStore(c, timeout_s)
    if source.type == "hf":
        return HFStore(c, timeout_s)
    raise TransferError(Failure.BAD, f"no store for type {source.type!r}")


def _range_headers(part: Part | None) -> dict[str, str]:
    return {"Range": part.header()} if part is not None else {}


def _if_match(version: str) -> dict[str, str]:
    """The object must still be the one listed (`Listed.version`): else 412, and the pull lists
    again, rather than join parts of two versions of a file."""
    return {"If-Match": f'"{version}"'} if version else {}


T = TypeVar("T")
# What a reply that is not the store's format raises while it is read (a web console on the
# endpoint's port answers HTML; a proxy's error page; a JSON of another shape).
PARSE_ERRORS = (ET.ParseError, ValueError, LookupError, TypeError, AttributeError)


def _parse(resp: Response, what: str, form: str, parse: Callable[[bytes], T]) -> T:
    """`parse` of the reply's body; a body that is not `form` is a `TransferError` naming
    `what` and the Content-Type it came as (never the body: it may echo a request)."""
    body = resp.read_all()
    try:
        return parse(body)
    except PARSE_ERRORS as e:
        ctype = resp.header("Content-Type") or "no Content-Type"
        raise TransferError(Failure.BAD, f"cannot parse {what}: not {form} (got {ctype}, {type(e).__name__})") from None


def _token_answer(body: bytes) -> tuple[str, float]:
    answer = json.loads(body)
    return str(answer["access_token"]), float(answer.get("expires_in", 3600))


# ---- S3 ------------------------------------------------------------------------------

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class S3Store:
    """S3 and S3-compatible stores: path-style by default for a custom endpoint (upstream's
    choice, what MinIO and Ceph expect), virtual-host with `virtual_host: "true"`; keys from
    the secret, or `anonymous: "true"`, or else the default credential chain."""

    def __init__(self, config: Mapping[str, object], timeout_s: float) -> None:
        self.bucket = _str(config, "bucket")
        self.region = _str(config, "region") or os.environ.get("AWS_REGION", "") or "us-east-1"
        endpoint = _str(config, "endpoint_url") or os.environ.get("AWS_ENDPOINT_URL_S3", "")
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL", "")
        self.virtual_host = _flag(config.get("virtual_host", "false")) or not endpoint
        if not endpoint:
            endpoint = f"https://s3.{self.region}.amazonaws.com"
        if "://" not in endpoint:
            endpoint = "https://" + endpoint
        parts = urlsplit(endpoint)
        self.scheme, self.host = parts.scheme, parts.netloc
        self.anonymous = _flag(config.get("anonymous", "false"))
        self._keys = (_str(config, "access_key_id"), _str(config, "secret_access_key"), _str(config, "session_token"))
        self._chain_lock = threading.Lock()
        ca = _str(config, "certificate") or _str(config, "ca_bundle") or os.environ.get("AWS_CA_BUNDLE", "")
        verify = str(config.get("verify_ssl", "true")).lower() not in ("0", "false", "no")
        tls = tls_context(ca or None) if verify else unverified_tls()
        self.transport = Transport(tls, timeout_s)

    def _credentials(self) -> tuple[str, str, str] | None:
        if self.anonymous:
            return None
        if self._keys[0]:
            return self._keys
        with self._chain_lock:
            return _default_chain()

    def _url(self, key: str, query: Mapping[str, str] | None = None) -> tuple[str, str, str]:
        path = "/" + quote(key, safe="/~")
        if self.virtual_host:
            host = f"{self.bucket}.{self.host}"
        else:
            host = self.host
            path = f"/{quote(self.bucket, safe='')}" + (path if key else "")
        qs = "&".join(f"{quote(k, safe='~')}={quote(v, safe='~')}" for k, v in sorted((query or {}).items()))
        return host, path, qs

    def _request(self, key: str, query: Mapping[str, str] | None, headers: dict[str, str]) -> Response:
        host, path, qs = self._url(key, query)
        headers = {**headers, "Host": host}
        creds = self._credentials()
        if creds is not None:
            headers = sigv4(creds, self.region, "GET", host, path, qs, headers)
        url = f"{self.scheme}://{host}{path}" + (f"?{qs}" if qs else "")
        return self.transport.request("GET", url, headers)

    def list_objects(self, path: str) -> list[Listed]:
        found: list[Listed] = []
        token = ""
        while True:
            query = {"list-type": "2", "prefix": path}
            if token:
                query["continuation-token"] = token
            resp = self._request("", query, {})
            what = f"the listing of {path!r}"
            check_status(resp, what, ok=(200,))
            items, more = _parse(resp, what, "S3's ListObjectsV2 XML", _s3_page)
            found.extend(items)
            if more is None:
                return found
            token = more

    def get(self, key: str, part: Part | None, version: str = "") -> Response:
        return self._request(key, None, {**_range_headers(part), **_if_match(version)})


def _s3_page(body: bytes) -> tuple[list[Listed], str | None]:
    """One ListObjectsV2 page: its objects, and the next page's token (None: the last)."""
    root = ET.fromstring(body)
    ns = root.tag.partition("}")[0] + "}" if root.tag.startswith("{") else ""
    if root.tag != f"{ns}ListBucketResult":
        raise ValueError(f"a <{root.tag[len(ns) :]}> answer")
    items = []
    for item in root.iter(f"{ns}Contents"):
        etag = item.findtext(f"{ns}ETag", "").strip('"')
        # Sent back as If-Match only in the shapes S3 gives (an MD5, or a multipart's "-N").
        version = etag if "-" in etag or len(etag) == 32 else ""
        items.append(Listed(item.findtext(f"{ns}Key", ""), int(item.findtext(f"{ns}Size", "0")), etag, version))
    if root.findtext(f"{ns}IsTruncated", "false") != "true":
        return items, None
    token = root.findtext(f"{ns}NextContinuationToken", "")
    if not token:
        raise ValueError("a truncated listing without a continuation token")
    return items, token


def _default_chain() -> tuple[str, str, str] | None:
    """AWS's default credential chain: botocore's when it is installed (IRSA, instance
    profiles, SSO, config files), else the environment's keys; None: anonymous."""
    try:
        import botocore.session  # type: ignore[import-untyped]  # optional: not a dependency of meshd
    except ImportError:
        key, secret = os.environ.get("AWS_ACCESS_KEY_ID", ""), os.environ.get("AWS_SECRET_ACCESS_KEY", "")
        return (key, secret, os.environ.get("AWS_SESSION_TOKEN", "")) if key and secret else None
    creds = botocore.session.get_session().get_credentials()
    if creds is None:
        return None
    frozen = creds.get_frozen_credentials()
    return frozen.access_key, frozen.secret_key, frozen.token or ""


def sigv4(
    creds: tuple[str, str, str],
    region: str,
    method: str,
    host: str,
    path: str,
    query: str,
    headers: dict[str, str],
    now: _dt.datetime | None = None,
    payload: str = "UNSIGNED-PAYLOAD",
) -> dict[str, str]:
    """AWS Signature Version 4 for an S3 request without a body (`path` and `query` already
    URI-encoded, the query sorted); the body unsigned, as S3 allows over any scheme."""
    now = now or _dt.datetime.now(_dt.UTC)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    day = stamp[:8]
    out = dict(headers)
    out["x-amz-date"] = stamp
    out["x-amz-content-sha256"] = payload
    if creds[2]:
        out["x-amz-security-token"] = creds[2]
    canon = {k.lower(): " ".join(str(v).split()) for k, v in out.items()}
    canon["host"] = host
    names = sorted(canon)
    canonical = "\n".join([method, path, query, *(f"{n}:{canon[n]}" for n in names), "", ";".join(names), payload])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + creds[1]).encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out["Authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={creds[0]}/{scope}, SignedHeaders={';'.join(names)}, Signature={signature}"
    )
    return out


# ---- HTTP ----------------------------------------------------------------------------

COUNT_BUFFER_BYTES = 1 << 20  # the read size while a body without a length is measured


class HTTPStore:
    """A file behind HTTP(S): GET the model path joined onto the path of `url` (its query
    kept, as upstream joins them), with the secret's headers, CA and client certificate. One
    file per model (upstream's rule). Its size from a HEAD; where the HEAD is refused (a
    presigned GET URL answers 403) or gives no length, from a GET (upstream only GETs)."""

    def __init__(self, config: Mapping[str, object], timeout_s: float) -> None:
        self.base = urlsplit(_str(config, "url"))
        self.headers: dict[str, str] = {}
        raw = config.get("headers")
        if isinstance(raw, Mapping):
            for name, value in raw.items():
                self.headers[str(name)] = ", ".join(value) if isinstance(value, list) else str(value)
        tls = tls_context(
            _str(config, "certificate") or None,
            _str(config, "client_certificate") or None,
            _str(config, "client_key") or None,
        )
        self.transport = Transport(tls, timeout_s)

    def _url(self, key: str) -> str:
        path = self.base.path
        if key.strip("/"):
            path = path.rstrip("/") + "/" + quote(key.strip("/"), safe="/~:@!$&()*+,;=")
        return urlunsplit((self.base.scheme, self.base.netloc, path, self.base.query, ""))

    def list_objects(self, path: str) -> list[Listed]:
        url = self._url(path)
        resp = self.transport.request("HEAD", url, self.headers, follow=True)
        self.transport.discard(resp)
        length = resp.header("Content-Length")
        if resp.status == 200 and length.isdigit():
            return [_web_listed(path, int(length), resp)]
        resp = self.transport.request("GET", url, self.headers, follow=True)
        check_status(resp, f"the GET of {path!r}", ok=(200,))
        length = resp.header("Content-Length")
        if length.isdigit():
            self.transport.abandon(resp)  # its size is all this GET was for
            size = int(length)
        else:
            size = self._count(resp)
        return [_web_listed(path, size, resp)]

    def _count(self, resp: Response) -> int:
        """The length of a body that does not say it (chunked, or up to the close), read to
        its end: the pull then GETs it again with its size known."""
        view = memoryview(bytearray(COUNT_BUFFER_BYTES))
        size = 0
        while n := self.transport.read_into(resp, view):
            size += n
        return size

    def get(self, key: str, part: Part | None, version: str = "") -> Response:
        headers = {**self.headers, **_range_headers(part), **_if_match(version)}
        return self.transport.request("GET", self._url(key), headers, follow=True)


def _web_listed(path: str, size: int, resp: Response) -> Listed:
    """A web server's file as its HEAD (or GET) describes it. Its ETag is sent back as If-Match
    only when strong (RFC 9110: a weak one never matches); servers that ignore If-Match on a
    GET (Python's http.server) detect nothing, which is no worse than not asking."""
    etag = resp.header("ETag")
    strong = etag.startswith('"') and etag.endswith('"') and len(etag) > 2
    return Listed(path.strip("/"), size, etag.strip('"'), etag.strip('"') if strong else "")


# ---- Hugging Face Hub ----------------------------------------------------------------


class HFStore:
    """A Hugging Face Hub model repository: the tree API lists its files with sizes, the
    resolve URLs serve them (redirected to the CDN for large files). Token from the secret's
    `token` or `HF_TOKEN`; endpoint `HF_ENDPOINT` (or the secret's `endpoint_url`)."""

    def __init__(self, config: Mapping[str, object], timeout_s: float) -> None:
        self.repo = _str(config, "repo")
        self.revision = _str(config, "revision") or "main"
        self.endpoint = (
            _str(config, "endpoint_url") or os.environ.get("HF_ENDPOINT", "") or "https://huggingface.co"
        ).rstrip("/")
        token = _str(config, "token") or os.environ.get("HF_TOKEN", "") or os.environ.get("HUGGING_FACE_HUB_TOKEN", "")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.transport = Transport(tls_context(_str(config, "certificate") or None), timeout_s)
        self._resolved: dict[str, str] = {}
        self._lock = threading.Lock()

    def list_objects(self, path: str) -> list[Listed]:
        rev = quote(self.revision, safe="")
        url = f"{self.endpoint}/api/models/{self.repo}/tree/{rev}"
        if path:
            url += "/" + quote(path.strip("/"), safe="/")
        url += "?recursive=true"
        found: list[Listed] = []
        while url:
            resp = self.transport.request("GET", url, self.headers, follow=True)
            if resp.status == 404 and path:
                self.transport.discard(resp)
                return self._single(path)
            what = f"the file list of {self.repo}@{self.revision}"
            check_status(resp, what, ok=(200,))
            found.extend(_parse(resp, what, "the Hub's JSON tree", _hf_page))
            url = _next_link(resp.header("Link"))
        return found

    def _single(self, path: str) -> list[Listed]:
        resp = self.transport.request("HEAD", self._resolve_url(path), self.headers, follow=True)
        self.transport.discard(resp)
        check_status(resp, f"{path!r} in {self.repo}@{self.revision}", ok=(200,))
        return [Listed(path.strip("/"), int(resp.header("Content-Length") or 0))]

    def _resolve_url(self, key: str) -> str:
        return f"{self.endpoint}/{self.repo}/resolve/{quote(self.revision, safe='')}/{quote(key, safe='/')}"

    def get(self, key: str, part: Part | None, version: str = "") -> Response:
        with self._lock:
            url = self._resolved.get(key)
        headers = {**self.headers, **_range_headers(part)}
        if url is not None:  # the CDN URL found by an earlier part: no token for it
            headers.pop("Authorization", None)
        resp = self.transport.request("GET", url or self._resolve_url(key), headers, follow=True)
        if url is None and resp.url != self._resolve_url(key):
            with self._lock:
                self._resolved[key] = resp.url
        return resp


def _hf_page(body: bytes) -> list[Listed]:
    items = json.loads(body)
    if not isinstance(items, list):
        raise TypeError("not a list")
    found = []
    for item in items:
        if item.get("type") == "file":
            lfs = item.get("lfs") or {}
            found.append(Listed(str(item["path"]), int(item.get("size", 0)), str(lfs.get("oid", ""))))
    return found


def _next_link(link: str) -> str:
    for item in link.split(","):
        if 'rel="next"' in item:
            return item.split(";")[0].strip().strip("<>")
    return ""


# ---- Google Cloud Storage ------------------------------------------------------------


class GCSStore:
    """GCS over its JSON API: anonymous, or a service account (`private_key` and
    `client_email`, as upstream's secret holds them) exchanged for an access token.
    `STORAGE_EMULATOR_HOST` (or the secret's `endpoint_url`) points it at an emulator."""

    def __init__(self, config: Mapping[str, object], timeout_s: float) -> None:
        self.bucket = _str(config, "bucket")
        endpoint = _str(config, "endpoint_url") or os.environ.get("STORAGE_EMULATOR_HOST", "")
        endpoint = endpoint or "https://storage.googleapis.com"
        self.endpoint = (endpoint if "://" in endpoint else "http://" + endpoint).rstrip("/")
        self.key = _str(config, "private_key")
        self.email = _str(config, "client_email")
        self.token_uri = _str(config, "token_uri") or "https://oauth2.googleapis.com/token"
        self.transport = Transport(tls_context(_str(config, "certificate") or None), timeout_s)

    def _auth(self) -> dict[str, str]:
        if not self.key:
            return {}
        token = TOKENS.get(
            ("gcs", self.token_uri, self.email, _secret_id(self.key)),
            lambda: _gcs_token(self.transport, self.email, self.key, self.token_uri),
        )
        return {"Authorization": f"Bearer {token}"}

    def list_objects(self, path: str) -> list[Listed]:
        found: list[Listed] = []
        page = ""
        while True:
            query = {"prefix": path, "fields": "items(name,size,md5Hash,generation),nextPageToken"}
            if page:
                query["pageToken"] = page
            url = f"{self.endpoint}/storage/v1/b/{quote(self.bucket, safe='')}/o?{urlencode(query)}"
            resp = self.transport.request("GET", url, self._auth())
            what = f"the listing of {path!r}"
            check_status(resp, what, ok=(200,))
            items, page = _parse(resp, what, "GCS's JSON object list", _gcs_page)
            found.extend(items)
            if not page:
                return found

    def get(self, key: str, part: Part | None, version: str = "") -> Response:
        url = f"{self.endpoint}/download/storage/v1/b/{quote(self.bucket, safe='')}/o/{quote(key, safe='')}?alt=media"
        if version:  # GCS answers 412 once the live object is another generation
            url += f"&ifGenerationMatch={quote(version, safe='')}"
        return self.transport.request("GET", url, {**self._auth(), **_range_headers(part)})


def _gcs_page(body: bytes) -> tuple[list[Listed], str]:
    """One page of a GCS object list: its objects and the next page's token ("": the last)."""
    answer = json.loads(body)
    if not isinstance(answer, dict):
        raise TypeError("not an object")
    items = []
    for item in answer.get("items", []):
        md5 = base64.b64decode(item["md5Hash"]).hex() if item.get("md5Hash") else ""
        generation = str(item.get("generation", ""))
        version = generation if generation.isdigit() else ""
        items.append(Listed(str(item["name"]), int(item.get("size", 0)), md5, version))
    return items, str(answer.get("nextPageToken", ""))


def _gcs_token(transport: Transport, email: str, key_pem: str, token_uri: str) -> tuple[str, float]:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding, rsa

    now = int(time.time())
    claims = {
        "iss": email,
        "scope": "https://www.googleapis.com/auth/devstorage.read_only",
        "aud": token_uri,
        "iat": now,
        "exp": now + 3600,
    }

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    signing = b64(json.dumps({"alg": "RS256", "typ": "JWT"}).encode()) + "." + b64(json.dumps(claims).encode())
    key = serialization.load_pem_private_key(key_pem.encode(), password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise TransferError(Failure.AUTH, "the service account's private_key is not an RSA key")
    jwt = signing + "." + b64(key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256()))
    body = urlencode({"grant_type": "urn:ietf:params:oauth:grant-type:jwt-bearer", "assertion": jwt}).encode()
    resp = transport.request("POST", token_uri, {"Content-Type": "application/x-www-form-urlencoded"}, body)
    check_status(resp, "the service account's token", ok=(200,))
    return _parse(resp, "the service account's token", "an OAuth token JSON", _token_answer)


# ---- Azure Blob ----------------------------------------------------------------------

AZURE_VERSION = "2021-08-06"


class AzureStore:
    """Azure Blob over its REST API: `https://<account>.blob.core.windows.net/<container>`, or
    the `BlobEndpoint` of a `connection_string` (Azurite); Shared Key from the connection
    string (or `account_key`), a SAS token, a service principal (`tenant_id`, `client_id`,
    `client_secret`), or anonymous."""

    def __init__(self, config: Mapping[str, object], timeout_s: float) -> None:
        self.account = _str(config, "account_name")
        self.container = _str(config, "container")
        conn = dict(item.split("=", 1) for item in _str(config, "connection_string").split(";") if "=" in item)
        self.account = conn.get("AccountName", self.account)
        self.account_key = conn.get("AccountKey", _str(config, "account_key"))
        self.sas = (conn.get("SharedAccessSignature", "") or _str(config, "sas_token")).lstrip("?")
        endpoint = conn.get("BlobEndpoint", "") or _str(config, "endpoint_url")
        if not endpoint:
            protocol = conn.get("DefaultEndpointsProtocol", "https")
            suffix = conn.get("EndpointSuffix", "core.windows.net")
            endpoint = f"{protocol}://{self.account}.blob.{suffix}"
        self.endpoint = endpoint.rstrip("/")
        self.transport = Transport(tls_context(_str(config, "certificate") or None), timeout_s)
        # Upstream's service principal (an Entra ID app): a bearer token by client credentials.
        self.app = (_str(config, "tenant_id"), _str(config, "client_id"), _str(config, "client_secret"))
        self.authority = _str(config, "authority_host") or "https://login.microsoftonline.com"

    def _bearer(self) -> str:
        tenant, client_id, secret = self.app
        url = f"{self.authority.rstrip('/')}/{quote(tenant, safe='')}/oauth2/v2.0/token"

        def fetch() -> tuple[str, float]:
            body = urlencode(
                {
                    "grant_type": "client_credentials",
                    "client_id": client_id,
                    "client_secret": secret,
                    "scope": "https://storage.azure.com/.default",
                }
            ).encode()
            resp = self.transport.request("POST", url, {"Content-Type": "application/x-www-form-urlencoded"}, body)
            check_status(resp, "the service principal's token", ok=(200,))
            return _parse(resp, "the service principal's token", "an OAuth token JSON", _token_answer)

        return TOKENS.get(("azure", url, client_id, _secret_id(secret)), fetch)

    def _request(self, path: str, query: Mapping[str, str], headers: dict[str, str]) -> Response:
        url = f"{self.endpoint}{path}"
        qs = urlencode(sorted(query.items()))
        if self.sas:
            qs = f"{qs}&{self.sas}" if qs else self.sas
        stamp = _dt.datetime.now(_dt.UTC).strftime("%a, %d %b %Y %H:%M:%S GMT")
        headers = {**headers, "x-ms-date": stamp, "x-ms-version": AZURE_VERSION}
        if self.account_key and not self.sas:
            headers["Authorization"] = self._shared_key(path, query, headers)
        elif all(self.app) and not self.sas:
            headers["Authorization"] = f"Bearer {self._bearer()}"
        return self.transport.request("GET", url + (f"?{qs}" if qs else ""), headers)

    def _shared_key(self, path: str, query: Mapping[str, str], headers: Mapping[str, str]) -> str:
        ms = sorted((k.lower(), v) for k, v in headers.items() if k.lower().startswith("x-ms-"))
        resource = f"/{self.account}{urlsplit(self.endpoint).path}{path}"
        resource += "".join(f"\n{k.lower()}:{v}" for k, v in sorted(query.items()))
        fields = ["GET", "", "", "", "", "", "", "", headers.get("If-Match", ""), "", "", headers.get("Range", "")]
        to_sign = "\n".join([*fields, *(f"{k}:{v}" for k, v in ms), resource])
        digest = hmac.new(base64.b64decode(self.account_key), to_sign.encode(), hashlib.sha256).digest()
        return f"SharedKey {self.account}:{base64.b64encode(digest).decode()}"

    def list_objects(self, path: str) -> list[Listed]:
        found: list[Listed] = []
        marker = ""
        while True:
            query = {"restype": "container", "comp": "list", "prefix": path}
            if marker:
                query["marker"] = marker
            resp = self._request(f"/{quote(self.container, safe='')}", query, {})
            what = f"the listing of {path!r}"
            check_status(resp, what, ok=(200,))
            items, marker = _parse(resp, what, "Azure's List Blobs XML", _azure_page)
            found.extend(items)
            if not marker:
                return found

    def get(self, key: str, part: Part | None, version: str = "") -> Response:
        path = f"/{quote(self.container, safe='')}/{quote(key, safe='/~')}"
        return self._request(path, {}, {**_range_headers(part), **_if_match(version)})


def _azure_page(body: bytes) -> tuple[list[Listed], str]:
    """One List Blobs page: its blobs and the next page's marker ("": the last)."""
    root = ET.fromstring(body)
    if root.tag != "EnumerationResults":
        raise ValueError(f"a <{root.tag}> answer")
    items = []
    for blob in root.iter("Blob"):
        props = blob.find("Properties")
        size = props.findtext("Content-Length", "0") if props is not None else "0"
        md5 = props.findtext("Content-MD5", "") if props is not None else ""
        etag = (props.findtext("Etag", "") if props is not None else "").strip('"')
        items.append(Listed(blob.findtext("Name", ""), int(size), base64.b64decode(md5).hex() if md5 else "", etag))
    return items, root.findtext("NextMarker", "") or ""
