"""`KV_STORE` in every form upstream ModelMesh accepts, read into one `EtcdTarget`.

Upstream (kv-utils' factory over etcd-java's cluster config) takes `etcd:<config>` where
`<config>` is either the path of a JSON file (what modelmesh-serving mounts from its etcd
secret: `etcd:/opt/kserve/mmesh/etcd/etcd_connection`) or the simple form
`ep1,ep2,...;rootPrefix=<prefix>`. meshd also takes the JSON inline (`etcd:{...}`).

The JSON keys are etcd-java's: `endpoints` (comma-separated, each `[http[s]://]host[:port]`),
`userid` + `password`, `root_prefix`, `certificate` (PEM text) or `certificate_file` (a path,
tried as given and then beside the JSON file), `client_certificate[_file]` +
`client_key[_file]` (a client certificate for TLS client auth), `override_authority` (the
name checked in every member's certificate), `tls_mode` (AUTO, TLS or PLAINTEXT). TLS is on,
as upstream decides it, when the first endpoint is `https://`, or has no scheme and a
certificate is given (or `tls_mode` says so).

Parsing reads every file it names now, so a bad value is one start-up error. It differs
from upstream in one way on purpose: a key upstream would ignore (a typo such as
`root-prefix`) is an error here, not a silent fallback to the defaults.
"""

from __future__ import annotations

import json
import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshd.core import hostport

DEFAULT_PORT = 2379  # etcd's client port, what upstream assumes when an endpoint has none

KNOWN_KEYS = frozenset(
    {
        "endpoints",
        "userid",
        "password",
        "root_prefix",
        "certificate",
        "certificate_file",
        "client_certificate",
        "client_certificate_file",
        "client_key",
        "client_key_file",
        "override_authority",
        "tls_mode",
    }
)
TLS_MODES = ("AUTO", "TLS", "PLAINTEXT")

# etcd-java's simple form: `ep(,ep)*(;rootPrefix=<prefix>)?`, ep = `[http[s]://]host[:port]`;
# an IPv6 host in brackets, as in a URL: `http://[fd00::7]:2379`.
_HOST = r"[A-Za-z0-9\-.]+|\[[0-9A-Fa-f:.]+\]"
_ENDPOINT = rf"(?:https?://)?(?:{_HOST})(?::\d+)?"
_SIMPLE = re.compile(rf"({_ENDPOINT}(?:,{_ENDPOINT})*)(?:;rootPrefix=(.+))?")
_ENDPOINT_PARTS = re.compile(rf"(?:(https?)://)?({_HOST})(?::(\d+))?")


