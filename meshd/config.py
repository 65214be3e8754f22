"""Instance configuration: upstream environment names (SPEC §7) and `meshd serve` flags.

Every setting has a flag; the environment name keeps working; a flag wins over the
environment. Parsing is pure (environment passed in) and errors name the setting.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from meshd.core import hostport
from meshd.decisions.cache import Eviction
from meshd.decisions.ids import instance_id_problem
from meshd.decisions.load_deadline import DEFAULT_PULL_DEADLINE_MS
from meshd.decisions.placement.constraints import TypeConstraints
from meshd.decisions.publishing import numeric_version
from meshd.kv import target as kv_target
from meshd.kv.embedded import URL_FILE as ETCD_URL_FILE
from meshd.kv.target import EtcdTarget
from meshd.net.listen import bound_socket
from meshd.observability.logs import parse_log_format
from meshd.observability.metrics import MetricsConfig
from meshd.observability.payloads import Processor, parse_processors
from meshd.security import tls as meshtls
from meshd.serving.native.haproxy import find_haproxy
from meshd.serving.proxy.methods import DataplaneConfig

T = TypeVar("T")
DEFAULT_METRICS = "prometheus:port=2112"
MAX_GRPC_INT = 2**31 - 1  # grpc channel arguments are C ints: larger overflows at server creation
MAX_PORT = 65535  # grpc takes larger port numbers modulo 65536 (70000 listened on 4464)


class ConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Setting:
    dest: str
    env: str
    flag: str
    help: str
    default: str | None = None


SETTINGS: tuple[Setting, ...] = (
    Setting("service_name", "MM_SERVICE_NAME", "--service-name", "mesh service name (etcd key segment)", "modelmesh"),
    Setting(
        "kv_store",
        "KV_STORE",
        "--kv-store",
        "etcd:<json file>, etcd:{json} or etcd:ep1,ep2;rootPrefix=p; unset: start a private embedded etcd",
    ),
    Setting("kv_prefix", "MM_KVSTORE_PREFIX", "--kv-prefix", "key prefix under the etcd root", "tas-runtime"),
    Setting("labels", "MM_LABELS", "--labels", "comma-separated instance labels"),
    Setting("grpc_port", "MM_SVC_GRPC_PORT", "--grpc-port", "external gRPC port (inference + management)", "8033"),
    Setting("max_msg_size", "MM_SVC_GRPC_MAX_MSG_SIZE", "--max-msg-size", "max gRPC message bytes", str(16 << 20)),
    Setting(
        "max_headers_size",
        "MM_SVC_GRPC_MAX_HEADERS_SIZE",
        "--max-headers-size",
        "max bytes of a request's gRPC headers (larger: RESOURCE_EXHAUSTED)",
        str(8 << 10),
    ),
    Setting("runtime_port", "INTERNAL_GRPC_PORT", "--runtime-port", "runtime management port", "8085"),
    Setting("runtime_socket", "INTERNAL_GRPC_SOCKET_PATH", "--runtime-socket", "runtime management unix socket"),
    Setting("serving_port", "INTERNAL_SERVING_GRPC_PORT", "--serving-port", "runtime inference port (default: mgmt)"),
    Setting("serving_socket", "INTERNAL_SERVING_GRPC_SOCKET_PATH", "--serving-socket", "runtime inference unix socket"),
    Setting(
        "load_failure_expiry_ms",
        "MM_LOAD_FAILURE_EXPIRY_TIME_MS",
        "--load-failure-expiry-ms",
        "how long a load failure is remembered",
        "900000",
    ),
    Setting("shutdown_timeout_ms", "SHUTDOWN_TIMEOUT_MS", "--shutdown-timeout-ms", "graceful stop budget", "30000"),
    Setting(
        "drain_grace_ms",
        "MESHD_DRAIN_GRACE_MS",
        "--drain-grace-ms",
        "after SIGTERM, how long the ports keep accepting and serving once health says NOT_SERVING "
        "(with no other instance in the mesh, only while requests keep arriving)",
        "10000",
    ),
    Setting("instance_id", "MESHD_INSTANCE_ID", "--instance-id", "instance id (default: from the host name)"),
    Setting("peer_port", "MESHD_PEER_PORT", "--peer-port", "internal peer gRPC port", "8080"),
    Setting("advertise_host", "MESHD_ADVERTISE_HOST", "--advertise-host", "address peers dial (default: pod IP)"),
    Setting("data_dir", "MESHD_DATA_DIR", "--data-dir", "embedded etcd and local state", "./.meshd"),
    Setting(
        "join",
        "MESHD_JOIN",
        "--join",
        "the data directory of a meshd on this host: use its embedded etcd (a second instance beside it)",
    ),
    Setting(
        "ports",
        "MESHD_PORTS",
        "--ports",
        "auto: every port not set is a free one (printed at start) and the default instance id ends "
        "with the gRPC port; fixed: the defaults",
        "fixed",
    ),
    Setting("zone", "MM_ZONE", "--zone", "zone reported in the instance record", ""),
    Setting(
        "service_version",
        "SERVICE_VERSION",
        "--service-version",
        "this deployment's version (upstream's NAME-YYYYMMDD-N or dotted): during a rolling update "
        "placement prefers the newest (default: meshd's own)",
        "",
    ),
    Setting(
        "type_constraints", "MM_TYPE_CONSTRAINTS", "--type-constraints", "JSON: model type -> required/preferred labels"
    ),
    Setting(
        "type_constraints_path",
        "MM_TYPE_CONSTRAINTS_PATH",
        "--type-constraints-path",
        "file with the type constraints JSON",
    ),
    Setting(
        "scaleup_rpm_threshold",
        "MM_SCALEUP_RPM_THRESHOLD",
        "--scaleup-rpm-threshold",
        "requests/min per copy above which copies are added",
        "2000",
    ),
    Setting(
        "dataplane_config", "MM_DATAPLANE_CONFIG", "--dataplane-config", "JSON: per-method id extraction and streaming"
    ),
    Setting(
        "dataplane_config_path",
        "MM_DATAPLANE_CONFIG_PATH",
        "--dataplane-config-path",
        "file with the dataplane config JSON",
    ),
    Setting(
        "max_inflight_per_copy",
        "MM_MAX_INFLIGHT_PER_MODEL_COPY",
        "--max-inflight-per-copy",
        "requests that may queue per copy when the runtime limits concurrency (0 auto, <0 unbounded)",
        "0",
    ),
    Setting(
        "conc_scaleup_bandwidth_pct",
        "MM_CONC_SCALEUP_BANDWIDTH_PCT",
        "--conc-scaleup-bandwidth-pct",
        "with concurrency limits: add copies above this % of a copy's estimated throughput",
        "90",
    ),
    Setting(
        "request_timeout_ms",
        "MESHD_REQUEST_TIMEOUT_MS",
        "--request-timeout-ms",
        "inference timeout when the client sets no deadline (0: none)",
        "0",
    ),
    Setting("janitor_ms", "MESHD_JANITOR_MS", "--janitor-ms", "registry/cache reconcile interval", "360000"),
    Setting("leader_sweep_ms", "MESHD_LEADER_SWEEP_MS", "--leader-sweep-ms", "leader sweep interval", "420000"),
    Setting(
        "dead_instance_prune_ms",
        "MESHD_DEAD_INSTANCE_PRUNE_MS",
        "--dead-instance-prune-ms",
        "how long an instance is gone before the leader drops its copies from records",
        "600000",
    ),
    Setting("rate_check_ms", "MESHD_RATE_CHECK_MS", "--rate-check-ms", "copy-scaling check interval", "10000"),
    Setting(
        "copy_idle_ms",
        "MESHD_COPY_IDLE_MS",
        "--copy-idle-ms",
        "idle time before an extra copy may go when the cluster is full (default: upstream's rule)",
    ),
    Setting(
        "eviction",
        "MESHD_EVICTION",
        "--eviction",
        "cache eviction order: rate-capped (each copy's recent request rate per unit of memory and second of "
        "reload, a silent model's weighed by the odds that its rate still holds: see docs/policies.md), rate (the "
        "rate alone), lrfu (recent uses per unit and second, halved every two turnovers), "
        "gdsf (uses per unit and second, no decay), lru (upstream's) or adaptive (rate's order or recency's, "
        "whichever the fleet regrets less: the evicted models reloaded soon after, counted from the etcd records)",
        "rate-capped",
    ),
    Setting(
        "latency_target_ms",
        "MESHD_LATENCY_TARGET_MS",
        "--latency-target-ms",
        "opt-in (rate, lrfu, adaptive, rate-capped): copies whose reload would take longer than this are worth 4x "
        "to keep (0: none)",
        "0",
    ),
    Setting(
        "llm_routing",
        "MESHD_LLM_ROUTING",
        "--llm-routing",
        "load: a language model's call goes to the copy where it starts soonest, its prompt prefix's when not "
        "overloaded; inflight: as any inference (a local copy, else the fewest in flight)",
        "load",
    ),
    Setting(
        "load_queue",
        "MESHD_LOAD_QUEUE",
        "--load-queue",
        "value: loads take room when they start, most valuable first, refused fast beyond capacity; fifo: upstream's",
        "value",
    ),
    Setting(
        "load_wait_limit_ms",
        "MESHD_LOAD_WAIT_LIMIT_MS",
        "--load-wait-limit-ms",
        "load queue (value): longest a load may wait for a loading thread before misses are refused",
        "10000",
    ),
    Setting(
        "pull_deadline_ms",
        "MESHD_PULL_DEADLINE_MS",
        "--pull-deadline-ms",
        "longest a load may run while the runtime's disk tier shows its model's pull running (the loading "
        "timeout counts only the time not spent pulling; 0: it counts the pull too, as upstream's; docs/storage.md)",
        "7200000",
    ),
    Setting(
        "data_plane",
        "MESHD_DATAPLANE",
        "--dataplane",
        "python: every request through meshd's Python path; native: warm requests through HAProxy "
        "(meshd its control plane; docs/native.md); auto: native when HAProxy is found, else python",
        "python",
    ),
    Setting(
        "haproxy",
        "MESHD_HAPROXY",
        "--haproxy",
        "the HAProxy executable of the native data plane (a path, or a name on PATH)",
        "haproxy",
    ),
    Setting("default_vmodel_owner", "MM_DEFAULT_VMODEL_OWNER", "--default-vmodel-owner", "owner of new vmodels", ""),
    Setting(
        "instance_ttl_s",
        "MESHD_INSTANCE_TTL_S",
        "--instance-ttl-s",
        "lease TTL of the instance record (upstream 20 s)",
        "20",
    ),
    Setting(
        "http_port",
        "MESHD_HTTP_PORT",
        "--http-port",
        "KServe V2 REST port ('disabled' turns it off; not 8008: a modelmesh-serving pod's rest-proxy has it)",
        "8091",
    ),
    Setting(
        "model_repository",
        "MESHD_MODEL_REPOSITORY",
        "--model-repository",
        "directory of model folders that RepositoryModelLoad registers on first load",
    ),
    Setting(
        "model_repository_type",
        "MESHD_MODEL_REPOSITORY_TYPE",
        "--model-repository-type",
        "model type for repository folders that do not name one",
    ),
    Setting(
        "runtime_ready_timeout_s",
        "MESHD_RUNTIME_READY_TIMEOUT_S",
        "--runtime-ready-timeout-s",
        "how long to wait for the runtime to be READY",
        "180",
    ),
    Setting(
        "runtime_check_ms",
        "MESHD_RUNTIME_CHECK_MS",
        "--runtime-check-ms",
        "how often the runtime is probed after start-up; 3 missed probes drop its copies",
        "5000",
    ),
    Setting(
        "tls_key_cert",
        meshtls.CERT_ENV,
        "--tls-key-cert",
        "PEM certificate chain: TLS on both gRPC ports (or upstream's older MM_SVC_GRPC_CA_CERT_PATH)",
    ),
    Setting(
        "tls_private_key",
        meshtls.KEY_ENV,
        "--tls-private-key",
        "PEM private key of that certificate (or upstream's older MM_SVC_GRPC_PRIVATE_KEY_PATH)",
    ),
    Setting(
        "tls_private_key_passphrase",
        meshtls.PASSPHRASE_ENV,
        "--tls-private-key-passphrase",
        "passphrase of an encrypted private key (prefer the env variable; or the older "
        "MM_SVC_GRPC_PRIVATE_KEY_PASSPHRASE)",
    ),
    Setting(
        "tls_client_auth",
        meshtls.CLIENT_AUTH_ENV,
        "--tls-client-auth",
        "client certificates on the external port: NONE, REQUIRE or OPTIONAL",
        "NONE",
    ),
    Setting(
        "tls_trust_certs", meshtls.TRUST_ENV, "--tls-trust-certs", "comma-separated PEM CA files: mesh and client trust"
    ),
    Setting("tls_peer_name", meshtls.PEER_NAME_ENV, "--tls-peer-name", "name peers check in each other's certificate"),
    Setting(
        "metrics",
        "MM_METRICS",
        "--metrics",
        "prometheus:port=N;per_model_metrics=true|false;fq_names=true|false;scheme=http|https, or disabled",
        DEFAULT_METRICS,
    ),
    Setting("log_each_invoke", "MM_LOG_EACH_INVOKE", "--log-each-invoke", "one INFO log record per inference", "false"),
    Setting("log_format", "MESHD_LOG_FORMAT", "--log-format", "log lines: text or json", "text"),
    Setting(
        "watch_trace",
        "MESHD_WATCH_TRACE",
        "--watch-trace",
        "file to append '<revision> <wall ns>' to as each registry change reaches this instance (benchmarks)",
    ),
    # ---- upstream's pod contract (README, Inside a modelmesh-serving pod) ----
    Setting("probe_port", "MM_PROBE_PORT", "--probe-port", "HTTP /ready and /live ('disabled' or NONE: off)", "8089"),
    Setting(
        "prestop_port",
        "MM_PRESTOP_WAIT_PORT",
        "--prestop-port",
        "HTTP /prestop: starts the drain ('disabled': off)",
        "8090",
    ),
    Setting(
        "max_connection_age_s",
        "MM_SVC_GRPC_MAX_CONNECTION_AGE_SECS",
        "--max-connection-age-s",
        "external gRPC connections are closed (GOAWAY) after this many seconds (unset: never)",
    ),
    Setting(
        "max_connection_age_grace_s",
        "MM_SVC_GRPC_MAX_CONNECTION_AGE_GRACE_SECS",
        "--max-connection-age-grace-s",
        "time calls in flight get after that GOAWAY (unset: unlimited)",
    ),
    Setting(
        "payload_processors",
        "MM_PAYLOAD_PROCESSORS",
        "--payload-processors",
        "space-separated logger://[model] or http(s)://host/path: inference payload logging",
    ),
    Setting(
        "payload_capacity",
        "MM_PAYLOAD_PROCESSORS_CAPACITY",
        "--payload-capacity",
        "payload records queued before new ones are dropped",
        "64",
    ),
    Setting("payload_senders", "MM_PAYLOAD_PROCESSORS_THREADS", "--payload-senders", "payload sender tasks", "2"),
    Setting(
        "log_request_headers",
        "MM_LOG_REQUEST_HEADERS",
        "--log-request-headers",
        'JSON {"header": "log field"}: request headers added to the invoke log record',
    ),
    Setting("info_metrics", "MM_INFO_METRICS", "--info-metrics", "name;label=ENVVAR,...: a constant info gauge"),
    Setting("kv_read_only", "KV_READ_ONLY", "--kv-read-only", "refuse model and vmodel changes (migration)", "false"),
    Setting("location", "MM_LOCATION", "--location", "node address reported in the instance record"),
    Setting(
        "auto_register", "MM_AUTO_REGISTER_MODELS", "--auto-register", "JSON list of models registered at start-up"
    ),
    Setting(
        "auto_register_path",
        "MM_AUTO_REGISTER_MODELS_PATH",
        "--auto-register-path",
        "file with that JSON list",
    ),
)

# Upstream variables meshd does not act on: set, each gets one warning at start-up.
UPSTREAM_IGNORED: dict[str, str] = {
    "MM_SEND_DEST_ID": "meshd does not add the destination instance id to responses",
    "MM_MULTI_PARALLELISM": "multi-model requests are not supported",
    "BOOTSTRAP_CLEARANCE_PERIOD_MS": "meshd has no bootstrap fail-fast of rolling updates",
    "MM_FAILFAST_UPGRADE_ENABLED": "meshd has no bootstrap fail-fast of rolling updates",
    "MM_ENABLE_SSL": "peer TLS follows MM_TLS_KEY_CERT_PATH",
    "MM_INTERNAL_TRUST_CERTS": "peer trust follows MM_TLS_TRUST_CERT_PATH",
    "HEAP_SIZE_MB": "a JVM setting",
    "MAX_DIRECT_BUFS_MB": "a JVM setting",
    "MEM_LIMIT_MB": "a JVM setting",
    "MM_JVM_OPTS": "a JVM setting",
    "LL_REGISTRY": "litelinks: meshd peers use their own gRPC port (MESHD_PEER_PORT)",
    "LITELINKS_PORT": "litelinks: meshd peers use their own gRPC port (MESHD_PEER_PORT)",
    "MM_SVC_GRPC_MAX_HEADER_SIZE": "use MM_SVC_GRPC_MAX_HEADERS_SIZE",
}
UPSTREAM_IGNORED_PREFIXES = ("TAS_",)  # upstream's older names

# Upstream's deprecated names of meshd settings, read, in this order, when the setting itself
# is not given (ModelMesh.java reads MM_TLS_* first, then these; ModelMeshEnvVars.java).
OLDER_NAMES: dict[str, tuple[str, ...]] = {
    "tls_key_cert": ("MM_SVC_GRPC_CA_CERT_PATH", "TAS_SVC_GRPC_CA_CERT_PATH"),
    "tls_private_key": ("MM_SVC_GRPC_PRIVATE_KEY_PATH", "TAS_SVC_GRPC_PRIVATE_KEY_PATH"),
    "tls_private_key_passphrase": ("MM_SVC_GRPC_PRIVATE_KEY_PASSPHRASE",),
}
OLDER = frozenset(old for olds in OLDER_NAMES.values() for old in olds)


def older_names(given: set[str], env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """Values that upstream's deprecated names give settings not `given` (flag or variable),
    and a warning for each deprecated name set."""
    values: dict[str, str] = {}
    warnings: list[str] = []
    for dest, olds in OLDER_NAMES.items():
        new = next(s.env for s in SETTINGS if s.dest == dest)
        for old in olds:
            if not env.get(old):
                continue
            if dest in given or dest in values:
                warnings.append(f"{old} is ignored: {new} (or an older name upstream reads first) is set")
            else:
                values[dest] = env[old]
                warnings.append(f"{old} is a deprecated name: read as {new}, which to use instead")
    return values, warnings


@dataclass(frozen=True, slots=True)
class Config:
    service_name: str
    kv_store: EtcdTarget | None
    kv_prefix: str
    labels: tuple[str, ...]
    grpc_port: int
    max_msg_size: int
    runtime_endpoint: str
    serving_endpoint: str
    load_failure_expiry_ms: int
    shutdown_timeout_ms: int
    instance_id: str
    peer_port: int
    advertise_host: str
    data_dir: Path
    runtime_ready_timeout_s: float
    zone: str = ""
    service_version: str = ""  # "" -> meshd's own version
    instance_ttl_s: int = 20
    drain_grace_ms: int = 10_000
    default_vmodel_owner: str = ""
    type_constraints: TypeConstraints = field(default_factory=TypeConstraints)
    scaleup_rpm_threshold: int = 2000
    rate_check_ms: int = 10_000
    janitor_ms: int = 360_000
    runtime_check_ms: int = 5_000
    leader_sweep_ms: int = 420_000
    dead_instance_prune_ms: int = 600_000
    copy_idle_ms: int | None = None
    dataplane: DataplaneConfig = field(default_factory=DataplaneConfig)
    max_inflight_per_copy: int = 0
    conc_scaleup_bandwidth_pct: int = 90
    request_timeout_ms: int = 0
    eviction: Eviction = Eviction.CAPPED
    latency_target_ms: int = 0  # 0: none
    load_queue: bool = True  # MESHD_LOAD_QUEUE=value; False: fifo (upstream's)
    llm_routing: bool = True  # MESHD_LLM_ROUTING=load; False: inflight (as any inference)
    load_wait_limit_ms: int = 10_000
    pull_deadline_ms: int = DEFAULT_PULL_DEADLINE_MS
    data_plane: str = "python"  # resolved: "python" or "native" (MESHD_DATAPLANE=auto picks one)
    haproxy: str = ""  # the HAProxy executable found, when data_plane is native
    tls: meshtls.MeshTls | None = None
    http_port: int | None = 8091  # None: no REST endpoints
    model_repository: Path | None = None
    model_repository_type: str = ""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    log_each_invoke: bool = False
    log_format: str = "text"
    max_headers_size: int = 8 << 10
    watch_trace: Path | None = None
    probe_port: int | None = 8089
    prestop_port: int | None = 8090
    max_connection_age_s: int | None = None
    max_connection_age_grace_s: int | None = None
    payload_processors: tuple[Processor, ...] = ()
    payload_capacity: int = 64
    payload_senders: int = 2
    log_request_headers: dict[str, str] = field(default_factory=dict)
    info_metrics: InfoMetric | None = None
    kv_read_only: bool = False
    location: str = ""
    auto_register: tuple[AutoRegistration, ...] = ()
    type_constraints_path: Path | None = None  # followed as it changes (ConfigMap updates)
    dataplane_config_path: Path | None = None
    warnings: tuple[str, ...] = ()  # logged once at start-up
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def key_prefix(self) -> str:
        """`<root>/<kv prefix>/<service>`: registry/, vmodels/, instances/, leaderLatch/ live under it.

        Upstream's rule (kv-utils): the root prefix is prepended to the path exactly as given,
        and the path always starts with '/', so an empty root gives `/tas-runtime/<svc>` and a
        root ending in '/' gives a double slash.
        """
        root = self.kv_store.root_prefix if self.kv_store else ""
        return f"{root}/{self.kv_prefix}/{self.service_name.strip('/')}"


def parse_kv_store(value: str) -> EtcdTarget:
    """Every upstream `KV_STORE` form (see meshd.kv.target); files it names are read now."""
    try:
        return kv_target.parse_kv_store(value)
    except kv_target.KVStoreError as e:
        raise ConfigError(str(e)) from None


def _service_version(name: str, value: str) -> str:
    """The version as given, if its number fits the record's `vers` (upstream: a Java long)."""
    if value and not 0 <= numeric_version(value) < 2**63:
        raise ConfigError(f"{name}={value[:60]!r}: its number does not fit in a 64-bit signed integer")
    return value


