"""Blocking HTTP(S) for the pull workers: a lean HTTP/1.1 client (`http1`, not `http.client`:
its header parsing was ~30 % of a small object's GIL time), one kept-alive connection per
host and worker thread, bodies read straight into the file's buffer (`readinto`), TLS with a CA
given as PEM content or a path, and client certificates (mTLS).

Why blocking threads rather than the daemon's aiohttp: a worker's `recv_into` and `pwrite`
release the GIL, so the workers (4 to 64 for many objects, `ObjectWorkers`; 16 for a large
object's parts) move bytes in parallel with one copy (socket -> buffer -> page cache) and no
event-loop hop per chunk; the helper's API stays async (`asyncio.to_thread`).
"""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from meshd.decisions.storage_plan import Failure, classify_status
from meshd.storage.errors import TransferError
from meshd.storage.http1 import BadRequest, Closed, Connection, IncompleteBody, ProtocolError, Reply

MAX_REDIRECTS = 5


_DEFAULT_TLS: ssl.SSLContext | None = None
_DEFAULT_TLS_LOCK = threading.Lock()


def default_tls() -> ssl.SSLContext:
    """The system CAs' context, made once (loading them costs ~0.1 s)."""
    global _DEFAULT_TLS
    with _DEFAULT_TLS_LOCK:
        if _DEFAULT_TLS is None:
            _DEFAULT_TLS = ssl.create_default_context()
        return _DEFAULT_TLS


def tls_context(ca: str | None, client_cert: str | None = None, client_key: str | None = None) -> ssl.SSLContext | None:
    """A client TLS context: None for the system CAs (made when first needed), or one trusting
    `ca` (PEM content, as ModelMesh's secret holds it, or a file path, as KServe's does:
    modelmesh-serving#460); a client certificate and key (content or paths) for mTLS.

    Kept for the process by its inputs (a path's by its size and mtime too, so a replaced file
    is read again): loading CAs costs ~50 ms of CPU, and a pull opens two stores (listing,
    download), each once per pull. Measured: with `AWS_CA_BUNDLE` set, as it often is, two
    fresh contexts were ~0.1 s of a 1.4 s pull of 1,000 small files (docs/storage.md)."""
    if not ca and not (client_cert and client_key):
        return None
    digest = hashlib.sha256()
    for part in (ca, client_cert, client_key):
        digest.update(f"{part or ''}\0{_stamp(part)}\0".encode())
    key = digest.hexdigest()  # a hash: the cache holds no key material
    with _CONTEXTS_LOCK:
        ctx = _CONTEXTS.get(key)
    if ctx is None:
        ctx = _new_tls_context(ca, client_cert, client_key)
        with _CONTEXTS_LOCK:
            if len(_CONTEXTS) >= MAX_TLS_CONTEXTS:  # many distinct secrets: start again
                _CONTEXTS.clear()
            _CONTEXTS[key] = ctx
    return ctx


def unverified_tls() -> ssl.SSLContext:
    """TLS without checking the server's certificate (`verify_ssl: "false"`): no CAs to load."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


MAX_TLS_CONTEXTS = 64
_CONTEXTS: dict[str, ssl.SSLContext] = {}
_CONTEXTS_LOCK = threading.Lock()


def _stamp(value: str | None) -> str:
    """A file's size and mtime when `value` names one (not PEM content), else ""."""
    if not value or "-----BEGIN" in value:
        return ""
    try:
        st = os.stat(value)
    except OSError:
        return "missing"  # the build below raises the error the caller reports
    return f"{st.st_size}:{st.st_mtime_ns}"


def _new_tls_context(ca: str | None, client_cert: str | None, client_key: str | None) -> ssl.SSLContext:
    if ca and "-----BEGIN" in ca:
        ctx = ssl.create_default_context(cadata=ca)
    elif ca:
        ctx = ssl.create_default_context(cafile=ca)
    else:
        ctx = ssl.create_default_context()
    if client_cert and client_key:
        if "-----BEGIN" in client_cert or "-----BEGIN" in client_key:
            # ssl loads a chain only from files: write them to a private directory for the call.
            with tempfile.TemporaryDirectory(prefix="meshd-mtls-") as tmp:
                cert_path = os.path.join(tmp, "cert.pem")
                key_path = os.path.join(tmp, "key.pem")
                for path, text in ((cert_path, client_cert), (key_path, client_key)):
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    with os.fdopen(fd, "w") as f:
                        f.write(text)
                ctx.load_cert_chain(cert_path, key_path)
        else:
            ctx.load_cert_chain(client_cert, client_key)
    return ctx


