"""The pull's HTTP/1.1 reader (`meshd.storage.http1`) against a socket server that sends
exactly the bytes each test gives: framing (Content-Length, chunked, until close), keep-alive
reuse, and each malformed or cut-short answer a clear error, through the transport too."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from meshd.decisions.storage_plan import Failure
from meshd.storage.errors import TransferError
from meshd.storage.http1 import MAX_HEADER_BYTES, Connection, IncompleteBody, ProtocolError
from meshd.storage.transport import Transport, _host_port


class Canned:
    """Answers each request (read up to its blank line) with the next of `answers`: (bytes,
    close the connection after them). Counts connections and keeps the requests."""

    def __init__(self, answers: list[tuple[bytes, bool]]) -> None:
        self.answers = list(answers)
        self.requests: list[bytes] = []
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while self.answers:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                data = b""
                while self.answers:
                    while b"\r\n\r\n" not in data:
                        more = conn.recv(65536)
                        if not more:
                            break
                        data += more
                    if b"\r\n\r\n" not in data:
                        break  # the client closed this connection
                    head, _, data = data.partition(b"\r\n\r\n")
                    self.requests.append(head)
                    answer, close = self.answers.pop(0)
                    conn.sendall(answer)
                    if close:
                        conn.shutdown(socket.SHUT_WR)
                        break

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() (close alone does not)
        except OSError:
            pass
        self.sock.close()
        self._thread.join(5)


@contextmanager
def canned(*answers: tuple[bytes, bool]) -> Iterator[Canned]:
    srv = Canned(list(answers))
    try:
        yield srv
    finally:
        srv.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n" % (len(body), extra) + body


def test_content_length_bodies_reuse_one_connection() -> None:
    with canned((ok(b"a" * 100_000, b'ETag: "x"\r\nX-Two: 1\r\nx-two: 2\r\n'), False), (ok(b"bc"), False)) as srv:
        conn = Connection("127.0.0.1", srv.port, None, 5)
        reply = conn.request("GET", "/one", {"Range": "bytes=0-"})
        assert reply.status == 200 and reply.header("etag") == '"x"' and reply.header("X-Two") == "1, 2"
        assert reply.read() == b"a" * 100_000 and reply.done
        assert conn.request("GET", "/two", {}).read() == b"bc"
        conn.close()
    assert srv.connections == 1
    first = srv.requests[0].decode()
    assert first.startswith("GET /one HTTP/1.1\r\n") and "Range: bytes=0-" in first
    assert f"Host: 127.0.0.1:{srv.port}" in first and "Accept-Encoding: identity" in first


def test_chunked_body_with_trailers_then_the_next_request() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nT: 1\r\n\r\n"
    )
    with canned((chunked, False), (ok(b"next"), False)) as srv:
        conn = Connection("127.0.0.1", srv.port, None, 5)
        assert conn.request("GET", "/", {}).read() == b"hello world"
        assert conn.request("GET", "/", {}).read() == b"next"
        conn.close()
    assert srv.connections == 1


def test_no_length_reads_to_the_close_and_100_continue_and_head_have_no_body() -> None:
    continued = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.0 200 OK\r\n\r\nall of it"
    with canned((b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", False), (continued, True)) as srv:
        conn = Connection("127.0.0.1", srv.port, None, 5)
        head = conn.request("HEAD", "/", {})
        assert head.done and head.header("content-length") == "9" and head.read() == b""
        assert conn.request("GET", "/", {}).read() == b"all of it"
        assert conn.sock is None  # read to the close: not kept
    assert srv.connections == 1


def test_truncated_body_is_an_error_after_the_bytes_that_came() -> None:
    with canned((b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 40, True)) as srv:
        conn = Connection("127.0.0.1", srv.port, None, 5)
        reply = conn.request("GET", "/", {})
        buf = memoryview(bytearray(100))
        got = 0
        with pytest.raises(IncompleteBody, match="60 bytes before the body's end"):
            while True:
                got += reply.readinto(buf[got:])
        assert got == 40 and conn.sock is None


def test_the_transport_counts_a_cut_body_and_then_reports_its_end() -> None:
    with canned((b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 40, True)) as srv:
        transport = Transport(None, 5)
        resp = transport.request("GET", f"http://127.0.0.1:{srv.port}/o")
        view = memoryview(bytearray(100))
        assert transport.read_into(resp, view) == 40  # what came is written (a retry resumes after it)
        assert transport.read_into(resp, view[40:]) == 0  # the caller's "dropped mid-object"
        transport.close()
    with canned((b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 40, True)) as srv:
        transport = Transport(None, 5)
        resp = transport.request("GET", f"http://127.0.0.1:{srv.port}/list")
        with pytest.raises(TransferError, match="dropped mid-answer") as e:
            resp.read_all()
        assert e.value.kind == Failure.TRANSIENT
        transport.close()


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"HTTX/1.1 200 OK\r\n\r\n", "malformed status line"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "malformed status line"),
        (b"garbage\r\n\r\n", "malformed status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 12x\r\n\r\n", "malformed Content-Length"),
        (b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 10), "header over 65536 bytes"),
        (b"HTTP/1.1 200 OK\r\n" + b"X: 1\r\n" * 101 + b"\r\n", "more than 100 response headers"),
        (b"HTTP/1.1 200 OK\r\nContent-Le", "closed the connection inside a response header"),
    ],
    ids=["protocol", "status", "garbage", "header", "length", "oversized", "many", "cut-header"],
)
def test_malformed_answers_are_clear_errors(answer: bytes, error: str) -> None:
    with canned((answer, True)) as srv:
        with pytest.raises(ProtocolError, match=error):
            Connection("127.0.0.1", srv.port, None, 5).request("GET", "/", {})
    # Through the transport: retried once on a fresh connection, then a retryable TransferError.
    with canned((answer, True), (answer, True)) as srv:
        transport = Transport(None, 5)
        with pytest.raises(TransferError, match=error) as e:
            transport.request("GET", f"http://127.0.0.1:{srv.port}/o")
        assert e.value.kind == Failure.TRANSIENT
        transport.close()


def test_a_bad_chunk_size_is_a_clear_error() -> None:
    with canned((b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n", True)) as srv:
        reply = Connection("127.0.0.1", srv.port, None, 5).request("GET", "/", {})
        with pytest.raises(ProtocolError, match="malformed chunk size"):
            reply.read()


def test_a_kept_alive_connection_the_server_closed_is_retried_fresh() -> None:
    # The first answer keeps the connection by its headers, but the server closes it after.
    with canned((ok(b"one"), True), (ok(b"two"), False)) as srv:
        transport = Transport(None, 5)
        url = f"http://127.0.0.1:{srv.port}/o"
        assert transport.request("GET", url).read_all() == b"one"
        assert transport.request("GET", url).read_all() == b"two"
        transport.close()
    assert srv.connections == 2


def test_a_header_with_a_line_break_is_never_sent() -> None:
    with canned((ok(b""), False)) as srv:
        transport = Transport(None, 5)
        with pytest.raises(TransferError, match="holds a line break") as e:
            transport.request("GET", f"http://127.0.0.1:{srv.port}/o", {"X-Token": "a\r\nInjected: 1"})
        assert e.value.kind == Failure.BAD and "Injected" not in str(e.value)
        transport.close()
    assert srv.requests == []


def test_host_and_port_from_the_url() -> None:
    assert _host_port("[::1]:9000", 80) == ("::1", 9000)
    assert _host_port("[::1]", 443) == ("::1", 443)
    assert _host_port("s3.example.com", 443) == ("s3.example.com", 443)
    assert _host_port("minio:9000", 80) == ("minio", 9000)
