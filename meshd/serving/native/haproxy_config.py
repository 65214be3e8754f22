"""HAProxy's configuration for the native data plane, and its table dumps read back (pure).

The frontend takes the external gRPC port. A request goes to the local runtime when its
method is in the methods map and the model it names by `mm-model-id` (or `mm-vmodel-id`,
resolved through the vmodels map) is in the local map; to a peer's native port when the
peers map names a peer slot for it (never for a request that already came from a peer:
one native hop at most); otherwise to meshd's Python path, which stays complete. Anything
the Python path would judge (a `-bin` id, both ids, several ids, `mm-balanced`) goes to it.

Every native backend keeps meshd's Python path as a backup server: a runtime or peer that
refuses the connection is marked down on that first error and the request (nothing of it
sent yet) is redispatched to the Python path, which reroutes as it always does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import grpc

from meshd.core import hostport

LOCAL_BACKEND = "be_local"
PYTHON_BACKEND = "be_python"
PEER_BACKEND = "be_peer_"  # + slot number
COUNTERS_TABLE = "st_local"
# Requests that arrived from a client (not a native hop) and were carried natively, here or to
# a peer: the load queue's popularity, which the Python path counts for the others (Router).
ARRIVALS_TABLE = "st_arrived"
PLAIN = "plain"  # methods map values: the body is the runtime's as it is
ID_IN_FIELD_1 = "id1"  # the runtime wants the model id in field 1: carried when the body has it there
HOP_HEADER = "meshd-native-hop"  # set on a native hop to a peer; meshd- headers never reach a runtime
MAX_KEY_CHARS = 250  # the counters table's key length is 256
TABLE_KEY_LEN = 256

# Keys HAProxy's map files and runtime API take verbatim: printable ASCII without spaces,
# without ';' (the runtime API's command separator), '\\' or a leading '#'. Other ids simply
# stay on the Python path.
_SAFE_KEY = re.compile(r"[!-~]+")


def map_key_ok(key: str) -> bool:
    return (
        0 < len(key) <= MAX_KEY_CHARS
        and _SAFE_KEY.fullmatch(key) is not None
        and ";" not in key
        and "\\" not in key
        and not key.startswith("#")
    )


def haproxy_address(endpoint: str) -> str:
    """A grpc target (`host:port`, `unix:/path`, `unix:///path`) as an HAProxy server address."""
    if endpoint.startswith("unix://"):
        return "unix@" + endpoint[len("unix://") :]
    if endpoint.startswith("unix:"):
        return "unix@" + endpoint[len("unix:") :]
    try:
        host, port = hostport.split(endpoint)
    except ValueError:
        return endpoint
    # HAProxy reads an IPv6 server address with the `ipv6@` prefix and the last colon as the port.
    return f"ipv6@{host}:{port}" if hostport.is_ipv6(host) else endpoint


def haproxy_listen(port: int, dual_stack: bool) -> str:
    """The external port's `bind` address: `:::port v4v6` (IPv6 and IPv4 on one socket) where
    the host has IPv6, else `0.0.0.0:port`."""
    return f":::{port} v4v6" if dual_stack else f"0.0.0.0:{port}"


@dataclass(frozen=True)
class TlsFiles:
    """TLS on the native ports, as files HAProxy reads (the plane writes them)."""

    cert_key: str  # PEM: the chain, then the private key
    client_trust: str | None  # verify clients against this bundle (MM_TLS_CLIENT_AUTH=REQUIRE)
    peer_trust: str  # what a peer's native port must present a chain to


@dataclass(frozen=True)
class Layout:
    listen: str  # ":::8033 v4v6" or "0.0.0.0:8033": the external gRPC port
    python: str  # meshd's Python path, on loopback
    runtime: str  # the runtime's inference endpoint, an HAProxy address
    api_socket: str
    methods_map: str
    local_map: str
    peers_map: str
    vmodels_map: str
    peer_slots: int = 16
    threads: int = 1
    tls: TlsFiles | None = None
    # MESHD_REQUEST_TIMEOUT_MS is set: a call without a deadline takes the Python path, which
    # gives it that one (and says so when it expires).
    deadline_required: bool = False
    # A unix datagram socket meshd reads: one line per request carried natively, for the
    # per-call metrics and the invoke log (None: no per-call record, metrics and log are off).
    log_socket: str | None = None
    # MM_SVC_GRPC_MAX_HEADERS_SIZE: requests with headers anywhere near it take the Python path,
    # which enforces it exactly (HAProxy measures headers in its own way).
    max_headers_bytes: int = 8 << 10
    max_message_bytes: int = 16 << 20  # MM_SVC_GRPC_MAX_MSG_SIZE: larger requests take the Python path
    # Each request on a server connection of its own (`max-reuse 0`): for an HAProxy whose
    # HTTP/2 backend resets a busy connection on trailers (see trailers_reset_bug).
    request_per_connection: bool = False


_VERSION = re.compile(r"HA-?Proxy version (\d+)\.(\d+)(?:\.(\d+))?")
# The first release of each branch without the bug (upstream commit 682f73b, HAProxy issue
# #2388): 2.9.1, and 3.0 onwards. Later 2.4-2.8 releases carry a backport, but which is not known
# here, so every 2.8 and older counts as having it: safe, at the cost of connection reuse.
TRAILERS_FIXED_IN = (2, 9, 1)


def trailers_reset_bug(version_line: str) -> bool:
    """Whether this HAProxy (its `haproxy -v` first line) resets a whole HTTP/2 server connection,
    with every stream on it, when a response's trailers arrive while that stream still holds
    data the client has not taken and the connection's receive buffer is full: gRPC responses
    always end in trailers, so a runtime answering many large responses at once on one
    connection loses some of them ("Stream removed", RST_STREAM 7). Unknown versions: yes."""
    m = _VERSION.search(version_line)
    if m is None:
        return True
    version = (int(m[1]), int(m[2]), int(m[3] or 0))
    return version < TRAILERS_FIXED_IN


# A vmodel resolved by the frontend reaches the runtime (or the peer) as its concrete model, as
# on the Python path; only in the native backends, so the Python path still sees the vmodel.
VMODEL_AS_MODEL = (
    "  http-request set-header mm-model-id %[var(txn.mid)] if { var(txn.vmid) -m found }",
    "  http-request del-header mm-vmodel-id if { var(txn.vmid) -m found }",
)


def _peer_ssl(tls: TlsFiles | None) -> str:
    if tls is None:
        return ""
    return f" ssl verify required ca-file {tls.peer_trust} crt {tls.cert_key} alpn h2"


def render(layout: Layout) -> str:
    """The whole configuration file."""
    bind_tls = ""
    if layout.tls is not None:
        bind_tls = f" ssl crt {layout.tls.cert_key} alpn h2"
        if layout.tls.client_trust is not None:
            bind_tls += f" ca-file {layout.tls.client_trust} verify required"
    else:
        bind_tls = " proto h2"
    # HTTP/2 to every server; without connection reuse where this HAProxy needs it.
    h2 = "proto h2 max-reuse 0" if layout.request_per_connection else "proto h2"
    python = f"server py {layout.python} {h2}"
    lines = [
        "global",
        f"  stats socket {layout.api_socket} mode 600 level admin",
        f"  nbthread {layout.threads}",
        "  maxconn 8000",
        "  noreuseport",  # a taken port fails start-up, as the Python path does (issue 16)
        *([f"  log unix@{layout.log_socket} len 2048 format raw local0 info"] if layout.log_socket else []),
        # 64 KiB buffers (default 16): a 1 MiB request cost HAProxy + meshd 3.9 ms of CPU with
        # 16 KiB, 1.4 ms with 64 KiB, no less with 128 KiB (bench/proxy_overhead.py, this machine).
        # The per-stream window stays HAProxy's default (64 KiB): a 1 MiB window let 64 clients'
        # 1 MiB uploads overrun the stream buffers and stall HAProxy's HTTP/2 demultiplexer for
        # good (tests/integration/test_native.py holds that case).
        "  tune.bufsize 65536",
        "defaults",
        "  mode http",
        *(["  log global"] if layout.log_socket else []),
        "  timeout connect 1s",
        # gRPC streams may stay open and quiet for long: the client and deadlines end them.
        "  timeout client 1d",
        "  timeout server 1d",
        "  timeout tunnel 1d",
        "  timeout http-request 1d",
        "frontend grpc",
        f"  bind {layout.listen}{bind_tls}",
        *([f'  log-format "{LOG_FORMAT}"'] if layout.log_socket else []),
        f"  acl native_method path,map({layout.methods_map}) -m found",
        f"  acl id_in_body path,map({layout.methods_map}) -m str {ID_IN_FIELD_1}",
        "  acl one_model req.hdr_cnt(mm-model-id) eq 1",
        "  acl one_vmodel req.hdr_cnt(mm-vmodel-id) eq 1",
        "  acl no_model req.hdr_cnt(mm-model-id) eq 0",
        "  acl no_vmodel req.hdr_cnt(mm-vmodel-id) eq 0",
        "  acl python_judges req.hdr_cnt(mm-model-id-bin) gt 0",
        "  acl python_judges req.hdr_cnt(mm-vmodel-id-bin) gt 0",
        "  acl python_judges req.hdr_cnt(mm-balanced) gt 0",
        f"  acl from_peer req.hdr_cnt({HOP_HEADER}) gt 0",
        f"  acl python_judges req.hdrs,length gt {layout.max_headers_bytes // 2}",
        *(["  acl python_judges req.hdr_cnt(grpc-timeout) eq 0"] if layout.deadline_required else []),
        "  http-request set-var(txn.mid) req.fhdr(mm-model-id) if native_method one_model no_vmodel !python_judges",
        *(["  http-request set-var(txn.path) path"] if layout.log_socket else []),
        f"  http-request set-var(txn.mid) req.fhdr(mm-vmodel-id),map({layout.vmodels_map})"
        " if native_method one_vmodel no_model !python_judges",
        "  http-request set-var(txn.vmid) req.fhdr(mm-vmodel-id) if one_vmodel { var(txn.mid) -m found }",
        # The (unary) body's start: its gRPC frame must be uncompressed and within
        # MM_SVC_GRPC_MAX_MSG_SIZE (the Python path refuses larger ones), and a runtime wanting
        # the id in field 1 must find it there already. HAProxy reads these from the first bytes,
        # so a large body need not be buffered whole.
        "  http-request wait-for-body time 1s at-least 1024 if { var(txn.mid) -m found }",
        f"  http-request set-var(txn.max_len) str({layout.max_message_bytes:08X}) if {{ var(txn.mid) -m found }}",
        "  acl body_plain req.body,bytes(0,1),hex -m str 00",
        "  acl body_fits req.body,bytes(1,4),hex,strcmp(txn.max_len) le 0",
        "  acl body_names_model req.body,bytes(5),protobuf(1),strcmp(txn.mid) eq 0",
        f"  acl local_copy var(txn.mid),map({layout.local_map}) -m found",
        f"  acl peer_copy var(txn.mid),map({layout.peers_map}) -m found",
        f"  use_backend {LOCAL_BACKEND} if local_copy body_plain body_fits !id_in_body",
        f"  use_backend {LOCAL_BACKEND} if local_copy body_plain body_fits id_in_body body_names_model",
        f"  use_backend %[var(txn.mid),map({layout.peers_map})] if peer_copy !from_peer body_plain body_fits"
        " !id_in_body",
        f"  use_backend %[var(txn.mid),map({layout.peers_map})] if peer_copy !from_peer body_plain body_fits"
        " id_in_body body_names_model",
        *(["  http-response set-var(txn.grpc_status) res.hdr(grpc-status)"] if layout.log_socket else []),
        f"  default_backend {PYTHON_BACKEND}",
        f"backend {LOCAL_BACKEND}",
        f"  http-request track-sc0 var(txn.mid) table {COUNTERS_TABLE}",
        f"  http-request track-sc1 var(txn.mid) table {ARRIVALS_TABLE} unless {{ req.hdr_cnt({HOP_HEADER}) gt 0 }}",
        f"  http-request del-header {HOP_HEADER}",
        *VMODEL_AS_MODEL,
        "  timeout connect 200ms",
        # A runtime that dies with requests in flight (nothing answered yet): they go to the
        # Python path, which reroutes them as it does a copy found unreachable.
        "  retry-on conn-failure empty-response",
        "  option redispatch 1",
        "  retries 1",
        f"  server rt {layout.runtime} {h2} check inter 1s observe layer7 error-limit 1 on-error mark-down",
        f"  {python} backup",
        f"backend {COUNTERS_TABLE}",
        f"  stick-table type string len {TABLE_KEY_LEN} size 1m expire 1d store http_req_cnt,conn_cur",
        f"backend {ARRIVALS_TABLE}",
        f"  stick-table type string len {TABLE_KEY_LEN} size 1m expire 1d store http_req_cnt,conn_cur",
    ]
    for slot in range(layout.peer_slots):
        lines += [
            f"backend {PEER_BACKEND}{slot}",
            f"  http-request track-sc1 var(txn.mid) table {ARRIVALS_TABLE}",  # never a hop: one at most
            f"  http-request set-header {HOP_HEADER} 1",
            *VMODEL_AS_MODEL,
            "  timeout connect 500ms",
            "  retry-on conn-failure empty-response",
            "  option redispatch 1",
            "  retries 1",
            f"  server peer 127.0.0.1:1 {h2} disabled{_peer_ssl(layout.tls)}"
            " check inter 1s observe layer7 error-limit 1 on-error mark-down",
            f"  {python} backup",
        ]
    # The Python path records its own calls: only natively carried ones are logged here.
    lines += [f"backend {PYTHON_BACKEND}", "  http-request set-log-level silent", f"  {python}", ""]
    return "\n".join(lines)


# One line per request: model, vmodel, path, active ms, bytes in, bytes out, HTTP status, the
# grpc-status response header (a unary error is Trailers-Only, so present; absent: OK), the
# backend and server that took it, and the server's response time (ms).
LOG_FORMAT = "%[var(txn.mid)] %[var(txn.vmid)] %[var(txn.path)] %Ta %U %B %ST %[var(txn.grpc_status)] %b %s %Tr"
BACKUP_SERVER = "py"  # a native backend's request that fell back to the Python path (recorded there)
_GRPC_CODES = {code.value[0]: code.name for code in grpc.StatusCode}


@dataclass(frozen=True, slots=True)
class CarriedCall:
    """One request HAProxy carried natively, from its log line."""

    model_id: str
    vmodel_id: str
    method: str
    ms: float
    req_bytes: int
    resp_bytes: int
    code: str  # a grpc.StatusCode name
    backend: str  # LOCAL_BACKEND: this instance's runtime; else a peer slot's backend
    runtime_ms: float  # the runtime's (or peer's) response time; -1: none


def parse_log_line(line: str) -> CarriedCall | None:
    """A log line in LOG_FORMAT; None for lines that are not one (or a fallback to Python)."""
    parts = line.split(" ")
    if len(parts) != 11 or parts[9] == BACKUP_SERVER or parts[0] == "-":
        return None
    model_id, vmodel_id, method, ta, up, down, http_status, grpc_status, backend, _server, tr = parts
    try:
        if http_status != "200":
            code = "UNAVAILABLE"  # HAProxy's own answer (no server could take it), as grpc maps it
        elif grpc_status == "-":
            code = "OK"
        else:
            code = _GRPC_CODES.get(int(grpc_status), "UNKNOWN")
        return CarriedCall(
            model_id,
            "" if vmodel_id == "-" else vmodel_id,
            method,
            float(ta),
            int(up),
            int(down),
            code,
            backend,
            float(tr),
        )
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Counters:
    """One model's row in the counters table."""

    requests: int  # http_req_cnt: requests carried natively to the local runtime, ever
    inflight: int  # conn_cur: of those, the ones not yet answered


_ROW = re.compile(r"^0x[0-9a-f]+: key=(\S+) .*?conn_cur=(\d+) http_req_cnt=(\d+)", re.M)


def parse_table(dump: str) -> dict[str, Counters]:
    """`show table st_local` (or st_arrived) output -> model id -> counters."""
    return {m[1]: Counters(int(m[3]), int(m[2])) for m in _ROW.finditer(dump)}
