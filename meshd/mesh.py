"""Assembly: one meshd instance built from its Config, started and stopped as a whole.

The one place where store, tables, runtime client, local copies, router and servers
meet. Nothing else imports "everything".
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import shutil
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from aiohttp import web

from meshd import __version__
from meshd._proto.meshd import admin_pb2, peer_pb2
from meshd._proto.mmesh import model_mesh_pb2
from meshd.api.admin import MeshAdminServicer
from meshd.api.health import EXTERNAL_SERVICES, INTERNAL_SERVICES, Health
from meshd.api.kserve import MeshKServe
from meshd.api.kserve_core import KServeCore
from meshd.api.kserve_http import HttpServer, Infer
from meshd.api.management import Management
from meshd.api.modelmesh import ModelMeshServicer
from meshd.api.modelrepo import ModelDirectory
from meshd.api.openai_http import OpenAIHttp, Target
from meshd.api.parsing import add_servicer
from meshd.api.peer import PeerServicer
from meshd.api.probes import ProbeServer
from meshd.api.repository import MeshRepository
from meshd.config import Config
from meshd.core.clock import wall_ms
from meshd.core.errors import DeadlineExceeded, MeshError, NotFound
from meshd.core.hostport import join as host_port
from meshd.core.records import NATIVE_ADDRESS, NODE_LOCATION, RUNTIME_DOWN, InstanceRecord, ModelRecord, VModelRecord
from meshd.decisions.cache import CacheEntry, Eviction, State, to_units
from meshd.decisions.drain import grace_over
from meshd.decisions.fleet_clock import FleetClock, peer_readings
from meshd.decisions.ids import ModelInfo
from meshd.decisions.openai import CALL_METHOD
from meshd.decisions.placement.constraints import TypeConstraints, no_home_message
from meshd.decisions.placement.liveness import departed_for_ms
from meshd.decisions.placement.modelkey import at_max_copies
from meshd.decisions.placement.view import ClusterView
from meshd.decisions.publishing import Identity, RpmMeter, instance_record
from meshd.decisions.regret import fleet_order, peer_tallies
from meshd.kv.election import Election
from meshd.kv.embedded import URL_FILE as ETCD_URL_FILE
from meshd.kv.embedded import EmbeddedEtcd
from meshd.kv.etcd import EtcdStore
from meshd.kv.store import KVStore, StoreUnavailable
from meshd.kv.table import Table
from meshd.kv.watch_trace import WatchTrace
from meshd.loops.config_files import FileWatch
from meshd.loops.disk_watch import DiskWatch
from meshd.loops.dynamic_config import DynamicConfig
from meshd.loops.inventory import Inventory
from meshd.loops.leader import LeaderDuties, cluster_gauges
from meshd.loops.runtime_watch import RuntimeWatch
from meshd.loops.scaler import Scaler, ScalerConfig
from meshd.net.listen import bound_socket, ipv6_available
from meshd.observability.metrics import ClusterStats, InstanceStats, Metrics, MetricsServer, build_metrics
from meshd.observability.payloads import PayloadProcessors
from meshd.observability.tracing import Tracing
from meshd.observability.tracing import from_env as tracing_from_env
from meshd.registry.instances import InstancePublisher
from meshd.registry.models import Registry
from meshd.registry.vmodels import SetVModel, VModels
from meshd.runtime.client import RuntimeClient, RuntimeInfo, RuntimeNotReady
from meshd.runtime.endpoints import connection_age_options, internal_server_options, open_channel, server_options
from meshd.security.peer_auth import interceptors as peer_interceptors
from meshd.security.tls import bind, self_signed_server_context
from meshd.serving.cluster import Cluster
from meshd.serving.copies import CopyCounter
from meshd.serving.invocations import LOCAL, Invocations, records_calls
from meshd.serving.local import LocalModels
from meshd.serving.native import setup as native_setup
from meshd.serving.native.calls import CarriedCalls
from meshd.serving.native.haproxy import HAProxy, HAProxyError, haproxy_version
from meshd.serving.native.haproxy_config import CarriedCall, Layout, trailers_reset_bug
from meshd.serving.native.haproxy_config import render as render_haproxy
from meshd.serving.native.plane import NativePlane
from meshd.serving.peers import Peers, dial_plaintext
from meshd.serving.proxy.handler import InferenceHandler
from meshd.serving.proxy.headers import RequestIds
from meshd.serving.proxy.methods import DataplaneConfig, MethodSpec, MethodTable
from meshd.serving.proxy.peer_handler import PeerInferenceHandler
from meshd.serving.router import Answered, DirectOpen, Router

log = logging.getLogger(__name__)

KV_STARTUP_TIMEOUT_S = 20.0  # upstream fails fast when the KV store is unreachable at start
TRANSITION_CHECK_S = 1.0
DRAIN_POLL_S = 0.25
GRACE_POLL_S = 0.1
DRAIN_RESERVE_S = 5.0  # upstream stops waiting for reloads 5 s before the shutdown deadline


SERVING_CHECK_S = 10.0  # the runtime answered READY: its inference endpoint should answer at once
ID_RELEASE_GRACE_S = 2.0  # beyond the lease TTL, for etcd to delete a dead holder's record


MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
MODEL_METADATA = "/inference.GRPCInferenceService/ModelMetadata"


def http_call(
    router: Router, spec: MethodSpec | None, timeout_s: float | None, invocations: Invocations
) -> Infer | None:
    """A KServe V2 HTTP call as one call of the gRPC method `spec` through the router (None:
    the runtime does not serve it, and HTTP answers 501). Recorded like a gRPC call of it."""
    if spec is None:
        return None

    async def infer(request: bytes, ids: RequestIds, call_timeout_s: float | None) -> bytes:
        started = invocations.start()
        code = "OK"
        response = b""
        limit_s = timeout_s if call_timeout_s is None else call_timeout_s
        try:
            async with asyncio.timeout(limit_s):
                response = await router.unary(spec, request, ids, (), limit_s)
                return response
        except TimeoutError:
            code = "DEADLINE_EXCEEDED"
            whose = (
                "its timeout"
                if call_timeout_s is not None
                else "the default request timeout (MESHD_REQUEST_TIMEOUT_MS)"
            )
            raise DeadlineExceeded(f"no answer within {whose} of {limit_s:g} s") from None
        except MeshError as e:
            code = e.code.name
            raise
        except BaseException:
            code = "UNKNOWN"
            raise
        finally:
            invocations.done(spec.path, ids, code, started, len(request), len(response) if code == "OK" else -1)

    return infer


def openai_front(
    router: Router, registry: Registry, spec: MethodSpec | None, timeout_s: float | None, invocations: Invocations
) -> Callable[[web.Application], None]:
    """The OpenAI-compatible routes (api.openai_http) over the router: a call's `model` is
    resolved against the registry (a model, else a vmodel's active model), then carried as
    one meshd.llm.OpenAI/Call (`spec`; None: the runtime serves none)."""

    async def resolve(name: str) -> Target:
        model_id, vmodel_id = name, None
        record = registry.get(name)
        if record is None:
            try:
                record = await registry.fetch(name)
            except NotFound:
                model_id, vmodel_id = await router.resolve_vmodel(name), name
                record = await router.record(model_id)
        return Target(model_id, vmodel_id, record.type)

    async def route(
        request: bytes, ids: RequestIds, remaining_s: float | None, direct: DirectOpen | None, prefix: str | None
    ) -> Answered:
        assert spec is not None
        started = invocations.start()
        code = "OK"
        try:
            # The timeout bounds routing, loading and the first piece; the answer itself may run
            # long, so the call to the copy carries no deadline.
            async with asyncio.timeout(remaining_s):
                return await router.open_answered(spec, request, ids, (), None, direct, prefix)
        except MeshError as e:
            code = e.code.name
            raise
        except TimeoutError:
            code = "DEADLINE_EXCEEDED"
            raise
        except BaseException:
            code = "CANCELLED"
            raise
        finally:
            invocations.done(spec.path, ids, code, started, len(request), -1)

    def listing() -> list[tuple[str, str]]:
        models = [(model_id, record.type) for model_id, record in registry.models.items()]
        types = dict(models)
        vmodels = [(vid, types.get(v.active_model, "")) for vid, v in registry.vmodels.items()]
        return models + vmodels

    metrics = invocations.metrics
    note_tokens = metrics.llm_call if metrics.enabled else None  # off: nothing counted per piece
    return OpenAIHttp(resolve, route if spec is not None else None, listing, timeout_s, note_tokens).add_routes


class StartRefused(Exception):
    """Start-up stopped before anything was changed: a port taken, the instance id held by
    a live instance. One line, naming the setting to change (exit 2)."""


def listening_ports(cfg: Config) -> list[tuple[str, int]]:
    """(setting, port) of every port this instance listens on; 0 (any free port) left out."""
    ports = [("MM_SVC_GRPC_PORT (--grpc-port)", cfg.grpc_port), ("MESHD_PEER_PORT (--peer-port)", cfg.peer_port)]
    if cfg.http_port is not None:
        ports.append(("MESHD_HTTP_PORT (--http-port; or 'disabled')", cfg.http_port))
    if cfg.metrics.enabled:
        ports.append(("MM_METRICS (port=N; or 'disabled')", cfg.metrics.port))
    if cfg.probe_port is not None:
        ports.append(("MM_PROBE_PORT (--probe-port; or 'disabled')", cfg.probe_port))
    if cfg.prestop_port is not None:
        ports.append(("MM_PRESTOP_WAIT_PORT (--prestop-port; or 'disabled')", cfg.prestop_port))
    return [(what, port) for what, port in ports if port]


def check_ports_free(ports: Sequence[tuple[str, int]]) -> None:
    """StartRefused naming the first port another process listens on (or two settings that
    name one port). grpc would share a taken port (SO_REUSEPORT): two unrelated meshes then
    answer on one port. Checked before the store, the runtime or any record is touched."""
    seen: dict[int, str] = {}
    for what, port in ports:
        if port in seen:
            raise StartRefused(f"{what} and {seen[port]} both name port {port}: give each its own")
        seen[port] = what
        try:  # both families, as the servers bind; SO_REUSEADDR as they set it: TIME_WAIT is not "taken"
            bound_socket(None, port).close()
        except OSError as e:
            reason = "already in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
            raise StartRefused(
                f"port {port} is {reason} (another meshd on this host?): set {what} to a free port"
            ) from None


def _live_copies(record: ModelRecord, view: ClusterView) -> int:
    return sum(1 for iid in record.instance_ids if view.live(iid))


def _has_copy(registry: Registry, model_id: str) -> bool:
    rec = registry.get(model_id)
    return rec is not None and bool(rec.instance_ids)


@dataclass
class _Parts:
    """What one start-up step builds for the next (Instance.start)."""

    registry: Registry
    watch: RuntimeWatch
    disk: DiskWatch
    cluster: Cluster
    router: Router
    management: Management
    kserve: KServeCore | None = None
    invocations: Invocations | None = None
    timeout_s: float | None = None


@dataclass
class Instance:
    config: Config
    embedded: EmbeddedEtcd | None = None
    store: KVStore | None = None
    tables: list[Table[ModelRecord] | Table[VModelRecord] | Table[InstanceRecord]] = field(default_factory=list)
    instances: Table[InstanceRecord] | None = None
    publisher: InstancePublisher | None = None
    runtime: RuntimeClient | None = None
    local: LocalModels | None = None
    servers: list[grpc.aio.Server] = field(default_factory=list)
    http: HttpServer | None = None
    health: list[Health] = field(default_factory=list)
    serving_channel: grpc.aio.Channel | None = None
    peers: Peers | None = None
    vmodels: VModels | None = None
    router: Router | None = None
    copies: CopyCounter | None = None
    election: Election | None = None
    peer_servicer: PeerServicer | None = None
    tracing: Tracing | None = None  # None at start: as the OTEL_* variables say (usually off)
    background: list[asyncio.Task[None]] = field(default_factory=list)
    metrics_server: MetricsServer | None = None
    grpc_port: int = 0
    peer_port: int = 0
    http_port: int | None = None
    shutting_down: bool = False
    watch_trace: WatchTrace | None = None
    serving: bool = False  # /ready: set once start() completes, cleared when stopping
    probes: ProbeServer | None = None
    payloads: PayloadProcessors | None = None
    file_watches: list[FileWatch] = field(default_factory=list)
    # /prestop: the same shutdown entry SIGTERM uses (set by `serve`); returns once stopped
    on_prestop: Callable[[], Awaitable[None]] | None = None
    background_stop: asyncio.Task[None] | None = None
    native: NativePlane | None = None  # MESHD_DATAPLANE=native
    native_dir: Path | None = None
    native_calls: CarriedCalls | None = None
    haproxy: HAProxy | None = None  # checked at start-up, started once the Python path listens
    native_layout: Layout | None = None
    haproxy_version: str = ""

    def __post_init__(self) -> None:
        self.metrics: Metrics = build_metrics(self.config.metrics)
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        """Start in named steps; each refusal comes before the runtime purges its models."""
        await self._preflight()
        registry = await self._start_store()
        info, methods = await self._start_runtime(registry)
        parts = await self._assemble(registry, info)
        await self._start_servers(parts, info, methods)
        await self._start_http(parts, methods)
        await self._start_loops(parts, methods)

    async def _preflight(self) -> None:
        """Warnings, free ports, HAProxy, probes and tracing: checked before anything changes."""
        cfg = self.config
        for warning in cfg.warnings:
            log.warning("%s", warning)
        # Everything that can refuse start-up is checked before the runtime is asked for its
        # status (it purges its models then): a mistaken second meshd must not wipe them.
        check_ports_free(listening_ports(cfg))
        if cfg.data_plane == "native":
            await self._check_native()
        await self._start_probes()
        if self.tracing is None:
            self.tracing = tracing_from_env(cfg.instance_id)

    async def _start_store(self) -> Registry:
        """The store (refusing an instance id a live instance holds) and its mirrored tables."""
        cfg = self.config
        self.store = await self._open_store()
        prefix = cfg.key_prefix
        await self._check_id_free(f"{prefix}/instances/{cfg.instance_id}")
        models: Table[ModelRecord] = Table(self.store, f"{prefix}/registry/", ModelRecord.decode, ModelRecord.encode)
        vmodels: Table[VModelRecord] = Table(self.store, f"{prefix}/vmodels/", VModelRecord.decode, VModelRecord.encode)
        self.instances = Table(self.store, f"{prefix}/instances/", InstanceRecord.decode, InstanceRecord.encode)
        if cfg.watch_trace is not None:
            self.watch_trace = WatchTrace(cfg.watch_trace)
            models.on_applied = self.watch_trace
        for table in (models, vmodels, self.instances):
            await table.start()
            self.tables.append(table)
        return Registry(models, vmodels)

    async def _start_runtime(self, registry: Registry) -> tuple[RuntimeInfo, MethodTable]:
        """The runtime READY (it purged its models), the methods it serves, the local copies."""
        cfg = self.config
        self.runtime = RuntimeClient(cfg.runtime_endpoint, cfg.max_msg_size)
        info = await self.runtime.wait_ready(timeout_s=cfg.runtime_ready_timeout_s)
        log.info(
            "runtime %s READY: capacity %d bytes, %d loading threads",
            info.version,
            info.capacity_bytes,
            info.max_loading_concurrency,
        )
        try:
            methods = MethodTable(
                {m: i.id_injection_path for m, i in info.method_infos.items()}, info.allow_any_method, cfg.dataplane
            )
        except ValueError as e:
            raise RuntimeNotReady(f"runtime at {cfg.runtime_endpoint} reported unusable methodInfos: {e}") from None
        self.local = LocalModels(
            cfg.instance_id,
            registry,
            self.runtime,
            info,
            failure_expiry_ms=cfg.load_failure_expiry_ms,
            max_queue_per_copy=cfg.max_inflight_per_copy,
            eviction=cfg.eviction,
            latency_target_ms=cfg.latency_target_ms,
            metrics=self.metrics,
            load_queue=cfg.load_queue,
            load_wait_limit_ms=cfg.load_wait_limit_ms,
            pull_deadline_ms=cfg.pull_deadline_ms,
        )
        # The runtime purged its models before READY: any copy records naming us are stale.
        await self.local.reconcile()
        registry.models.listeners.append(self._on_model_change)
        return info, methods

    async def _assemble(self, registry: Registry, info: RuntimeInfo) -> _Parts:
        """The instance record's publisher, the cluster view, the router, vmodels and management."""
        cfg = self.config
        assert self.local is not None and self.instances is not None and self.store is not None
        prefix = cfg.key_prefix
        local = self.local
        watch = RuntimeWatch(local, cfg.runtime_check_ms / 1000)
        assert self.runtime is not None
        disk = DiskWatch(self.runtime)  # the runtime's disk tier, when it has one (issue 42)
        me = Identity(
            cfg.instance_id,
            host_port(cfg.advertise_host, cfg.peer_port),  # `[v6]:port` for an IPv6 pod IP
            cfg.zone,
            cfg.labels,
            wall_ms(),
            cfg.service_version or __version__,
        )
        meter = RpmMeter()
        fleet = FleetClock()
        instances = self.instances

        def build() -> InstanceRecord:
            now = wall_ms()
            # The fleet's cache clock moves with peers' evictions as their records show them.
            step = fleet.step(peer_readings(instances.items(), cfg.instance_id))
            local.cache.follow_fleet(step.fleet_size, step.advance, step.floor)
            regret = local.cache.regret
            if regret is not None:  # the adaptive order follows the fleet's regret
                local.cache.follow_order(fleet_order(regret, peer_tallies(instances.items(), cfg.instance_id)))
            rpm = meter.rpm(local.counters.served, now)  # forwarded requests are not load here
            # A runtime that does not answer takes no models: placement skips "shutting down" ones.
            stopping = self.shutting_down or not watch.up
            record = instance_record(
                me, local.cache, local.queue.threads, local.loads_in_progress, rpm, stopping, now, disk.value
            )
            if not watch.up:  # tells operators a dead runtime from a drain
                record.extra[RUNTIME_DOWN] = True
            if cfg.location:  # MM_LOCATION (the node's address); `loc` is the address peers dial
                record.extra[NODE_LOCATION] = cfg.location
            if self.native is not None:  # peers send warm requests for our copies here
                record.extra[NATIVE_ADDRESS] = host_port(cfg.advertise_host, self.grpc_port)
            return record

        self.publisher = InstancePublisher(
            self.store,
            f"{prefix}/instances/{cfg.instance_id}",
            build,
            cfg.instance_ttl_s,
            mirror=instances,
        )
        publisher = self.publisher

        def local_changed() -> None:
            publisher.kick()
            if self.native is not None:
                self.native.kick()

        local.on_change = local_changed
        watch.on_change = self.publisher.kick
        disk.on_change = self.publisher.kick

        self.serving_channel = open_channel(cfg.serving_endpoint, cfg.max_msg_size)
        if cfg.serving_endpoint != cfg.runtime_endpoint:
            await self._check_serving(self.serving_channel)
        self.peers = Peers(cfg.max_msg_size, cfg.tls.dial_peer if cfg.tls else dial_plaintext)
        cluster = Cluster(
            cfg.instance_id,
            self.instances,
            self.peers,
            local.queue.assume_loaded.ms,
            to_units(info.default_model_size),
            departed_ms=departed_for_ms(cfg.instance_ttl_s * 1000),
        )
        local.cluster_view = cluster.view  # the max-copies rule counts serving holders only
        router = Router(
            self.local,
            registry,
            self.serving_channel,
            cluster,
            self.peers,
            cfg.load_failure_expiry_ms,
            constraints=cfg.type_constraints,
            labels=frozenset(cfg.labels),
            metrics=self.metrics,
            tracing=self.tracing,
            note_served=self.metrics.enabled or cfg.log_each_invoke,  # what Invocations reads
        )
        router.runtime_unreachable = watch.suspect
        router.llm_routing = cfg.llm_routing
        self.copies = CopyCounter(registry, cluster, self.local, self.peers)

        async def before_rejoin() -> None:
            # Back from a lost lease (frozen, cut off): drop copies reloaded elsewhere up to
            # their max before peers can count this instance's again, judged on mirrors
            # brought up to date first (the watch may still be delivering the time away).
            await asyncio.gather(instances.catch_up(), registry.models.catch_up())
            await local.reconcile(set(cluster.view().instances) - {cfg.instance_id})

        self.publisher.before_rejoin = before_rejoin

        async def ensure_loading(model_id: str) -> None:
            # Best effort: the change is already committed; the leader's loop places too.
            if not _has_copy(registry, model_id):  # a load under way or done counts
                try:
                    await router.place(model_id, last_used_ms=wall_ms())
                except Exception as e:
                    log.warning("could not start loading %s: %s", model_id, e)

        self.vmodels = VModels(
            registry,
            cfg.default_vmodel_owner,
            self.copies,
            ensure_loading,
            failure_expiry_ms=cfg.load_failure_expiry_ms,
        )
        self.router = router

        def no_home(model_type: str) -> str | None:
            required = router.constraints.for_type(model_type)[0]
            return no_home_message(model_type, required, (i.labels for i in cluster.view().serving))

        async def place(model_id: str, last_used_ms: int) -> str | None:
            return await router.place(model_id, last_used_ms=last_used_ms)

        copies = self.copies
        management = Management(
            cfg.instance_id,
            registry,
            self.local,
            cfg.load_failure_expiry_ms,
            live_instances=lambda: cluster.view().instances.keys(),
            place=place,  # registerModel(loadNow) and ensureLoaded place through the cluster
            peer_states=copies.peer_states,
            no_home=no_home,
            sync_timeout_s=info.loading_timeout_ms / 1000 * 2,
        )
        return _Parts(registry, watch, disk, cluster, router, management)

    async def _start_servers(self, parts: _Parts, info: RuntimeInfo, methods: MethodTable) -> None:
        """The external and internal gRPC servers, the native data plane, HTTP and metrics."""
        cfg = self.config
        assert self.local is not None and self.instances is not None
        assert self.copies is not None and self.peers is not None and self.vmodels is not None
        registry, cluster, router, management = parts.registry, parts.cluster, parts.router, parts.management
        local = self.local
        external = grpc.aio.server(
            options=[
                *server_options(cfg.max_msg_size, cfg.max_headers_size),
                *connection_age_options(cfg.max_connection_age_s, cfg.max_connection_age_grace_s),
            ]
        )
        servicer = ModelMeshServicer(
            management,
            self.vmodels,
            info.loading_timeout_ms / 1000 * 2,
            count_copies=self.copies.refresh,
            wait_loaded=self._wait_loaded,
            read_only=cfg.kv_read_only,
        )
        add_servicer(external, model_mesh_pb2.DESCRIPTOR.services_by_name["ModelMesh"], servicer)
        inventory = Inventory(registry, cluster, self.local, self.peers, cfg.load_failure_expiry_ms)
        admin = MeshAdminServicer(
            inventory, self.instances, lambda: self.election.leader_id if self.election is not None else None
        )
        add_servicer(external, admin_pb2.DESCRIPTOR.services_by_name["MeshAdmin"], admin)
        timeout_s = cfg.request_timeout_ms / 1000 if cfg.request_timeout_ms else None
        directory = None
        if cfg.model_repository is not None:
            directory = ModelDirectory(cfg.model_repository, cfg.model_repository_type)
        kserve = KServeCore(
            management.status,
            lambda: not self.shutting_down,
            MeshRepository(management, router, directory),
            router.resolve_vmodel,
        )
        handlers = MeshKServe(kserve).handlers
        if cfg.payload_processors:
            self.payloads = PayloadProcessors(
                cfg.payload_processors, cfg.payload_capacity, cfg.payload_senders, self.metrics
            )
            await self.payloads.start()
        if cfg.info_metrics is not None:
            self.metrics.info(cfg.info_metrics.name, cfg.info_metrics.labels)
        invocations = Invocations(
            self.metrics, cfg.log_each_invoke, cfg.instance_id, self.payloads, cfg.log_request_headers
        )
        external.add_generic_rpc_handlers([InferenceHandler(router, methods, timeout_s, handlers, invocations)])
        tls = cfg.tls
        if self.native_dir is not None:
            # HAProxy takes the external port; the Python path listens on a private socket behind it.
            bind(external, f"unix:{self.native_dir / 'python.sock'}", None)
            self.grpc_port = cfg.grpc_port
        else:
            self.grpc_port = bind(
                external, f"0.0.0.0:{cfg.grpc_port}", tls.external_server_credentials() if tls else None
            )
        self.health.append(Health(external, EXTERNAL_SERVICES))

        # With TLS on, the handshake admits certificates the mesh trusts; the interceptor then
        # admits only mesh instances among them (meshd.security.peer_auth), on every internal service.
        internal = grpc.aio.server(
            options=internal_server_options(cfg.max_msg_size, cfg.max_headers_size),
            interceptors=peer_interceptors(tls),
        )
        self.peer_servicer = PeerServicer(cfg.instance_id, self.local, registry)
        add_servicer(internal, peer_pb2.DESCRIPTOR.services_by_name["MeshPeer"], self.peer_servicer)
        internal.add_generic_rpc_handlers([PeerInferenceHandler(router, methods)])
        self.peer_port = bind(internal, f"0.0.0.0:{cfg.peer_port}", tls.internal_server_credentials() if tls else None)
        self.health.append(Health(internal, INTERNAL_SERVICES))
        for server in (external, internal):
            await server.start()
            self.servers.append(server)
        if self.native_dir is not None:
            carried = native_setup.carried_methods(methods, info.method_infos, handlers.keys())
            if self.payloads is not None:  # processors see every payload: HAProxy's never reach Python
                log.warning("MM_PAYLOAD_PROCESSORS is set: the native data plane carries nothing natively")
                carried = {}
            self.native = await self._start_native(carried, cluster, registry, info, invocations)
            router.noticed = self.native.noticed
            local.before_unload = self.native.withdraw
            native = self.native
            self.peer_servicer.data_plane = "native"
            self.peer_servicer.native_carried = lambda: native.counts.carried
        parts.kserve = kserve
        parts.invocations = invocations
        parts.timeout_s = timeout_s

    async def _start_http(self, parts: _Parts, methods: MethodTable) -> None:
        """The HTTP port (KServe V2 REST) and the metrics endpoint."""
        cfg = self.config
        tls = cfg.tls
        router, kserve, invocations, timeout_s = parts.router, parts.kserve, parts.invocations, parts.timeout_s
        assert kserve is not None and invocations is not None
        if cfg.http_port is not None:
            ssl_context = tls.http_server_context() if tls else None
            self.http = HttpServer(
                kserve,
                None,  # every address, IPv4 and IPv6
                cfg.http_port,
                ssl_context=ssl_context,
                infer=http_call(router, methods.spec(MODEL_INFER), timeout_s, invocations),
                max_body_bytes=cfg.max_msg_size,
                model_metadata=http_call(router, methods.spec(MODEL_METADATA), timeout_s, invocations),
                more_routes=openai_front(router, parts.registry, methods.spec(CALL_METHOD), timeout_s, invocations),
            )
            self.http_port = await self.http.start()
        if cfg.metrics.enabled:  # bound before peers can see the instance: a taken port fails start-up
            https = tls.metrics_server_context() if cfg.metrics.https and tls else None
            if cfg.metrics.https and tls is None:  # scheme=https with no MM_TLS_* certificate
                https = self_signed_server_context()
            self.metrics_server = MetricsServer(self.metrics, cfg.metrics.port, ssl_context=https)
            await self.metrics_server.start()

    async def _start_loops(self, parts: _Parts, methods: MethodTable) -> None:
        """Health SERVING, the instance record, the election and the background loops; then serving."""
        cfg = self.config
        assert self.local is not None and self.publisher is not None
        assert self.store is not None and self.peer_servicer is not None
        registry, cluster, router, management = parts.registry, parts.cluster, parts.router, parts.management
        local = self.local
        prefix = cfg.key_prefix
        tls = cfg.tls
        for h in self.health:
            await h.set_serving(True)
        await self.publisher.start()  # last: peers see the instance only once it serves
        self.election = Election(
            self.store,
            f"{prefix}/leaderLatch/",  # upstream's election path
            cfg.instance_id,
            cfg.instance_id.encode(),
            cfg.instance_ttl_s,
            lease=self.publisher.lease,
            on_change=lambda leading: log.info("leadership %s", "gained" if leading else "lost"),
        )
        await self.election.start()
        duties = LeaderDuties(
            self.election,
            registry,
            cluster.view,
            router.place,
            self.local.initial_units,
            cfg.load_failure_expiry_ms,
            sweep_ms=cfg.leader_sweep_ms,
            prune_after_ms=cfg.dead_instance_prune_ms,
            upstream_ids=cluster.upstream_ids,
        )
        election = self.election
        self.peer_servicer.gauges = lambda: duties.gauges if election.is_leader else None
        self._watch_gauges(local, cluster, registry, election)
        self.background.append(asyncio.create_task(duties.run(), name="leader duties"))
        self.background.append(asyncio.create_task(self._transitions(), name="vmodel transitions"))
        scaler = Scaler(
            ScalerConfig(
                cfg.rate_check_ms, cfg.scaleup_rpm_threshold, cfg.copy_idle_ms, cfg.conc_scaleup_bandwidth_pct
            ),
            self.local,
            registry,
            cluster,
            router,
        )
        self.background.append(asyncio.create_task(scaler.run(), name="copy scaling"))
        dynamic = DynamicConfig(  # upstream's run-time settings (config/)
            self.store, prefix, cfg.log_each_invoke, cfg.scaleup_rpm_threshold, scaler, router, parts.invocations
        )
        self.background.append(asyncio.create_task(dynamic.run(), name="dynamic config"))
        self.background.append(asyncio.create_task(parts.watch.run(), name="runtime watch"))
        self.background.append(asyncio.create_task(parts.disk.run(), name="disk tier"))
        self.background.append(asyncio.create_task(self._janitor(cfg.janitor_ms / 1000, cluster), name="janitor"))
        self._watch_files(router, methods)
        for w in self.file_watches:
            self.background.append(asyncio.create_task(w.run(), name=f"watch {w.what}"))
        await self._auto_register(management)
        self.serving = True  # /ready from now on
        log.info(
            "meshd instance %s serving: grpc %d, peer %d, http %s, registry %s/, %s",
            cfg.instance_id,
            self.grpc_port,
            self.peer_port,
            self.http_port if self.http_port is not None else "disabled",
            prefix,
            tls.describe() if tls else "plaintext",
        )
        if self.native is not None:
            log.info("data plane: native (%s), meshd its control plane", self.native.describe)
        else:
            log.info("data plane: python (MESHD_DATAPLANE=native carries warm requests through HAProxy)")

    async def _check_native(self) -> None:
        """HAProxy runs and takes its configuration: checked before the runtime is asked for
        anything (it purges its models then), so a mistake there changes nothing."""
        cfg = self.config
        try:
            version = await haproxy_version(cfg.haproxy)
        except HAProxyError as e:
            raise StartRefused(f"MESHD_DATAPLANE=native: {e}") from None
        one_per_connection = trailers_reset_bug(version)
        if one_per_connection:
            log.warning(
                "%s resets a busy HTTP/2 connection to the runtime when a response's trailers wait"
                " behind data (HAProxy issue #2388, fixed in 2.9.1 and 3.0): each request gets a"
                " connection of its own, at about half the throughput for small requests; HAProxy"
                " 2.9.1 or later (3.0 LTS) carries them at full speed",
                version.split(" - ")[0],
            )
        directory = self.native_dir = native_setup.workdir()
        tls_files = native_setup.write_tls_files(cfg.tls, directory) if cfg.tls else None
        # Per-call records (metrics, invoke log) of natively carried calls, when calls are recorded.
        records = records_calls(cfg.metrics.enabled, cfg.log_each_invoke, bool(cfg.payload_processors))
        layout = native_setup.layout(
            cfg.grpc_port,
            directory / "python.sock",
            cfg.serving_endpoint,
            directory,
            tls_files,
            cfg.request_timeout_ms > 0,
            directory / "log.sock" if records else None,
            cfg.max_headers_size,
            cfg.max_msg_size,
            dual_stack=ipv6_available(),
            request_per_connection=one_per_connection,
        )
        maps = [layout.methods_map, layout.local_map, layout.peers_map, layout.vmodels_map]
        self.haproxy = HAProxy(cfg.haproxy, render_haproxy(layout), directory, maps, layout.api_socket)
        self.native_layout = layout
        try:
            self.haproxy_version = await self.haproxy.check()
        except HAProxyError as e:
            shutil.rmtree(directory, ignore_errors=True)
            raise StartRefused(f"MESHD_DATAPLANE=native: {e}") from None

    async def _start_native(
        self,
        carried: dict[str, str],
        cluster: Cluster,
        registry: Registry,
        info: RuntimeInfo,
        invocations: Invocations,
    ) -> NativePlane:
        cfg = self.config
        assert self.local is not None and self.haproxy is not None and self.native_layout is not None
        haproxy, layout = self.haproxy, self.native_layout
        log_socket = Path(layout.log_socket) if layout.log_socket is not None else None
        version = self.haproxy_version
        plane = NativePlane(
            haproxy,
            layout,
            self.local,
            registry.models,
            registry.vmodels,
            cluster.view,
            lambda: carried,
            self.local.queue.assume_loaded.ms,
            wall_ms,
        )
        plane.describe = f"{version.split(' - ')[0]} at {cfg.haproxy}, port {cfg.grpc_port}"
        if log_socket is not None:
            metrics = self.metrics

            def record(call: CarriedCall) -> None:
                served_by = plane.served_by(call.backend)
                invocations.carried(
                    call.method, call.model_id, call.vmodel_id, call.code, call.ms,
                    call.req_bytes, call.resp_bytes, served_by,
                )  # fmt: skip
                if served_by == LOCAL and call.runtime_ms >= 0:
                    metrics.invoke_model(call.method, call.code, call.runtime_ms, call.model_id)

            self.native_calls = CarriedCalls(log_socket, record)
            self.native_calls.start()
        try:
            await plane.start()
        except HAProxyError as e:
            raise StartRefused(f"MESHD_DATAPLANE=native: {e}") from None
        return plane

    async def stopped(self) -> None:
        """Returns once `stop` has finished."""
        await self._stopped.wait()

    async def _start_probes(self) -> None:
        """/live, /ready and /prestop: first, so liveness answers while start-up waits."""
        cfg = self.config
        if cfg.probe_port is None and cfg.prestop_port is None:
            return

        async def prestop() -> None:
            if self.on_prestop is not None:
                await self.on_prestop()
                return
            # Not run by `serve` (tests, demo): stop here, draining as SIGTERM does.
            if not self.shutting_down:
                self.background_stop = asyncio.create_task(self.stop(drain=True), name="prestop")
            await self._stopped.wait()

        self.probes = ProbeServer(
            None,  # every address, IPv4 and IPv6: the kubelet probes the pod IP
            cfg.probe_port,
            cfg.prestop_port,
            ready=lambda: self.serving and not self.shutting_down,
            prestop=prestop,
        )
        await self.probes.start()

    def _watch_files(self, router: Router, methods: MethodTable) -> None:
        """Follow MM_TYPE_CONSTRAINTS_PATH and MM_DATAPLANE_CONFIG_PATH as their ConfigMap changes."""
        cfg = self.config

        def constraints(text: str) -> None:
            router.constraints = TypeConstraints.parse(text) if text.strip() else TypeConstraints()

        def dataplane(text: str) -> None:
            methods.reconfigure(DataplaneConfig.parse(text) if text.strip() else DataplaneConfig())

        if cfg.type_constraints_path is not None:
            self.file_watches.append(FileWatch("MM_TYPE_CONSTRAINTS_PATH", cfg.type_constraints_path, constraints))
        if cfg.dataplane_config_path is not None:
            self.file_watches.append(FileWatch("MM_DATAPLANE_CONFIG_PATH", cfg.dataplane_config_path, dataplane))

    async def _auto_register(self, management: Management) -> None:
        """MM_AUTO_REGISTER_MODELS: registered (and their vmodels set) at start-up; an entry
        that fails is logged, not fatal (another instance may have registered it differently)."""
        assert self.vmodels is not None
        for entry in self.config.auto_register:
            info = ModelInfo(entry.model_type, entry.model_path, entry.model_key)
            try:
                if entry.vmodel_id:
                    await self.vmodels.set_vmodel(
                        SetVModel(
                            vmodel_id=entry.vmodel_id,
                            target_model_id=entry.model_id,
                            model_info=info,
                            load_now=entry.ensure_loaded,
                        )
                    )
                else:
                    await management.register(entry.model_id, info, entry.ensure_loaded, False, 0)
                log.info("auto-registered %s", entry.model_id)
            except Exception as e:
                log.warning("auto-registration of %s failed: %s", entry.model_id, e)

    def _watch_gauges(self, local: LocalModels, cluster: Cluster, registry: Registry, election: Election) -> None:
        """/metrics: instance gauges from the cache, cluster gauges (fresh) while leading."""
        cfg = self.config
        if not cfg.metrics.enabled:
            return

        def instance() -> InstanceStats:
            now = wall_ms()
            cache = local.cache
            loaded = sum(1 for e in cache.entries() if e.state is State.LOADED)
            q = local.queue
            upstream = len(cluster.upstream_ids())
            return InstanceStats(
                cache.lru_ms(now),
                now,
                cache.capacity_units,
                cache.used_units,
                loaded,
                loads_waiting=q.waiting,
                loads_in_progress=q.in_progress,
                upstream_instances=upstream,
                eviction_frequency_weight=cache.frequency_weight if cache.eviction is Eviction.ADAPTIVE else None,
                eviction_odds_overruled=cache.overruled,
            )

        def leader() -> ClusterStats | None:
            if not election.is_leader:
                return None
            g = cluster_gauges(cluster.view(), dict(registry.models.items()), cfg.load_failure_expiry_ms)
            return ClusterStats(g.models_managed, g.models_loaded, g.models_with_failure)

        self.metrics.watch_instance(instance)
        self.metrics.watch_cluster(leader)

    async def _open_store(self) -> KVStore:
        cfg = self.config
        if cfg.kv_store is not None:
            url = cfg.kv_store.describe()
            store = EtcdStore(cfg.kv_store)
            log.info("etcd: %s", url)
        else:
            data = cfg.data_dir / "etcd"
            self.embedded = EmbeddedEtcd(data, log_dir=cfg.data_dir, die_with_parent=True)
            self.embedded.spawn()  # from the loop's thread, which lives as long as meshd: etcd dies with it
            await asyncio.to_thread(self.embedded.wait_serving)
            url = self.embedded.url
            url_file = cfg.data_dir / ETCD_URL_FILE
            url_file.write_text(url + "\n", encoding="utf-8")  # for `meshd serve --join` beside it
            log.info("embedded etcd pid %s at %s (data %s; its address in %s)", self.embedded.pid, url, data, url_file)
            store = EtcdStore.from_url(url)
        deadline = asyncio.get_running_loop().time() + KV_STARTUP_TIMEOUT_S
        while True:
            try:
                # One key, not the registry: with 100k records a listing here cost a second
                # full read at start-up (the mirror lists it anyway).
                await store.get(self.config.key_prefix + "/registry/")
                return store
            except StoreUnavailable as e:
                if asyncio.get_running_loop().time() > deadline:
                    await store.close()
                    raise StoreUnavailable(f"etcd at {url} unreachable for {KV_STARTUP_TIMEOUT_S:.0f}s: {e}") from e
                await asyncio.sleep(0.5)

    async def _check_id_free(self, key: str) -> None:
        """StartRefused while another live instance holds this instance id. A record left by
        a holder that died goes with its lease: waited for up to one lease TTL."""
        assert self.store is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.instance_ttl_s + ID_RELEASE_GRACE_S
        held = await self.store.get(key)
        if held is not None:
            log.info("instance id %s has a record; waiting up to one lease TTL for it to go", self.config.instance_id)
        while held is not None:
            if loop.time() >= deadline:
                raise StartRefused(
                    f"instance id {self.config.instance_id!r} is held by a live instance (its record "
                    f"{key} is kept alive): set MESHD_INSTANCE_ID (--instance-id) to another id"
                )
            await asyncio.sleep(0.5)
            held = await self.store.get(key)

    async def _check_serving(self, channel: grpc.aio.Channel) -> None:
        """The runtime's inference endpoint answers (a wrong --serving-port was only found
        at the first inference)."""
        cfg = self.config
        try:
            await asyncio.wait_for(channel.channel_ready(), SERVING_CHECK_S)
        except TimeoutError:
            raise RuntimeNotReady(
                f"the runtime's inference endpoint {cfg.serving_endpoint} does not answer "
                f"(its management endpoint {cfg.runtime_endpoint} does): check INTERNAL_SERVING_GRPC_PORT "
                "(--serving-port) or INTERNAL_SERVING_GRPC_SOCKET_PATH (--serving-socket)"
            ) from None

    def _on_model_change(self, model_id: str, old: ModelRecord | None, new: ModelRecord | None) -> None:
        # Unregistered elsewhere: unload our copy.
        if new is None and self.local is not None and model_id in self.local.cache:
            self.local.drop(model_id)

    async def _transitions(self) -> None:
        """The leader moves vmodels to their targets once loaded (each switch is a CAS).

        Targets get copies placed up to the active model's count.
        """
        assert self.vmodels is not None and self.router is not None and self.copies is not None
        while True:
            await asyncio.sleep(TRANSITION_CHECK_S)
            if self.election is None or not self.election.is_leader:
                continue
            try:
                wanted = self.vmodels.transition_targets()
                if not wanted:
                    continue
                vtable = self.router.registry.vmodels
                actives = [v.active_model for _, v in vtable.items() if v.active_model != v.target_model]
                await self.copies.refresh([*wanted, *actives])
                for target, count in wanted.items():
                    rec = self.router.registry.get(target)
                    if rec is not None and _live_copies(rec, self.router.cluster.view()) < count:
                        await self.router.place(target)
                await self.vmodels.complete_transitions()
            except Exception:
                log.exception("vmodel transition check failed")

    async def _wait_loaded(self, model_id: str, timeout_s: float) -> None:
        """Until some instance holds a loaded copy of the model, or `timeout_s` passes."""
        assert self.copies is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            await self.copies.refresh([model_id])
            if self.copies(model_id) > 0:
                return
            await asyncio.sleep(0.1)

    async def _janitor(self, interval_s: float, cluster: Cluster) -> None:
        assert self.local is not None
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.local.reconcile(set(cluster.view().instances))
            except Exception:
                log.exception("janitor run failed")

    async def drain(self, budget_s: float) -> None:
        """Hand this instance's models to others before leaving (SIGTERM).

        The shutdown flag goes out at once (placement stops choosing this instance), then
        its models are loaded elsewhere most recently used first, while this instance
        keeps serving them, until each has a loaded copy elsewhere or the budget is spent.
        Upstream refuses held models during drain (modelmesh#142); meshd keeps serving.
        """
        if self.local is None or self.router is None or self.copies is None or self.publisher is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget_s
        with contextlib.suppress(Exception):
            await self.publisher.publish_now()
        held = sorted(
            (e for e in self.local.cache.entries() if e.state is State.LOADED),
            key=lambda e: e.last_used_ms,
            reverse=True,
        )
        me = frozenset({self.config.instance_id})
        local = self.local
        copies = self.copies

        def elsewhere(model_id: str) -> int:
            entry = local.cache.get(model_id)
            return copies(model_id) - int(entry is not None and entry.state is State.LOADED)

        pending: list[str] = []
        homeless = 0
        handover: list[CacheEntry] = []
        router = self.router

        async def place_elsewhere(entry: CacheEntry) -> None:
            nonlocal homeless
            if await router.place(entry.model_id, exclude=me, last_used_ms=entry.last_used_ms) is None:
                log.warning("no other instance can take %s; it goes with this one", entry.model_id)
                homeless += 1
            else:
                pending.append(entry.model_id)

        log.info("draining %d models", len(held))
        for entry in held:
            model_id = entry.model_id
            if loop.time() >= deadline:
                pending.append(model_id)
                continue
            try:
                await self.copies.refresh([model_id])
                if elsewhere(model_id) > 0:
                    continue
                record = local.registry.get(model_id)
                if record is not None and at_max_copies(record.key, len(record.instance_ids)):
                    handover.append(entry)  # after the others: their loads run meanwhile
                    continue
                await place_elsewhere(entry)
            except Exception as e:
                log.warning("could not place %s elsewhere: %s", model_id, e)
        for entry in handover:
            model_id = entry.model_id
            left_s = deadline - loop.time()
            try:
                # At its max copies: no other instance may load it while this runtime holds it,
                # so it leaves here first (runtime, then record) and its requests wait for the
                # new copy (Router._after_release), never two runtimes holding it at once.
                log.info("handing %s over: at its max copies, it leaves this runtime first", model_id)
                await asyncio.wait_for(local.unload_now(model_id), max(left_s, 0.0))
                await place_elsewhere(entry)
            except Exception as e:
                log.warning("could not hand %s over: %s", model_id, e)
        while pending and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
            try:
                await self.copies.refresh(pending)
            except Exception as e:
                log.warning("drain progress check failed: %s", e)
                continue
            pending = [m for m in pending if elsewhere(m) == 0]
        if pending or homeless:
            log.warning("drain ended with %d models not loaded elsewhere", len(pending) + homeless)
        else:
            log.info("drained: every model held here is loaded elsewhere")

    async def _serve_grace(self, until: float) -> None:
        """Keep the ports open until the drain grace is over (`decisions.drain`): its whole
        length with other instances in the mesh, else while requests keep arriving. Through
        HAProxy (native data plane) arrivals are counted by a poll stopped by now: the whole
        grace there."""
        loop = asyncio.get_running_loop()
        me = self.config.instance_id
        cluster = self.router.cluster if self.router is not None else None

        def others() -> bool:
            if cluster is None or self.native is not None or self.local is None:
                return True  # no count of peers or of arrivals: the whole grace
            return any(iid != me for iid, _ in cluster.instances.items())

        seen = self.local.counters.requests if self.local is not None else 0
        quiet_since = loop.time()
        while True:
            now = loop.time()
            arrived = self.local.counters.requests if self.local is not None else 0
            if arrived != seen:
                seen, quiet_since = arrived, now
            if grace_over(now, until, others(), quiet_since):
                return
            await asyncio.sleep(min(GRACE_POLL_S, until - now))

    async def stop(self, drain: bool = True) -> None:
        """Stop; with `drain` (SIGTERM) hand held models to other instances first."""
        grace = self.config.shutdown_timeout_ms / 1000
        if self.shutting_down:  # a second caller (prestop, then SIGTERM) waits for the first
            await self._stopped.wait()
            return
        loop = asyncio.get_running_loop()
        # After NOT_SERVING the ports keep accepting and serving for the drain grace: a load
        # balancer or a kubelet probing every few seconds acts only that much later, and a
        # port closed before then refuses its clients (issue 15). Within the stop budget.
        accept_until = loop.time() + min(self.config.drain_grace_ms / 1000, grace) if drain and self.servers else 0.0
        self.shutting_down = True
        self.serving = False
        for h in self.health:
            await h.set_serving(False)  # probes and balancers stop sending new work now
        for task in self.background:
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        if self.election is not None:
            with contextlib.suppress(Exception):
                await self.election.stop()  # leadership passes now, not after the drain
        if drain and self.local is not None and self.servers:
            await self.drain(max(grace - DRAIN_RESERVE_S, 0.0))
            # Capped copies still here leave the runtime before their records (one copy too
            # many otherwise); the rest leave the records first so peers stop routing here,
            # then requests in flight finish, then the instance goes.
            with contextlib.suppress(Exception):
                await self.local.release_capped(DRAIN_RESERVE_S / 2)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.local.deregister_copies(), DRAIN_RESERVE_S)
        # Still serving: held copies locally (they stay loaded), the rest through peers.
        await self._serve_grace(accept_until)
        # No new calls from here on; those in flight finish (up to 5 s of the budget).
        if self.native is not None:
            await self.native.stop()
        if self.native_calls is not None:
            self.native_calls.close()
        await asyncio.gather(*(server.stop(min(grace, 5.0)) for server in self.servers))
        if self.native_dir is not None:
            shutil.rmtree(self.native_dir, ignore_errors=True)
        if self.http is not None:
            with contextlib.suppress(Exception):
                await self.http.stop()
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        if self.publisher is not None:
            with contextlib.suppress(Exception):
                await self.publisher.stop()  # revokes the lease: the instance record goes at once
        if self.local is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.local.close(deregister=True), max(grace, 1.0))
        for table in self.tables:
            await table.stop()
        if self.serving_channel is not None:
            await self.serving_channel.close()
        if self.router is not None:
            await self.router.cluster.close()
        if self.peers is not None:
            await self.peers.close()
        if self.runtime is not None:
            await self.runtime.close()
        if self.store is not None:
            await self.store.close()
        if self.embedded is not None:
            (self.config.data_dir / ETCD_URL_FILE).unlink(missing_ok=True)
            await asyncio.to_thread(self.embedded.stop)
        if self.tracing is not None:
            with contextlib.suppress(Exception):
                await self.tracing.shutdown()  # flushes the spans still batched
        if self.watch_trace is not None:
            self.watch_trace.close()
        if self.payloads is not None:
            await self.payloads.stop()
        self._stopped.set()
        if self.probes is not None:  # last: /prestop callers are answered once stopped
            await self.probes.stop()


