"""A lean HTTP/1.1 client connection for the stores' requests: the request written in one
send, the status line and headers parsed from the socket's bytes, the body read straight into
the caller's buffer (`readinto`), the connection kept alive between requests.

Why not `http.client`: per small object it parses the headers with the `email` package, which
was ~30 % of the time a pull worker held the GIL (1,000 x 64 KiB files, docs/storage.md), and
the workers share one GIL. Here the headers are a dict of lower-cased names, split with bytes
operations. Framing follows RFC 9112 section 6.3: no body for HEAD, 1xx, 204 and 304; chunked
when the last transfer coding says so; else Content-Length; else until the server closes.
A malformed status line or header, an oversized header or a body that ends early raise the
errors below (the transport turns them into `TransferError`s)."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Mapping

MAX_HEADER_BYTES = 64 << 10  # the status line and headers together (http.client: 64 KiB a line)
MAX_HEADERS = 100  # http.client's limit
RECV_BYTES = 64 << 10  # one read while looking for the end of the headers
NO_BODY_STATUS = (204, 304)


class ProtocolError(Exception):
    """The server's answer is not HTTP/1.x as this client reads it."""


class BadRequest(ValueError):
    """A request this client will not send: a line break in a header or the request line."""


class Closed(ConnectionError):
    """The server closed the connection before the status line (a kept-alive connection it
    timed out: the request may be sent again on a fresh one)."""


class IncompleteBody(ConnectionError):
    """The connection ended before the body's last byte."""


class Connection:
    """One kept-alive connection to `host:port`, opened when first used (TLS with `tls`);
    `authority` is the Host header sent when the caller gives none (the URL's `host[:port]`)."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None, timeout_s: float, authority: str = "") -> None:
        self.host, self.port, self.tls, self.timeout_s = host, port, tls, timeout_s
        self.authority = authority or (f"[{host}]" if ":" in host else host) + f":{port}"
        self.sock: socket.socket | None = None
        self._pending = b""  # bytes received past what has been handed out
        self._reply: Reply | None = None  # the last answer, while its body is unread

    def connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), self.timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the request goes in one send
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self._pending = b""

    def close(self) -> None:
        sock, self.sock = self.sock, None
        self._pending = b""
        self._reply = None
        if sock is not None:
            sock.close()

    def request(self, method: str, target: str, headers: Mapping[str, str], body: bytes | None = None) -> Reply:
        """Send one request and read the answer's status line and headers; the body is the
        returned `Reply`'s to read. Raises `BadRequest` for a header that would split the
        request, `Closed`, `ProtocolError`, or the socket's `OSError`s."""
        data = _request_bytes(method, target, self.authority, headers, body)
        if self._reply is not None and not self._reply.done:
            self.close()  # an unread body: the connection cannot carry another request
        if self.sock is None:
            self.connect()
        assert self.sock is not None
        self.sock.sendall(data)
        while True:
            reply = self._read_head(method == "HEAD")
            if not 100 <= reply.status < 200:  # 100 Continue and the like precede the answer
                break
        self._reply = reply
        if reply.done:
            reply._finish()
        return reply

    # ---- reading ------------------------------------------------------------------------
    def _recv(self) -> bytes:
        assert self.sock is not None
        return self.sock.recv(RECV_BYTES)

    def _read_head(self, head_only: bool) -> Reply:
        data = self._pending
        start = 0
        while True:
            end = data.find(b"\r\n\r\n", start)
            if end >= 0:
                self._pending = data[end + 4 :]
                return _parse_head(self, data[:end], head_only)
            if len(data) > MAX_HEADER_BYTES:
                raise ProtocolError(f"a response header over {MAX_HEADER_BYTES} bytes")
            more = self._recv()
            if not more:
                if not data:
                    raise Closed("closed the connection before answering")
                raise ProtocolError("closed the connection inside a response header")
            start = max(0, len(data) - 3)
            data += more

    def _readinto(self, view: memoryview) -> int:
        """Received bytes into `view` (held-back ones first); 0 when the server closed."""
        pending = self._pending
        if pending:
            n = min(len(view), len(pending))
            view[:n] = pending[:n]
            self._pending = pending[n:]
            return n
        assert self.sock is not None
        return self.sock.recv_into(view)

    def _readline(self) -> bytes:
        """One CRLF-ended line (a chunk size or trailer), without its end."""
        data = self._pending
        while True:
            end = data.find(b"\r\n")
            if end >= 0:
                self._pending = data[end + 2 :]
                return data[:end]
            if len(data) > MAX_HEADER_BYTES:
                raise ProtocolError("a chunk header over the size limit")
            more = self._recv()
            if not more:
                raise IncompleteBody("the connection ended inside a chunked body")
            data += more


