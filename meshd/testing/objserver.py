"""A small object server for the storage helper's tests and `bench/pull.py`: serves the files
under a directory over HTTP(S), with byte ranges sent zero-copy (`os.sendfile`).

It speaks just enough of three protocols, with the URL path as the file's path:
- plain HTTP: `GET`/`HEAD /<path>` (Range, ETag = the file's MD5 for small files);
- S3 (path-style): `GET /<bucket>?list-type=2&prefix=P` lists, `GET /<bucket>/<key>` reads;
  the signature is not checked, but `access_key` makes it refuse other keys (403
  InvalidAccessKeyId) and requests without one;
- Hugging Face Hub: `GET /api/models/<org>/<name>/tree/<rev>?recursive=true` lists,
  `/<org>/<name>/resolve/<rev>/<path>` redirects to `/cdn/<org>/<name>/<path>`.

Faults on demand: `drop_after` (close the connection after that many body bytes, for the next
`drops` GETs; with `hang_s`, go silent that long first), `fail_status` (answer the next `fails`
GETs with that status), `rate` (bytes/s), `latency_s` (a wait before each answer: a remote
store's time to the first byte).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit
from xml.sax.saxutils import escape

MD5_LIMIT = 64 << 20  # ETag = MD5 only for files up to this size (S3 single-part objects)


@dataclass
class Faults:
    drop_after: int = -1
    drops: int = 0
    fail_status: int = 0
    fails: int = 0
    rate: float = 0.0  # bytes per second per GET (0: no limit)
    hang_s: float = 0.0  # at drop_after: go silent this long instead of closing (a stalled store)
    latency_s: float = 0.0  # before each answer (a remote store's time to the first byte)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take_drop(self) -> int:
        with self.lock:
            if self.drops > 0:
                self.drops -= 1
                return self.drop_after
        return -1

    def take_fail(self) -> int:
        with self.lock:
            if self.fails > 0:
                self.fails -= 1
                return self.fail_status
        return 0


class ObjectServer:
    """Serves `root` on 127.0.0.1; `url` is where. Start with `start()`, stop with `stop()`."""

    def __init__(
        self,
        root: Path,
        tls: ssl.SSLContext | None = None,
        access_key: str = "",
        etag_md5: bool = True,
    ) -> None:
        self.root = root.resolve()
        self.faults = Faults()
        self.access_key = access_key
        self.etag_md5 = etag_md5
        self.redirect_base = ""  # where Hugging Face resolve URLs redirect ("": this server)
        self.requests: list[tuple[str, str, str]] = []  # (method, path, range)
        self.headers_seen: list[dict[str, str]] = []
        self.md5s: dict[tuple[str, int, int], str] = {}  # ETags already computed
        self._lock = threading.Lock()
        server = self

        class Handler(_Handler):
            owner = server

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> ObjectServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> ObjectServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def gets(self) -> list[tuple[str, str, str]]:
        """The GETs of object bytes (not listings, not redirects)."""
        with self._lock:
            return [
                r
                for r in self.requests
                if r[0] == "GET" and "list-type=" not in r[1] and "/api/" not in r[1] and "/resolve/" not in r[1]
            ]


class _Server(ThreadingHTTPServer):
    # socketserver's listen backlog is 5: a client opening dozens of connections at once (s5cmd,
    # meshd's object workers) overflowed it, and each dropped SYN cost a retransmit of 1, 3, 7
    # or 15 s, so a few bench runs took 2-30 s whatever the tool.
    request_queue_size = 1024


class _Handler(BaseHTTPRequestHandler):
    owner: ObjectServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go as separate writes: no 40 ms delayed-ACK stall

    def log_message(self, format: str, *args: object) -> None:  # quiet
        return

    def _send(
        self, status: int, body: bytes, ctype: str = "application/xml", extra: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str) -> None:
        self._send(status, f"<Error><Code>{code}</Code><Message>{code}</Message></Error>".encode())

    def _record(self) -> None:
        o = self.owner
        with o._lock:
            o.requests.append((self.command, self.path, self.headers.get("Range", "")))
            o.headers_seen.append(dict(self.headers.items()))

    def do_HEAD(self) -> None:
        self._record()
        self._serve(head=True)

    def do_GET(self) -> None:
        self._record()
        self._serve(head=False)

    def _authorised(self) -> bool:
        key = self.owner.access_key
        if not key:
            return True
        auth = self.headers.get("Authorization", "")
        return f"Credential={key}/" in auth

    def _serve(self, head: bool) -> None:
        o = self.owner
        parts = urlsplit(self.path)
        query = parse_qs(parts.query)
        path = unquote(parts.path)
        if o.faults.latency_s:
            time.sleep(o.faults.latency_s)
        if not self._authorised():
            self._error(403, "InvalidAccessKeyId")
            return
        status = o.faults.take_fail() if not head else 0
        if status:
            self._error(status, "InjectedFault")
            return
        if path.startswith("/api/models/"):
            self._hf_tree(path[len("/api/models/") :])
            return
        if "/resolve/" in path:
            repo, _, rest = path.lstrip("/").partition("/resolve/")
            _rev, _, inner = rest.partition("/")
            self.send_response(302)
            self.send_header("Location", f"{self.owner.redirect_base}/cdn/{repo}/{quote(inner)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if path.startswith("/cdn/"):
            path = path[len("/cdn") :]
        if head and path.strip("/") and "/" not in path.strip("/") and (o.root / path.strip("/")).is_dir():
            self._send(200, b"")  # HeadBucket
            return
        if "list-type" in query:
            self._list(path.strip("/"), query.get("prefix", [""])[0])
            return
        target = (o.root / path.lstrip("/")).resolve()
        if not str(target).startswith(str(o.root) + "/") or not target.is_file():
            if (o.root / path.strip("/").split("/")[0]).is_dir() or path.count("/") <= 1:
                self._error(404, "NoSuchKey")
            else:
                self._error(404, "NoSuchBucket")
            return
        self._file(target, head)

    def _etag(self, target: Path, size: int) -> str:
        st = target.stat()
        if not (self.owner.etag_md5 and size <= MD5_LIMIT):
            return f"{st.st_ino:x}{st.st_mtime_ns:x}-1"
        o = self.owner
        key = (str(target), st.st_mtime_ns, size)
        with o._lock:
            known = o.md5s.get(key)
        if known is None:
            known = hashlib.md5(target.read_bytes(), usedforsecurity=False).hexdigest()
            with o._lock:
                o.md5s[key] = known
        return known

    def _file(self, target: Path, head: bool) -> None:
        size = target.stat().st_size
        start, end = 0, size - 1
        ranged = self.headers.get("Range", "")
        status = 200
        if ranged.startswith("bytes="):
            a, _, b = ranged[6:].partition("-")
            start = int(a)
            end = min(int(b), size - 1) if b else size - 1
            if start > end:
                self._error(416, "InvalidRange")
                return
            status = 206
        etag = self._etag(target, size)
        match = self.headers.get("If-Match", "")
        if match and match.strip('"') != etag:
            self._error(412, "PreconditionFailed")
            return
        length = end - start + 1
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{etag}"')
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if head:
            return
        self.wfile.flush()
        drop = self.owner.faults.take_drop()
        rate = self.owner.faults.rate
        with open(target, "rb") as f:
            sent = 0
            while sent < length:
                chunk = length - sent
                if drop >= 0:
                    chunk = min(chunk, drop - sent)
                    if chunk <= 0:
                        if self.owner.faults.hang_s:
                            time.sleep(self.owner.faults.hang_s)
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                if rate:
                    chunk = min(chunk, max(1, int(rate / 20)))
                n = self._sendfile(f, start + sent, chunk)
                if n <= 0:
                    return
                sent += n
                if rate:
                    time.sleep(n / rate)

    def _sendfile(self, f: object, offset: int, count: int) -> int:
        sock = self.connection
        if isinstance(sock, ssl.SSLSocket):  # no zero-copy through TLS
            assert hasattr(f, "seek") and hasattr(f, "read")
            f.seek(offset)
            data = f.read(min(count, 1 << 20))
            sock.sendall(data)
            return len(data)
        try:
            return os.sendfile(sock.fileno(), f.fileno(), offset, count)  # type: ignore[attr-defined]
        except (BrokenPipeError, ConnectionResetError):
            return -1

    def _list(self, bucket: str, prefix: str) -> None:
        base = self.owner.root / bucket
        if not base.is_dir():
            self._error(404, "NoSuchBucket")
            return
        items = []
        for p in sorted(base.rglob("*")):
            if p.is_file():
                key = p.relative_to(base).as_posix()
                if key.startswith(prefix):
                    size = p.stat().st_size
                    items.append(
                        f"<Contents><Key>{escape(key)}</Key><Size>{size}</Size>"
                        f"<ETag>&quot;{self._etag(p, size)}&quot;</ETag></Contents>"
                    )
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix><IsTruncated>false</IsTruncated>"
            + "".join(items)
            + "</ListBucketResult>"
        )
        self._send(200, body.encode())

    def _hf_tree(self, rest: str) -> None:
        # <org>/<name>/tree/<rev>[/<path>]
        repo, _, tail = rest.partition("/tree/")
        _rev, _, inner = tail.partition("/")
        base = self.owner.root / repo
        start = base / inner if inner else base
        if not base.is_dir() or not start.exists():
            self._send(404, b'{"error": "Repository not found"}', "application/json")
            return
        entries = []
        for p in sorted(start.rglob("*")) if start.is_dir() else [start]:
            if p.is_file():
                entries.append({"type": "file", "path": p.relative_to(base).as_posix(), "size": p.stat().st_size})
        self._send(200, json.dumps(entries).encode(), "application/json")


def main(argv: list[str] | None = None) -> None:
    """`python -m meshd.testing.objserver ROOT [--rate BYTES_PER_S] [--latency-ms MS]`: serve
    ROOT on a free port until killed; prints the URL. `--rate` caps each GET (a store whose
    per-connection throughput is the limit); `--latency-ms` delays each answer (a remote
    store's time to the first byte)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m meshd.testing.objserver")
    ap.add_argument("root", type=Path)
    ap.add_argument("--rate", type=float, default=0.0, help="bytes/s per GET (0: no limit)")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="wait before each answer (ms)")
    args = ap.parse_args(argv)
    server = ObjectServer(args.root)
    server.faults.rate = args.rate
    server.faults.latency_s = args.latency_ms / 1000
    print(server.url, flush=True)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