def _kv_prefix(name: str, value: str) -> str:
    # Upstream refuses these too: the prefix is one path segment.
    if not value or any(c == "/" or c.isspace() for c in value):
        raise ConfigError(f"{name} must be one non-empty path segment, without '/' or whitespace (got {value!r})")
    return value


AUTO_PORTS = ("grpc_port", "peer_port", "http_port", "probe_port", "prestop_port")


def _free_ports(raw: dict[str, str | None], given: set[str], env: Mapping[str, str]) -> None:
    """MESHD_PORTS=auto: every port the user did not set becomes a free one (the metrics port
    too, when metrics are on by default), and the default instance id ends with the gRPC port,
    so a second instance on a host needs no other setting."""
    missing = [dest for dest in AUTO_PORTS if dest not in given]
    metrics = "metrics" not in given
    with contextlib.ExitStack() as held:  # held open together: no port handed out twice
        ports = []
        for _ in range(len(missing) + metrics):
            sock = held.enter_context(bound_socket(None, 0))  # free on both families, as servers bind
            ports.append(sock.getsockname()[1])
    for dest, port in zip(missing, ports, strict=False):
        raw[dest] = str(port)
    if metrics:
        raw["metrics"] = f"prometheus:port={ports[-1]}"
    if "instance_id" not in given and not env.get("WKUBE_POD_NAME"):
        raw["instance_id"] = f"{default_instance_id()}-{raw['grpc_port']}"


