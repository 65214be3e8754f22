"""Where the native data plane's files live and what it is given: its layout, its TLS files,
the methods it may carry."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Collection, Iterable
from pathlib import Path

from meshd.runtime.endpoints import grpc_target
from meshd.security.tls import ClientAuth, MeshTls
from meshd.serving.native.haproxy_config import (
    ID_IN_FIELD_1,
    PLAIN,
    Layout,
    TlsFiles,
    haproxy_address,
    haproxy_listen,
)
from meshd.serving.proxy.methods import MethodTable, method_path

KSERVE = "/inference.GRPCInferenceService/"
# What the runtime serves per model; the server-level KServe calls are meshd's own.
KSERVE_CARRIED = (KSERVE + "ModelInfer", KSERVE + "ModelStreamInfer", KSERVE + "ModelMetadata")


def workdir() -> Path:
    """A private directory for the configuration, maps and sockets: short (unix socket paths
    are limited to 107 bytes) and readable only by meshd (the runtime API is admin)."""
    return Path(tempfile.mkdtemp(prefix="meshd-native-"))


def write_tls_files(tls: MeshTls, directory: Path) -> TlsFiles:
    def write(name: str, data: bytes) -> str:
        path = directory / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return str(path)

    cert_key = write("cert-key.pem", tls.cert_chain.rstrip(b"\n") + b"\n" + tls.private_key)
    client = None
    if tls.settings.client_auth is ClientAuth.REQUIRE and tls.trust is not None:
        client = write("client-trust.pem", tls.trust)
    return TlsFiles(cert_key, client, write("peer-trust.pem", tls.internal_trust))


def layout(
    listen_port: int,
    python_socket: Path,
    runtime_endpoint: str,
    directory: Path,
    tls: TlsFiles | None,
    deadline_required: bool,
    log_socket: Path | None,
    max_headers_bytes: int,
    max_message_bytes: int,
    dual_stack: bool = False,
    request_per_connection: bool = False,
) -> Layout:
    return Layout(
        listen=haproxy_listen(listen_port, dual_stack),
        python=f"unix@{python_socket}",
        runtime=haproxy_address(grpc_target(runtime_endpoint)),
        api_socket=str(directory / "api.sock"),
        methods_map=str(directory / "methods.map"),
        local_map=str(directory / "local.map"),
        peers_map=str(directory / "peers.map"),
        vmodels_map=str(directory / "vmodels.map"),
        tls=tls,
        deadline_required=deadline_required,
        log_socket=str(log_socket) if log_socket is not None else None,
        max_headers_bytes=max_headers_bytes,
        max_message_bytes=max_message_bytes,
        request_per_connection=request_per_connection,
    )


def carried_methods(
    methods: MethodTable, runtime_methods: Iterable[str], meshd_handles: Collection[str]
) -> dict[str, str]:
    """Methods the native data plane may carry -> how it knows the body is right for the runtime.

    The runtime's per-model unary methods whose model is named in the headers (no id
    extraction from the body): PLAIN when the runtime asks for no id in the body; ID_IN_FIELD_1
    when it asks for the id in field 1 (idInjectionPath [1], what the KServe adapters announce
    for ModelInfer and ModelMetadata): carried only when the body already names that model
    there, as clients of such runtimes send it; otherwise the Python path splices it in.
    Deeper injection paths stay on the Python path.

    Streams stay on the Python path too: HAProxy 2.6 turns a runtime that ends a stream while
    the client still sends (an error mid-stream) into RST_STREAM(CANCEL), losing the status
    the runtime sent; the Python path relays it (tests/integration/test_dataplane.py)."""
    carried: dict[str, str] = {}
    for path in {*KSERVE_CARRIED, *(method_path(m) for m in runtime_methods)}:
        if path in meshd_handles:
            continue
        spec = methods.spec(path)
        if spec is None or spec.streaming or spec.extract:
            continue
        if not spec.inject:
            carried[path] = PLAIN
        elif spec.inject == (1,):
            carried[path] = ID_IN_FIELD_1
    return carried