def ready_line(instance: Instance) -> str:
    """Every port the instance listens on, once it serves (with MESHD_PORTS=auto they are new)."""
    cfg = instance.config
    ports = [f"grpc port {instance.grpc_port}", f"peer port {instance.peer_port}"]
    if instance.http_port is not None:
        ports.append(f"http port {instance.http_port}")
    if cfg.metrics.enabled:
        ports.append(f"metrics port {cfg.metrics.port}")
    if cfg.probe_port is not None:
        ports.append(f"probe port {cfg.probe_port}")
    if cfg.prestop_port is not None and cfg.prestop_port != cfg.probe_port:
        ports.append(f"prestop port {cfg.prestop_port}")
    return f"meshd {cfg.instance_id} ready: {', '.join(ports)}"


def stop_message(signal_name: str, drain: bool, serving: bool, config: Config) -> str:
    """What a stop signal starts, said when it arrives (a silent drain looks like a hang)."""
    if not serving:
        return f"{signal_name}: stopping (start-up not finished: nothing to drain)"
    if not drain:
        return f"{signal_name}: stopping now, without a drain (SIGTERM drains)"
    budget_s = config.shutdown_timeout_ms / 1000
    grace_s = min(config.drain_grace_ms / 1000, budget_s)
    return (
        f"{signal_name}: draining for up to {budget_s:g} s (SHUTDOWN_TIMEOUT_MS): models held here are loaded "
        f"on other instances while requests are still served, and the ports stay open {grace_s:g} s "
        f"(MESHD_DRAIN_GRACE_MS; with no other instance, only while requests keep arriving), then the "
        "instance stops"
    )