def _joined_etcd(what: str, data_dir: Path) -> str:
    """The client URL the embedded etcd of the meshd using `data_dir` wrote there."""
    url_file = data_dir / ETCD_URL_FILE
    try:
        url = url_file.read_text(encoding="utf-8").strip()
    except OSError:
        raise ConfigError(
            f"{what}: {url_file} not found: is a meshd with its embedded etcd running on {data_dir}? "
            "(or set KV_STORE to an etcd)"
        ) from None
    if not url:
        raise ConfigError(f"{what}: {url_file} is empty")
    return url


def default_instance_id() -> str:
    # Upstream uses the last 12 characters of the pod name.
    return socket.gethostname()[-12:] or "meshd"


def _int(name: str, value: str, minimum: int = 0) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"{name} must be an integer (got {value!r})") from None
    if n < minimum:
        raise ConfigError(f"{name} must be at least {minimum} (got {n})")
    return n


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    for s in SETTINGS:
        default = f" (env {s.env}" + (f", default {s.default})" if s.default else ")")
        # argparse formats help with %: a literal one ("this % of ...") must be doubled.
        parser.add_argument(s.flag, dest=s.dest, default=None, help=(s.help + default).replace("%", "%%"))


def load_config(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None) -> Config:
    env = os.environ if env is None else env
    raw: dict[str, str | None] = {}
    given: set[str] = set()  # settings the user gave (flag or environment), not defaults
    for s in SETTINGS:
        flag_value = getattr(args, s.dest, None) if args is not None else None
        raw[s.dest] = flag_value if flag_value is not None else env.get(s.env) or s.default
        if flag_value is not None or env.get(s.env):
            given.add(s.dest)

    def name(dest: str) -> str:
        s = next(x for x in SETTINGS if x.dest == dest)
        return f"{s.env} ({s.flag})"

    def need(dest: str) -> str:
        value = raw[dest]
        assert value is not None
        return value

    older, older_warnings = older_names(given, env)
    raw |= older
    given |= older.keys()
    for port, uds in (("runtime_port", "runtime_socket"), ("serving_port", "serving_socket")):
        if port in given and uds in given:  # upstream (SidecarModelMesh) refuses both too
            raise ConfigError(f"give {name(port)} or {name(uds)}, not both")
    if _choice(name("ports"), need("ports"), ("fixed", "auto")) == "auto":
        _free_ports(raw, given, env)
    if raw["join"]:
        if "kv_store" in given:
            raise ConfigError(f"give {name('kv_store')} or {name('join')}, not both")
        raw["kv_store"] = f"etcd:{_joined_etcd(name('join'), Path(raw['join']))}"
    runtime = f"unix:{raw['runtime_socket']}" if raw["runtime_socket"] else need("runtime_port")
    serving = (
        f"unix:{raw['serving_socket']}"
        if raw["serving_socket"]
        else (raw["serving_port"] if raw["serving_port"] else runtime)
    )
    if not runtime.startswith("unix:"):
        _bounded(name("runtime_port"), runtime, 1, MAX_PORT)
    if not serving.startswith("unix:"):
        _bounded(name("serving_port"), serving, 1, MAX_PORT)
    advertise = raw["advertise_host"] or env.get("POD_IP") or env.get("WKUBE_POD_IPADDR") or "127.0.0.1"
    advertise = hostport.unbracket(advertise)  # `[fd00::7]` too; bracketed again where a port follows
    labels = tuple(x.strip() for x in (raw["labels"] or "").split(",") if x.strip())
    plane = _data_plane(name("data_plane"), need("data_plane"), name("haproxy"), need("haproxy"))
    config = Config(
        service_name=need("service_name"),
        kv_store=parse_kv_store(raw["kv_store"]) if raw["kv_store"] else None,
        kv_prefix=_kv_prefix(name("kv_prefix"), need("kv_prefix")),
        labels=labels,
        grpc_port=_bounded(name("grpc_port"), need("grpc_port"), 0, MAX_PORT),
        max_msg_size=_int(name("max_msg_size"), need("max_msg_size"), 1024),
        runtime_endpoint=runtime,
        serving_endpoint=serving,
        load_failure_expiry_ms=_int(name("load_failure_expiry_ms"), need("load_failure_expiry_ms"), 0),
        shutdown_timeout_ms=_int(name("shutdown_timeout_ms"), need("shutdown_timeout_ms"), 0),
        # Upstream: the last 12 characters of the pod name (WKUBE_POD_NAME in its pods).
        instance_id=_instance_id(
            name("instance_id"), raw["instance_id"] or env.get("WKUBE_POD_NAME", "")[-12:] or default_instance_id()
        ),
        peer_port=_bounded(name("peer_port"), need("peer_port"), 0, MAX_PORT),
        advertise_host=advertise,
        data_dir=Path(need("data_dir")),
        runtime_ready_timeout_s=float(_int(name("runtime_ready_timeout_s"), need("runtime_ready_timeout_s"), 1)),
        zone=raw["zone"] or "",
        service_version=_service_version(name("service_version"), raw["service_version"] or ""),
        default_vmodel_owner=raw["default_vmodel_owner"] or "",
        type_constraints=_type_constraints(raw["type_constraints"], raw["type_constraints_path"]),
        scaleup_rpm_threshold=_int(name("scaleup_rpm_threshold"), need("scaleup_rpm_threshold"), 1),
        rate_check_ms=_int(name("rate_check_ms"), need("rate_check_ms"), 100),
        janitor_ms=_int(name("janitor_ms"), need("janitor_ms"), 100),
        runtime_check_ms=_int(name("runtime_check_ms"), need("runtime_check_ms"), 100),
        leader_sweep_ms=_int(name("leader_sweep_ms"), need("leader_sweep_ms"), 100),
        dead_instance_prune_ms=_int(name("dead_instance_prune_ms"), need("dead_instance_prune_ms"), 0),
        copy_idle_ms=_int(name("copy_idle_ms"), raw["copy_idle_ms"], 0) if raw["copy_idle_ms"] else None,
        instance_ttl_s=_int(name("instance_ttl_s"), need("instance_ttl_s"), 2),
        drain_grace_ms=_int(name("drain_grace_ms"), need("drain_grace_ms"), 0),
        dataplane=_dataplane(raw["dataplane_config"], raw["dataplane_config_path"]),
        max_inflight_per_copy=_int(name("max_inflight_per_copy"), need("max_inflight_per_copy"), -(1 << 31)),
        conc_scaleup_bandwidth_pct=_bounded(
            name("conc_scaleup_bandwidth_pct"), need("conc_scaleup_bandwidth_pct"), 10, 200
        ),
        request_timeout_ms=_int(name("request_timeout_ms"), need("request_timeout_ms"), 0),
        eviction=_eviction(name("eviction"), need("eviction")),
        latency_target_ms=_int(name("latency_target_ms"), need("latency_target_ms"), 0),
        load_queue=_choice(name("load_queue"), need("load_queue"), ("value", "fifo")) == "value",
        llm_routing=_choice(name("llm_routing"), need("llm_routing"), ("load", "inflight")) == "load",
        load_wait_limit_ms=_int(name("load_wait_limit_ms"), need("load_wait_limit_ms"), 100),
        pull_deadline_ms=_int(name("pull_deadline_ms"), need("pull_deadline_ms"), 0),
        data_plane=plane[0],
        haproxy=plane[1],
        tls=_tls(raw, advertise),
        http_port=_http_port(name("http_port"), need("http_port")),
        model_repository=_directory(name("model_repository"), raw["model_repository"]),
        model_repository_type=raw["model_repository_type"] or "",
        metrics=_parsed(name("metrics"), need("metrics"), MetricsConfig.parse),
        log_each_invoke=_bool(name("log_each_invoke"), need("log_each_invoke")),
        log_format=_parsed(name("log_format"), need("log_format"), parse_log_format),
        max_headers_size=_bounded(name("max_headers_size"), need("max_headers_size"), 1024, MAX_GRPC_INT),
        watch_trace=_writable_file(name("watch_trace"), raw["watch_trace"]),
    )
    if config.data_plane == "native" and config.grpc_port == 0:
        raise ConfigError(f"{name('grpc_port')} is 0 (any free port), which HAProxy cannot bind: give it a port")
    if config.metrics.https and config.tls is None and not meshtls.can_self_sign():
        raise ConfigError(
            f"{name('metrics')}: scheme=https needs the instance certificate ({meshtls.CERT_ENV} and "
            f"{meshtls.KEY_ENV}) or, for a self-signed one, the cryptography package (a dependency of meshd)"
        )
    config = _upstream_pod(config, raw, env, name, metrics_given="metrics" in given)
    return replace(config, warnings=(*older_warnings, *config.warnings))