class KVStoreError(ValueError):
    """A `KV_STORE` value meshd cannot use; the message is one line for the start-up error."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str  # an IPv6 address without its brackets
    port: int
    scheme: str = ""  # "http", "https" or "" as written

    def __str__(self) -> str:
        return hostport.join(self.host, self.port)


@dataclass(frozen=True, slots=True)
class EtcdTarget:
    """Everything needed to reach one etcd cluster, with files already read."""

    endpoints: tuple[Endpoint, ...]
    root_prefix: str = ""  # prepended to every key exactly as given (upstream's rule)
    tls: bool = False
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_cert: bytes | None = field(default=None, repr=False)  # None with tls: the system's roots
    client_cert: bytes | None = field(default=None, repr=False)
    client_key: bytes | None = field(default=None, repr=False)
    override_authority: str | None = None

    @property
    def url(self) -> str:
        """The first endpoint as a URL (logs, and callers that want one)."""
        ep = self.endpoints[0]
        return f"{'https' if self.tls else 'http'}://{ep}"

    def describe(self) -> str:
        """For logs: never the password or key."""
        parts = [",".join(str(e) for e in self.endpoints), "tls" if self.tls else "plaintext"]
        if self.client_cert is not None:
            parts.append("client cert")
        if self.user is not None:
            parts.append(f"user {self.user}")
        if self.root_prefix:
            parts.append(f"root prefix {self.root_prefix!r}")
        return ", ".join(parts)


def parse_kv_store(value: str) -> EtcdTarget:
    """`etcd:<json file>`, `etcd:ep1,ep2;rootPrefix=x` or `etcd:{json}`; raises `KVStoreError`."""
    kind, sep, body = value.partition(":")
    if not sep or kind.lower() != "etcd":
        if kind.lower() == "zookeeper":
            raise KVStoreError("KV_STORE: zookeeper is not supported by meshd (etcd only)")
        raise KVStoreError(f"KV_STORE must start with 'etcd:' (got {value!r})")
    body = body.strip()
    if not body:
        raise KVStoreError("KV_STORE: 'etcd:' needs a JSON file, a JSON object or endpoints after it")
    if body.startswith("{"):
        return _from_json(body, None, "inline JSON")
    path = Path(body)
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise KVStoreError(f"KV_STORE: cannot read {path}: {e}") from None
        return _from_json(text, path.parent, str(path))
    simple = _SIMPLE.fullmatch(body)
    if simple is not None and not body.startswith(("/", ".")):
        endpoints = _endpoints(simple.group(1))
        return EtcdTarget(endpoints, root_prefix=simple.group(2) or "", tls=endpoints[0].scheme == "https")
    if "/" in body.split("://", 1)[-1] or body.endswith(".json") or body.startswith("."):
        raise KVStoreError(f"KV_STORE: etcd config file not found: {body}")
    raise KVStoreError(f"KV_STORE: not a JSON file, JSON object or 'ep1,ep2;rootPrefix=x' list: {body!r}")


def _endpoints(text: str) -> tuple[Endpoint, ...]:
    out: list[Endpoint] = []
    for raw in text.split(","):
        raw = raw.strip()
        m = _ENDPOINT_PARTS.fullmatch(raw)
        if m is None:
            raise KVStoreError(f"KV_STORE: bad etcd endpoint {raw!r} (want [http[s]://]host[:port])")
        port = int(m.group(3)) if m.group(3) else DEFAULT_PORT
        if not 0 < port < 65536:
            raise KVStoreError(f"KV_STORE: bad port in etcd endpoint {raw!r}")
        out.append(Endpoint(hostport.unbracket(m.group(2)), port, m.group(1) or ""))
    return tuple(out)


def _from_json(text: str, base: Path | None, where: str) -> EtcdTarget:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise KVStoreError(f"KV_STORE: {where} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise KVStoreError(f"KV_STORE: {where} must hold a JSON object")
    unknown = sorted(set(obj) - KNOWN_KEYS)
    if unknown:
        raise KVStoreError(f"KV_STORE: {where} has unknown key(s) {', '.join(unknown)}")
    for k, v in obj.items():
        if v is not None and not isinstance(v, str):
            raise KVStoreError(f"KV_STORE: {where}: {k!r} must be a string")
    get: dict[str, Any] = {k: v for k, v in obj.items() if v is not None}
    if not str(get.get("endpoints", "")).strip():
        raise KVStoreError(f"KV_STORE: {where} needs 'endpoints'")
    endpoints = _endpoints(get["endpoints"])
    if ("userid" in get) != ("password" in get):
        raise KVStoreError(f"KV_STORE: {where}: 'userid' and 'password' go together")
    ca = _pem(get, "certificate", base, where, b"CERTIFICATE")
    client_cert = _pem(get, "client_certificate", base, where, b"CERTIFICATE")
    client_key = _pem(get, "client_key", base, where, b"PRIVATE KEY")
    if (client_cert is None) != (client_key is None):
        raise KVStoreError(f"KV_STORE: {where}: give both or neither of client_certificate and client_key")
    if ca is not None:
        try:
            ssl.create_default_context().load_verify_locations(cadata=ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as e:
            raise KVStoreError(f"KV_STORE: {where}: certificate is not a usable PEM CA certificate: {e}") from None
    mode = str(get.get("tls_mode", "AUTO")).upper()
    if mode not in TLS_MODES:
        raise KVStoreError(f"KV_STORE: {where}: tls_mode must be one of {', '.join(TLS_MODES)}")
    first = endpoints[0].scheme
    if mode == "AUTO":  # etcd-java's rule, from the first endpoint
        tls = first == "https" or (first == "" and (ca is not None or client_cert is not None))
    else:
        tls = mode == "TLS"
    if not tls and (client_cert is not None or first == "https"):
        raise KVStoreError(f"KV_STORE: {where}: TLS settings given but tls_mode is PLAINTEXT")
    return EtcdTarget(
        endpoints,
        root_prefix=get.get("root_prefix", ""),
        tls=tls,
        user=get.get("userid"),
        password=get.get("password"),
        ca_cert=ca,
        client_cert=client_cert,
        client_key=client_key,
        override_authority=get.get("override_authority") or None,
    )


def _pem(obj: dict[str, Any], key: str, base: Path | None, where: str, marker: bytes) -> bytes | None:
    """`<key>_file` (as given, else beside the JSON file) wins over the inline `<key>`."""
    data: bytes | None = None
    file_name = obj.get(f"{key}_file")
    if file_name:
        path = Path(file_name)
        if not path.is_file() and base is not None and not path.is_absolute():
            path = base / path
        try:
            data = path.read_bytes()
        except OSError as e:
            if key not in obj:
                raise KVStoreError(f"KV_STORE: {where}: cannot read {key}_file {file_name}: {e.strerror}") from None
    if data is None and key in obj:
        data = str(obj[key]).encode()
    if data is not None and (b"-----BEGIN " not in data or marker not in data):
        raise KVStoreError(f"KV_STORE: {where}: {key} is not PEM ({marker.decode()})")
    return data