class Reply:
    """An answer: `status`, `headers` (lower-cased names; repeated ones joined with ", "), and
    its body, read with `readinto` or `read`."""

    def __init__(self, conn: Connection, status: int, reason: str, headers: dict[str, str], keep_alive: bool) -> None:
        self.status, self.reason, self.headers = status, reason, headers
        self._conn = conn
        self._keep = keep_alive
        self.length = -1  # body bytes left; -1: until the server closes (or chunked)
        self.chunked = False
        self._chunk_left = 0  # chunked: bytes left in the current chunk
        self.done = False

    def header(self, name: str) -> str:
        return self.headers.get(name.lower(), "")

    def readinto(self, view: memoryview) -> int:
        """Body bytes into `view`; 0 at the body's end. Raises `IncompleteBody` when the
        connection ends before it."""
        if self.done or not len(view):
            return 0
        if self.chunked:
            return self._readinto_chunked(view)
        if self.length >= 0 and len(view) > self.length:
            view = view[: self.length]
        n = self._conn._readinto(view)
        if not n:
            if self.length > 0:
                self._conn.close()
                self.done = True
                raise IncompleteBody(f"the connection ended {self.length} bytes before the body's end")
            self._keep = False  # read until close: this was its end
            self._finish()
            return 0
        if self.length >= 0:
            self.length -= n
            if not self.length:
                self._finish()
        return n

    def _readinto_chunked(self, view: memoryview) -> int:
        conn = self._conn
        if not self._chunk_left:
            line = conn._readline()
            size = line.split(b";", 1)[0].strip()
            try:
                self._chunk_left = int(size, 16)
            except ValueError:
                raise ProtocolError(f"a malformed chunk size {size[:20]!r}") from None
            if self._chunk_left < 0:
                raise ProtocolError("a negative chunk size")
            if not self._chunk_left:  # the last chunk: trailers up to an empty line
                while conn._readline():
                    pass
                self._finish()
                return 0
        n = conn._readinto(view[: self._chunk_left])
        if not n:
            conn.close()
            self.done = True
            raise IncompleteBody("the connection ended inside a chunk")
        self._chunk_left -= n
        if not self._chunk_left and conn._readline():
            raise ProtocolError("a chunk not followed by CRLF")
        return n

    def read(self, amt: int | None = None) -> bytes:
        """Up to `amt` body bytes (all of them when None)."""
        out = bytearray()
        buf = bytearray(RECV_BYTES)
        view = memoryview(buf)
        while amt is None or len(out) < amt:
            want = len(buf) if amt is None else min(len(buf), amt - len(out))
            n = self.readinto(view[:want])
            if not n:
                break
            out += view[:n]
        return bytes(out)

    def _finish(self) -> None:
        self.done = True
        if self._conn._reply is self:
            self._conn._reply = None
        if not self._keep:
            self._conn.close()


def _request_bytes(method: str, target: str, authority: str, headers: Mapping[str, str], body: bytes | None) -> bytes:
    lines = [f"{method} {target} HTTP/1.1"]
    names = set()
    for name, value in headers.items():
        value = str(value)
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            raise BadRequest(f"the header {name!r} holds a line break or a colon")
        names.add(name.lower())
        lines.append(f"{name}: {value}")
    if "host" not in names:
        lines.append(f"Host: {authority}")
    if "accept-encoding" not in names:
        lines.append("Accept-Encoding: identity")  # the bytes as stored, as http.client asks
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    if any(" " in part or "\n" in part for part in (method, target)):
        raise BadRequest("a request line with a space or line break in its method or target")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head + body if body else head


def _parse_head(conn: Connection, head: bytes, head_only: bool) -> Reply:
    lines = head.split(b"\r\n")
    parts = lines[0].split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or len(parts[1]) != 3 or not parts[1].isdigit():
        raise ProtocolError(f"a malformed status line {lines[0][:80]!r}")
    status = int(parts[1])
    if len(lines) > MAX_HEADERS + 1:
        raise ProtocolError(f"more than {MAX_HEADERS} response headers")
    headers: dict[str, str] = {}
    last = ""
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t") and last:  # an obsolete folded line: part of the one before
            headers[last] += " " + line.strip().decode("latin-1")
            continue
        name, colon, value = line.partition(b":")
        if not colon or not name or name[-1:] in (b" ", b"\t"):
            raise ProtocolError(f"a malformed header line {line[:80]!r}")
        last = name.decode("latin-1").lower()
        text = value.strip().decode("latin-1")
        headers[last] = f"{headers[last]}, {text}" if last in headers else text
    connection = headers.get("connection", "").lower()
    keep = "close" not in connection and (parts[0] != b"HTTP/1.0" or "keep-alive" in connection)
    reply = Reply(conn, status, parts[2].decode("latin-1") if len(parts) > 2 else "", headers, keep)
    if head_only or status in NO_BODY_STATUS or 100 <= status < 200:
        reply.done = True
        return reply
    coding = headers.get("transfer-encoding", "")
    if coding:
        if coding.rsplit(",", 1)[-1].strip().lower() == "chunked":
            reply.chunked = True
        else:
            reply._keep = False  # another coding last: the body runs to the close
        return reply
    length = headers.get("content-length", "")
    if length:
        if not length.isdigit():
            raise ProtocolError(f"a malformed Content-Length {length[:40]!r}")
        reply.length = int(length)
        reply.done = reply.length == 0
    else:
        reply._keep = False  # no length: the body runs to the close
    return reply