def _upstream_pod(
    config: Config,
    raw: Mapping[str, str | None],
    env: Mapping[str, str],
    name: Callable[[str], str],
    metrics_given: bool = True,
) -> Config:
    """The settings of upstream's pod contract, and the start-up warnings they bring.
    `metrics_given`: the user set the metrics setting (not meshd's default or MESHD_PORTS=auto's)."""
    warnings: list[str] = []
    metrics = config.metrics
    if metrics.https and config.tls is None:
        warnings.append(
            f"{name('metrics')}: scheme=https without {meshtls.CERT_ENV}: /metrics is served with a "
            "self-signed certificate made at start-up"
        )
    if metrics.enabled and metrics.https is None:
        # Upstream serves https when MM_METRICS names no scheme; meshd has a certificate only
        # with MM_TLS_*: https with it, else http (and says so of a setting the user wrote;
        # meshd's default and the port MESHD_PORTS=auto chose take this scheme silently).
        metrics = replace(metrics, https=config.tls is not None)
        if config.tls is None and metrics_given and raw["metrics"] != DEFAULT_METRICS:
            warnings.append(
                f"{name('metrics')} names no scheme: upstream would serve https; without "
                f"{meshtls.CERT_ENV} meshd serves /metrics over http (set scheme=http to silence this)"
            )
    age = raw["max_connection_age_s"]
    grace = raw["max_connection_age_grace_s"]
    processors = _parsed(name("payload_processors"), raw["payload_processors"] or "", parse_processors)
    none: tuple[AutoRegistration, ...] = ()
    auto = _json_setting(
        "MM_AUTO_REGISTER_MODELS",
        raw["auto_register"] or env.get("MM_AUTO_REGISTER_MODEL"),  # upstream reads both spellings
        raw["auto_register_path"] or env.get("MM_AUTO_REGISTER_MODEL_PATH"),
        parse_auto_register,
        none,
    )
    for var in sorted(env):
        reason = UPSTREAM_IGNORED.get(var)
        if reason is None and var.startswith(UPSTREAM_IGNORED_PREFIXES) and var not in OLDER:
            reason = "an older upstream name"
        if reason is not None and env[var]:
            warnings.append(f"{var} is set but meshd does not support it ({reason}); ignored")
    return replace(
        config,
        metrics=metrics,
        probe_port=_http_port(name("probe_port"), raw["probe_port"] or "8089"),
        prestop_port=_http_port(name("prestop_port"), raw["prestop_port"] or "8090"),
        max_connection_age_s=_int(name("max_connection_age_s"), age, 1) if age else None,
        max_connection_age_grace_s=_int(name("max_connection_age_grace_s"), grace, 0) if grace else None,
        payload_processors=processors,
        payload_capacity=_int(name("payload_capacity"), raw["payload_capacity"] or "64", 1),
        payload_senders=_bounded(name("payload_senders"), raw["payload_senders"] or "2", 1, 64),
        log_request_headers=_parsed(name("log_request_headers"), raw["log_request_headers"] or "", _header_fields),
        info_metrics=_parsed(name("info_metrics"), raw["info_metrics"] or "", lambda t: parse_info_metric(t, env)),
        kv_read_only=_bool(name("kv_read_only"), raw["kv_read_only"] or "false"),
        location=raw["location"] or "",
        auto_register=auto,
        type_constraints_path=Path(raw["type_constraints_path"]) if raw["type_constraints_path"] else None,
        dataplane_config_path=Path(raw["dataplane_config_path"]) if raw["dataplane_config_path"] else None,
        warnings=tuple(warnings),
    )