@dataclass
class Response:
    status: int
    raw: Reply
    url: str

    def header(self, name: str) -> str:
        return self.raw.header(name)

    def read_all(self) -> bytes:
        """The whole body (a listing, a token); a dropped or stalled connection is a
        `TransferError` like any other."""
        try:
            return self.raw.read()
        except TimeoutError:
            raise TransferError(Failure.TRANSIENT, "the store stopped answering mid-answer") from None
        except (OSError, ProtocolError) as e:
            raise TransferError(Failure.TRANSIENT, f"the connection dropped mid-answer: {e}") from None


@dataclass
class Transport:
    """Connections for one store (one TLS setup); `timeout_s` bounds each wait for bytes,
    so a pull times out only while it makes no progress."""

    tls: ssl.SSLContext | None = None
    timeout_s: float = 60.0
    _local: threading.local = field(default_factory=threading.local)
    _open: set[Connection] = field(default_factory=set)  # every thread's, for abort()
    _open_lock: threading.Lock = field(default_factory=threading.Lock)

    def _conn(self, scheme: str, netloc: str) -> Connection:
        pool: dict[tuple[str, str], Connection] = getattr(self._local, "pool", None) or {}
        self._local.pool = pool
        conn = pool.get((scheme, netloc))
        if conn is None:
            host, port = _host_port(netloc, 443 if scheme == "https" else 80)
            tls = (self.tls or default_tls()) if scheme == "https" else None
            conn = Connection(host, port, tls, self.timeout_s, authority=netloc)
            pool[(scheme, netloc)] = conn
            with self._open_lock:
                self._open.add(conn)
        return conn

    def _drop(self, scheme: str, netloc: str) -> None:
        pool = getattr(self._local, "pool", {})
        conn = pool.pop((scheme, netloc), None)
        if conn is not None:
            self._forget(conn)
            conn.close()

    def _forget(self, conn: Connection) -> None:
        with self._open_lock:
            self._open.discard(conn)

    def close(self) -> None:
        """Close this thread's connections."""
        for conn in getattr(self._local, "pool", {}).values():
            self._forget(conn)
            conn.close()
        self._local.pool = {}

    def abort(self) -> None:
        """From any thread: shut every open connection down, so a worker blocked reading one
        sees its end now rather than after `timeout_s` (the helper is stopping)."""
        with self._open_lock:
            conns = list(self._open)
        for conn in conns:
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed

    def request(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
        follow: bool = False,
        sign: object = None,
    ) -> Response:
        """One request; raises `TransferError` for a refused connection, a TLS failure, a
        timeout. Any HTTP status comes back (the caller classifies it). With `follow`,
        redirects are followed, the Authorization header dropped on a change of host."""
        hdrs = dict(headers or {})
        for _ in range(MAX_REDIRECTS + 1):
            parts = urlsplit(url)
            target = parts.path or "/"
            if parts.query:
                target += "?" + parts.query
            scheme, netloc = parts.scheme, parts.netloc
            if scheme not in ("http", "https"):
                raise TransferError(Failure.BAD, f"unsupported URL scheme {scheme!r}")
            for attempt in (1, 2):  # a kept-alive connection the server closed: one fresh retry
                conn = self._conn(scheme, netloc)
                try:
                    raw = conn.request(method, target, hdrs, body)
                    break
                except ssl.SSLCertVerificationError as e:
                    self._drop(scheme, netloc)
                    raise TransferError(
                        Failure.TLS, f"untrusted certificate from {netloc}: {e.verify_message}"
                    ) from None
                except ssl.SSLError as e:
                    self._drop(scheme, netloc)
                    raise TransferError(Failure.TLS, f"TLS with {netloc} failed: {e.reason or e}") from None
                except BadRequest as e:  # a header value with a line break (never sent: it would split the request)
                    self._drop(scheme, netloc)
                    raise TransferError(Failure.BAD, f"a bad request header: {e}") from None
                except (Closed, BrokenPipeError, ConnectionResetError) as e:
                    self._drop(scheme, netloc)
                    if attempt == 2:
                        raise TransferError(Failure.TRANSIENT, f"{netloc} dropped the connection: {e}") from None
                except ProtocolError as e:
                    self._drop(scheme, netloc)
                    if attempt == 2:
                        raise TransferError(Failure.TRANSIENT, f"{netloc} sent {e}") from None
                except TimeoutError:
                    self._drop(scheme, netloc)
                    raise TransferError(Failure.TRANSIENT, f"{netloc}: no answer in {self.timeout_s:g} s") from None
                except OSError as e:
                    self._drop(scheme, netloc)
                    raise TransferError(Failure.TRANSIENT, f"cannot reach {netloc}: {e.strerror or e}") from None
            if follow and raw.status in (301, 302, 303, 307, 308):
                location = raw.header("Location")
                raw.read()
                if not location:
                    raise TransferError(Failure.BAD, f"redirect from {netloc} without a Location")
                if location.startswith("/"):
                    location = f"{scheme}://{netloc}{location}"
                if urlsplit(location).netloc != netloc:
                    hdrs.pop("Authorization", None)  # a token is for its own host only
                url = location
                continue
            return Response(raw.status, raw, url)
        raise TransferError(Failure.BAD, f"more than {MAX_REDIRECTS} redirects")

    def read_into(self, resp: Response, view: memoryview, on_bytes: object = None) -> int:
        """Read the body into `view` until it is full or the body ends; the bytes read."""
        got = 0
        try:
            while got < len(view):
                try:
                    n = resp.raw.readinto(view[got:])
                except IncompleteBody:
                    if got:  # these bytes count; the next call finds the body ended (0)
                        return got
                    raise
                if not n:
                    break
                got += n
                if callable(on_bytes):
                    on_bytes(n)
        except TimeoutError:
            raise TransferError(Failure.TRANSIENT, f"no bytes for {self.timeout_s:g} s") from None
        except (ConnectionError, OSError) as e:
            raise TransferError(Failure.TRANSIENT, f"connection dropped mid-object: {e}") from None
        except ProtocolError as e:
            raise TransferError(Failure.TRANSIENT, f"a malformed body: {e}") from None
        return got

    def abandon(self, resp: Response) -> None:
        """Close the connection of a response not read to its end (it cannot carry another)."""
        parts = urlsplit(resp.url)
        self._drop(parts.scheme, parts.netloc)

    def discard(self, resp: Response) -> None:
        try:
            resp.raw.read()
        except (OSError, ProtocolError):
            pass