async def serve(config: Config) -> None:
    """Run one instance until SIGTERM or SIGINT."""
    instance = Instance(config)
    stop = asyncio.Event()
    drain = True
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        nonlocal drain
        # SIGTERM (Kubernetes stopping the pod) drains; SIGINT (Ctrl-C) stops at once.
        drain = drain and sig is signal.SIGTERM
        if not stop.is_set():  # said once: a preStop hook and the kubelet's SIGTERM both land here
            log.info("%s", stop_message(sig.name, drain, instance.serving, config))
        stop.set()

    async def on_prestop() -> None:
        # The runtime containers' preStop hook (and `stop.sh wait`): the very entry SIGTERM
        # takes, then wait until the instance has stopped.
        on_signal(signal.SIGTERM)
        await instance.stopped()

    instance.on_prestop = on_prestop
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        # A signal during start-up (waiting for the runtime or etcd) stops it there.
        starting = asyncio.create_task(instance.start(), name="start-up")
        stopped = asyncio.create_task(stop.wait(), name="signal")
        await asyncio.wait((starting, stopped), return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            log.info("stopped during start-up")
            drain = False
            return
        starting.result()  # start-up's error, if it failed
        print(ready_line(instance), flush=True)
        await stop.wait()
    finally:
        began = loop.time()
        await instance.stop(drain=drain and stop.is_set())
        log.info("meshd %s stopped (%.1f s after the signal)", config.instance_id, loop.time() - began)