def _header_fields(text: str) -> dict[str, str]:
    """MM_LOG_REQUEST_HEADERS: `{"header-name": "log field"}` (header names case-insensitive)."""
    if not text.strip():
        return {}
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in obj.items()):
        raise ValueError('expected a JSON object of strings, {"header-name": "log field"}')
    return {k.lower(): v for k, v in obj.items()}


@dataclass(frozen=True, slots=True)
class InfoMetric:
    name: str
    labels: dict[str, str]


MAX_INFO_LABELS = 5  # upstream's limit


def parse_info_metric(text: str, env: Mapping[str, str]) -> InfoMetric | None:
    """MM_INFO_METRICS: `metric_name;label1=ENV_VAR1,label2=ENV_VAR2` (values read from the
    environment at start-up; an unset variable is an error, as upstream's)."""
    text = text.strip()
    if not text:
        return None
    metric, _, rest = text.partition(";")
    metric = metric.strip()
    if not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", metric):
        raise ValueError(f"{metric!r} is not a valid metric name")
    labels: dict[str, str] = {}
    for part in rest.split(","):
        if not part.strip():
            continue
        label, eq, var = (x.strip() for x in part.partition("="))
        if not eq or not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", label) or not var:
            raise ValueError(f"expected label=ENV_VAR, got {part.strip()!r}")
        if var not in env:
            raise ValueError(f"{var} (label {label}) is not set")
        labels[label] = env[var]
    if len(labels) > MAX_INFO_LABELS:
        raise ValueError(f"at most {MAX_INFO_LABELS} labels, got {len(labels)}")
    return InfoMetric(metric, labels)