def _host_port(netloc: str, default: int) -> tuple[str, int]:
    """`host[:port]` (an IPv6 host in brackets) -> host, port."""
    host, port = netloc, default
    if netloc.startswith("["):
        end = netloc.find("]")
        host, rest = netloc[1:end], netloc[end + 1 :]
        if rest.startswith(":") and rest[1:].isdigit():
            port = int(rest[1:])
    elif netloc.count(":") == 1:
        name, _, num = netloc.partition(":")
        if num.isdigit():
            host, port = name, int(num)
        elif not num:
            host = name
    return host, port


def check_status(resp: Response, what: str, ok: tuple[int, ...] = (200, 206)) -> None:
    """Raise the classified `TransferError` for a status not in `ok`, with the store's own
    error code when it gives one (never its whole body: it may echo a request header)."""
    if resp.status in ok:
        return
    body = b""
    try:
        body = resp.raw.read(4096)
    except (OSError, ProtocolError):
        pass
    code = _error_code(body)
    kind = classify_status(resp.status)
    detail = f"HTTP {resp.status}" + (f" {code}" if code else "") + f" for {what}"
    raise TransferError(kind, detail)


def _error_code(body: bytes) -> str:
    text = body.decode("utf-8", "replace")
    for open_tag, close_tag in (("<Code>", "</Code>"), ('"reason": "', '"'), ('"error": "', '"')):
        start = text.find(open_tag)
        if start >= 0:
            start += len(open_tag)
            end = text.find(close_tag, start)
            if 0 < end - start < 80:
                return text[start:end]
    return ""