@dataclass(frozen=True, slots=True)
class AutoRegistration:
    """One entry of MM_AUTO_REGISTER_MODELS (upstream's static registrations)."""

    model_id: str
    model_type: str
    model_path: str = ""
    model_key: str = ""
    vmodel_id: str = ""
    ensure_loaded: bool = False


def parse_auto_register(text: str) -> tuple[AutoRegistration, ...]:
    """`[{"modelId", "modelInfo": {"type", "path", "key"}, "vModelId"?, "ensureLoaded"?}]`."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(obj, list):
        raise ValueError("expected a JSON list of registrations")
    out: list[AutoRegistration] = []
    for i, entry in enumerate(obj):
        info = entry.get("modelInfo") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("modelId"), str) or not isinstance(info, dict):
            raise ValueError(f"entry {i}: needs a string 'modelId' and an object 'modelInfo'")
        if not isinstance(info.get("type"), str) or not info["type"]:
            raise ValueError(f"entry {i}: 'modelInfo' needs a non-empty string 'type'")
        out.append(
            AutoRegistration(
                entry["modelId"],
                info["type"],
                str(info.get("path") or ""),
                str(info.get("key") or ""),
                str(entry.get("vModelId") or ""),
                bool(entry.get("ensureLoaded", False)),
            )
        )
    return tuple(out)


def _tls(raw: Mapping[str, str | None], advertise_host: str) -> meshtls.MeshTls | None:
    """Parsed and, when on, read and checked now: a bad file is a start-up error."""
    try:
        settings = meshtls.parse_settings(
            raw["tls_key_cert"],
            raw["tls_private_key"],
            raw["tls_client_auth"],
            raw["tls_trust_certs"],
            raw["tls_private_key_passphrase"],
            raw["tls_peer_name"],
        )
        return meshtls.load(settings, advertise_host) if settings else None
    except meshtls.TlsConfigError as e:
        raise ConfigError(str(e)) from None


def _parsed(what: str, text: str, parse: Callable[[str], T]) -> T:
    try:
        return parse(text)
    except ValueError as e:
        raise ConfigError(f"{what}: {e}") from None


def _bool(what: str, text: str) -> bool:
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise ConfigError(f"{what} must be true or false (got {text!r})")
    return value == "true"


def _choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    lowered = value.strip().lower()
    if lowered not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)} (got {value!r})")
    return lowered


def _data_plane(name: str, value: str, haproxy_name: str, haproxy: str) -> tuple[str, str]:
    """MESHD_DATAPLANE resolved against the machine: native needs an HAProxy that runs."""
    mode = _choice(name, value, ("python", "native", "auto"))
    if mode == "python":
        return ("python", "")
    found = find_haproxy(haproxy.strip()) if haproxy.strip() else None
    if found is None:
        if mode == "auto":
            return ("python", "")
        raise ConfigError(
            f"{name} is native, which needs HAProxy 2.4 or later, and {haproxy_name} names {haproxy!r}, not an "
            "executable found here: install HAProxy (apt-get install haproxy; docs/native.md), point "
            f"{haproxy_name} at it, or use the Python data plane (MESHD_DATAPLANE=python)"
        )
    return ("native", found)


def _eviction(name: str, value: str) -> Eviction:
    try:
        return Eviction(value.strip().lower())
    except ValueError:
        choices = ", ".join(e.value for e in Eviction)
        raise ConfigError(f"{name} must be one of {choices} (got {value!r})") from None


def _json_setting(env: str, text: str | None, path: str | None, parse: Callable[[str], T], empty: T) -> T:
    """A JSON setting given inline (`env`) or in a file (`env`_PATH); errors name the setting."""
    if path:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"{env}_PATH: cannot read {path}: {e}") from None
    if not text:
        return empty
    try:
        return parse(text)
    except ValueError as e:
        raise ConfigError(f"{env}{'_PATH' if path else ''}: {e}") from None


def _type_constraints(text: str | None, path: str | None) -> TypeConstraints:
    return _json_setting("MM_TYPE_CONSTRAINTS", text, path, TypeConstraints.parse, TypeConstraints())


def _dataplane(text: str | None, path: str | None) -> DataplaneConfig:
    return _json_setting("MM_DATAPLANE_CONFIG", text, path, DataplaneConfig.parse, DataplaneConfig())


# Lower-cased. "none": upstream's start.sh turns the probe off with MM_PROBE_PORT=NONE.
HTTP_OFF = frozenset({"disabled", "off", "none"})


def _http_port(what: str, text: str) -> int | None:
    if text.strip().lower() in HTTP_OFF:
        return None
    try:
        return _bounded(what, text, 0, MAX_PORT)
    except ConfigError as e:
        raise ConfigError(f"{e} (or 'disabled' to serve no HTTP)") from None


def _instance_id(what: str, text: str) -> str:
    problem = instance_id_problem(text)
    if problem is not None:
        raise ConfigError(f"{what}: {problem} (got {text!r})")
    return text


def _directory(what: str, text: str | None) -> Path | None:
    if not text:
        return None
    path = Path(text)
    if not path.is_dir():
        raise ConfigError(f"{what}: {text!r} is not a directory")
    return path


def _writable_file(what: str, text: str | None) -> Path | None:
    """A file meshd appends to: opened for append now (and created), so a path it cannot
    write is a start-up error, not a traceback later."""
    if not text:
        return None
    path = Path(text)
    if not path.parent.is_dir():
        raise ConfigError(f"{what}: directory of {text!r} does not exist")
    if path.is_dir():
        raise ConfigError(f"{what}: {text!r} is a directory")
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ConfigError(f"{what}: cannot write {text!r}: {e.strerror or e}") from None
    return path


def _bounded(what: str, text: str, low: int, high: int) -> int:
    value = _int(what, text, low)
    if value > high:
        raise ConfigError(f"{what}: must be between {low} and {high}, got {value}")
    return value


def env_for(settings: Mapping[str, str | int]) -> dict[str, str]:
    """Environment for a child `meshd serve` from dest names (tests, demo)."""
    by_dest = {s.dest: s.env for s in SETTINGS}
    return {by_dest[k]: str(v) for k, v in settings.items()}


def serve_flags(settings: Mapping[str, str | int]) -> list[str]:
    by_dest = {s.dest: s.flag for s in SETTINGS}
    out: list[str] = []
    for k, v in settings.items():
        out += [by_dest[k], str(v)]
    return out


__all__: Sequence[str] = ["Config", "ConfigError", "add_serve_arguments", "env_for", "load_config", "serve_flags"]
