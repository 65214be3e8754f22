"""Prometheus metrics under upstream ModelMesh's names (SPEC §8) and the `/metrics` endpoint.

Owns the MM_METRICS syntax (`MetricsConfig.parse`), the metric objects (one registry per
instance), the label children (bound once per label set, so an observation is one dict
lookup and one `observe`), the gauges computed at scrape time (this instance's cache; the
cluster's on the leader) and a small asyncio HTTP server for `/metrics`.

The request path sees `Metrics`: a no-op base (`NO_METRICS`, used when metrics are
disabled) that `PrometheusMetrics` overrides, so callers never test whether metrics are on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from meshd.decisions.cache import UNIT_BYTES
from meshd.decisions.openai import TokenTiming
from meshd.net.listen import bound_socket

log = logging.getLogger(__name__)

DEFAULT_PORT = 2112  # upstream's metrics port (SPEC §7: MM_METRICS default prometheus:port=2112)
MAX_METHOD_LABELS = 256  # distinct method names labelled; the rest are "other" (allowAnyMethod)
SCRAPE_READ_TIMEOUT_S = 10.0

# Upstream's buckets (Metrics.java), so dashboards' bucket boundaries keep working.
MS_TIME_BUCKETS = (0.5, 1, 2, 5, 10, 20, 50, 75, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 60000, 120000, 300000)
_MIN_MS, _HOUR_MS, _DAY_MS = 60_000, 3_600_000, 86_400_000
AGE_BUCKETS = (
    30_000,
    5 * _MIN_MS,
    15 * _MIN_MS,
    _HOUR_MS,
    4 * _HOUR_MS,
    12 * _HOUR_MS,
    _DAY_MS,
    7 * _DAY_MS,
    30 * _DAY_MS,
    90 * _DAY_MS,
)
MODEL_SIZE_BUCKETS = tuple(256 * 1024 * 4**i for i in range(8))  # 256 KiB x4
MESSAGE_SIZE_BUCKETS = tuple(128 * 4**i for i in range(8))  # 128 B x4
# Language models (issue 43): OpenTelemetry's GenAI semantic conventions, under the names
# its Prometheus exporter gives them (dots to underscores, the unit `s` as `_seconds`, `{token}`
# dropped), with the bucket boundaries the conventions advise.
TTFT = "gen_ai_server_time_to_first_token_seconds"
TPOT = "gen_ai_server_time_per_output_token_seconds"
TOKEN_USAGE = "gen_ai_client_token_usage"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_BUCKETS = tuple(float(4**i) for i in range(14))  # 1, 4, 16 ... 67108864
GENAI_LABELS = ("gen_ai_operation_name", "gen_ai_request_model")

# Counters keep upstream's exact names (no `_total`): see PrometheusMetrics.exposition.
LOAD_FAILURE = "modelmesh_loadmodel_failure"
UNLOAD_FAILURE = "modelmesh_unloadmodel_failure"
LOAD_REFUSED = "modelmesh_loadmodel_refused"  # misses refused for load capacity (issue 24)
PAYLOADS_DROPPED = "meshd_payloads_dropped"  # ours: MM_PAYLOAD_PROCESSORS records not sent (queue full)

disable_created_metrics()  # type: ignore[no-untyped-call]  # upstream exposes no `_created` series; they would double the output


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """MM_METRICS: `prometheus:port=2112;per_model_metrics=true;fq_names=false` or `disabled`."""

    enabled: bool = True
    port: int = DEFAULT_PORT
    per_model: bool = False  # modelId/vModelId labels (one series per model: mind the cardinality)
    fq_names: bool = False  # method label: full `package.Service/Method` instead of `Method`
    # scheme=https: served with the instance's MM_TLS_* certificate; None: no scheme given
    # (upstream then serves https; `meshd.config` decides, as it knows whether TLS is on)
    https: bool | None = None

    @classmethod
    def parse(cls, text: str) -> MetricsConfig:
        """Upstream's syntax; ValueError names what is wrong (the caller names the setting)."""
        text = text.strip()
        if text.lower() == "disabled":
            return cls(enabled=False)
        kind, _, params = text.partition(":")
        if kind.strip() != "prometheus":
            raise ValueError(
                f"expected 'prometheus:key=value;...' or 'disabled' (statsd is not supported), got {text!r}"
            )
        port, per_model, fq_names = DEFAULT_PORT, False, False
        https: bool | None = None
        for part in params.split(";"):
            if not part.strip():
                continue
            key, eq, value = (x.strip() for x in part.partition("="))
            if not eq:
                raise ValueError(f"expected key=value, got {part.strip()!r}")
            if key == "port":
                port = _port(value)
            elif key == "per_model_metrics":
                per_model = _flag(key, value)
            elif key == "fq_names":
                fq_names = _flag(key, value)
            elif key == "scheme":
                if value not in ("http", "https"):
                    raise ValueError(f"scheme must be http or https, got {value!r}")
                https = value == "https"
            elif key == "mem_detail":
                pass  # upstream's JVM memory detail: nothing comparable to report here
            else:
                raise ValueError(f"unknown key {key!r} (known: port, per_model_metrics, fq_names, scheme, mem_detail)")
        return cls(True, port, per_model, fq_names, https)


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise ValueError(f"port must be an integer, got {value!r}") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be between 1 and 65535, got {port}")
    return port


def _flag(key: str, value: str) -> bool:
    lowered = value.lower()
    if lowered not in ("true", "false"):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return lowered == "true"


@dataclass(frozen=True, slots=True)
class InstanceStats:
    """What the instance gauges report, read from the cache at scrape time."""

    lru_ms: int  # last use of the copy evicted next (LRU: the oldest; now when there are none)
    now_ms: int
    capacity_units: int
    used_units: int
    models: int  # loaded copies
    loads_waiting: int = 0  # loads waiting for a loading thread
    loads_in_progress: int = 0  # loading threads taken
    upstream_instances: int = 0  # upstream (Java) instance records in the registry: never routed to
    eviction_frequency_weight: float | None = None  # MESHD_EVICTION=adaptive: what it learnt (else none)
    eviction_odds_overruled: float | None = None  # MESHD_EVICTION=rate-capped: what it learnt (else none)


@dataclass(frozen=True, slots=True)
class ClusterStats:
    """The leader's gauges (upstream publishes them from one pod only)."""

    models_managed: int
    models_loaded: int
    models_with_failure: int


class Metrics:
    """The interface the request path and the loader call; this base records nothing."""

    enabled = False
    per_model = False

    def api_request(
        self, method: str, code: str, ms: float, req_bytes: int, resp_bytes: int, model_id: str, vmodel_id: str
    ) -> None:
        """An external inference call, at the edge (`req_bytes`/`resp_bytes` < 0: not known)."""

    def invoke_model(self, method: str, code: str, ms: float, model_id: str) -> None:
        """A call to this instance's runtime (for a client here or a peer)."""

    def req_queue_delay(self, ms: float, model_id: str) -> None:
        """Time a request waited for a slot on a concurrency-limited copy."""

    def cache_miss(self, ms: float, model_id: str) -> None:
        """Time a request waited for a copy to load here."""

    def loading_queue_delay(self, ms: float, model_id: str) -> None:
        """Time a load waited for a loading slot."""

    def load(self, ms: float, model_id: str) -> None:
        """A successful runtime load."""

    def load_failure(self) -> None: ...

    def load_refused(self) -> None:
        """A miss refused at once because the load queue could not start it in time."""

    def unload(self, ms: float, model_id: str) -> None: ...

    def unload_failure(self) -> None: ...

    def model_sizing(self, ms: float, model_id: str) -> None: ...

    def age_at_eviction(self, ms: float, model_id: str) -> None: ...

    def loaded_model_size(self, size_bytes: int, model_id: str) -> None: ...

    def payloads_dropped(self, n: int = 1) -> None:
        """Payload records dropped because the processors' queue was full (MM_PAYLOAD_PROCESSORS)."""

    def llm_call(self, model_id: str, timing: TokenTiming) -> None:
        """One answered OpenAI call to a language model: its time to first token, time per
        output token and tokens (always labelled by model: language models are few)."""

    def info(self, name: str, labels: dict[str, str]) -> None:
        """MM_INFO_METRICS: one gauge `name{labels} 1` (upstream's info metric)."""

    def watch_instance(self, read: Callable[[], InstanceStats]) -> None:
        """The instance gauges' source, read at each scrape."""

    def watch_cluster(self, read: Callable[[], ClusterStats | None]) -> None:
        """The leader gauges' source (None: not the leader, no gauges)."""

    def exposition(self) -> bytes:
        return b""


NO_METRICS = Metrics()


class PrometheusMetrics(Metrics):
    enabled = True

    def __init__(self, config: MetricsConfig) -> None:
        self.config = config
        self.per_model = config.per_model
        self.registry = CollectorRegistry()
        req_labels = ("method", "code", "modelId", "vModelId") if config.per_model else ("method", "code")
        model_labels = ("modelId", "vModelId") if config.per_model else ()

        def histogram(name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=self.registry, buckets=buckets)

        self._api = histogram(
            "modelmesh_api_request_milliseconds", "External inference request time", MS_TIME_BUCKETS, req_labels
        )
        self._invoke = histogram(
            "modelmesh_invoke_model_milliseconds", "Internal model server inference request time", MS_TIME_BUCKETS,
            req_labels,
        )  # fmt: skip
        self._req_size = histogram(
            "modelmesh_request_size_bytes", "Inference request payload size", MESSAGE_SIZE_BUCKETS, req_labels
        )
        self._resp_size = histogram(
            "modelmesh_response_size_bytes", "Inference response payload size", MESSAGE_SIZE_BUCKETS, req_labels
        )
        per_model: dict[str, tuple[str, tuple[float, ...]]] = {
            "cache_miss": ("modelmesh_cache_miss_milliseconds", MS_TIME_BUCKETS),
            "load": ("modelmesh_loadmodel_milliseconds", MS_TIME_BUCKETS),
            "unload": ("modelmesh_unloadmodel_milliseconds", MS_TIME_BUCKETS),
            "req_queue": ("modelmesh_req_queue_delay_milliseconds", MS_TIME_BUCKETS),
            "loading_queue": ("modelmesh_loading_queue_delay_milliseconds", MS_TIME_BUCKETS),
            "sizing": ("modelmesh_model_sizing_milliseconds", MS_TIME_BUCKETS),
            "eviction_age": ("modelmesh_age_at_eviction_milliseconds", AGE_BUCKETS),
            "model_size": ("modelmesh_loaded_model_size_bytes", MODEL_SIZE_BUCKETS),
        }
        self._model_histograms = {
            key: histogram(name, _DOCS[name], buckets, model_labels) for key, (name, buckets) in per_model.items()
        }
        self._ttft = histogram(TTFT, _DOCS[TTFT], TTFT_BUCKETS, GENAI_LABELS)
        self._tpot = histogram(TPOT, _DOCS[TPOT], TPOT_BUCKETS, GENAI_LABELS)
        self._tokens = histogram(TOKEN_USAGE, _DOCS[TOKEN_USAGE], TOKEN_BUCKETS, (*GENAI_LABELS, "gen_ai_token_type"))
        self._genai_children: dict[tuple[str, str], tuple[Histogram, Histogram, Histogram, Histogram]] = {}
        self._counts = {LOAD_FAILURE: 0, UNLOAD_FAILURE: 0, LOAD_REFUSED: 0, PAYLOADS_DROPPED: 0}
        # Bound children: (method, code[, model, vmodel]) -> (time, request size, response size).
        self._api_children: dict[tuple[str, ...], tuple[Histogram, Histogram, Histogram]] = {}
        self._invoke_children: dict[tuple[str, ...], Histogram] = {}
        self._model_children: dict[tuple[str, str], Histogram] = {}
        self._method_labels: dict[str, str] = {}
        self._gauges = _Gauges()
        self.registry.register(self._gauges)

    # ---- the request path ----------------------------------------------------------
    def api_request(
        self, method: str, code: str, ms: float, req_bytes: int, resp_bytes: int, model_id: str, vmodel_id: str
    ) -> None:
        # Keyed by the capped method label, not the raw path: clients choose paths.
        label = self._method(method)
        key = (label, code, model_id, vmodel_id) if self.per_model else (label, code)
        children = self._api_children.get(key)
        if children is None:
            labels = key
            children = (self._api.labels(*labels), self._req_size.labels(*labels), self._resp_size.labels(*labels))
            self._api_children[key] = children
        children[0].observe(ms)
        if req_bytes >= 0:
            children[1].observe(req_bytes)
        if resp_bytes >= 0:
            children[2].observe(resp_bytes)

    def invoke_model(self, method: str, code: str, ms: float, model_id: str) -> None:
        label = self._method(method)
        key = (label, code, model_id) if self.per_model else (label, code)
        child = self._invoke_children.get(key)
        if child is None:
            labels = (label, code, model_id, "") if self.per_model else (label, code)
            child = self._invoke_children[key] = self._invoke.labels(*labels)
        child.observe(ms)

    def _method(self, path: str) -> str:
        """The method label: `Method` (upstream's short names) or `package.Service/Method`."""
        label = self._method_labels.get(path)
        if label is None:
            if len(self._method_labels) >= MAX_METHOD_LABELS:
                return "other"
            full = path.lstrip("/")
            label = self._method_labels[path] = full if self.config.fq_names else full.rsplit("/", 1)[-1]
        return label

    def _observe(self, which: str, value: float, model_id: str) -> None:
        if not self.per_model:
            self._model_histograms[which].observe(value)
            return
        key = (which, model_id)
        child = self._model_children.get(key)
        if child is None:
            child = self._model_children[key] = self._model_histograms[which].labels(model_id, "")
        child.observe(value)

    def req_queue_delay(self, ms: float, model_id: str) -> None:
        self._observe("req_queue", ms, model_id)

    def cache_miss(self, ms: float, model_id: str) -> None:
        self._observe("cache_miss", ms, model_id)

    # ---- loading -------------------------------------------------------------------
    def loading_queue_delay(self, ms: float, model_id: str) -> None:
        self._observe("loading_queue", ms, model_id)

    def load(self, ms: float, model_id: str) -> None:
        self._observe("load", ms, model_id)

    def load_failure(self) -> None:
        self._counts[LOAD_FAILURE] += 1

    def load_refused(self) -> None:
        self._counts[LOAD_REFUSED] += 1

    def unload(self, ms: float, model_id: str) -> None:
        self._observe("unload", ms, model_id)

    def unload_failure(self) -> None:
        self._counts[UNLOAD_FAILURE] += 1

    def payloads_dropped(self, n: int = 1) -> None:
        self._counts[PAYLOADS_DROPPED] += n

    def llm_call(self, model_id: str, timing: TokenTiming) -> None:
        key = (timing.operation, model_id)
        children = self._genai_children.get(key)
        if children is None:
            children = self._genai_children[key] = (
                self._ttft.labels(*key),
                self._tpot.labels(*key),
                self._tokens.labels(*key, "output"),
                self._tokens.labels(*key, "input"),
            )
        if timing.ttft_s is not None:
            children[0].observe(timing.ttft_s)
        if timing.tpot_s is not None:
            children[1].observe(timing.tpot_s)
        if timing.output_tokens is not None:
            children[2].observe(timing.output_tokens)
        if timing.input_tokens is not None:
            children[3].observe(timing.input_tokens)

    def info(self, name: str, labels: dict[str, str]) -> None:
        gauge = Gauge(name, "Instance information (MM_INFO_METRICS)", list(labels), registry=self.registry)
        (gauge.labels(**labels) if labels else gauge).set(1)

    def model_sizing(self, ms: float, model_id: str) -> None:
        self._observe("sizing", ms, model_id)

    def age_at_eviction(self, ms: float, model_id: str) -> None:
        self._observe("eviction_age", ms, model_id)

    def loaded_model_size(self, size_bytes: int, model_id: str) -> None:
        self._observe("model_size", size_bytes, model_id)

    # ---- scrape --------------------------------------------------------------------
    def watch_instance(self, read: Callable[[], InstanceStats]) -> None:
        self._gauges.instance = read

    def watch_cluster(self, read: Callable[[], ClusterStats | None]) -> None:
        self._gauges.cluster = read

    def exposition(self) -> bytes:
        """The text format. The two counters are written by hand: prometheus_client would
        expose them as `<name>_total`, and upstream's users scrape `modelmesh_loadmodel_failure`."""
        counters = "".join(
            f"# HELP {name} {_DOCS[name]}\n# TYPE {name} counter\n{name} {float(value)}\n"
            for name, value in self._counts.items()
        )
        return generate_latest(self.registry) + counters.encode()


class _Gauges(Collector):
    """Gauges computed when scraped: nothing is updated per request."""

    def __init__(self) -> None:
        self.instance: Callable[[], InstanceStats] | None = None
        self.cluster: Callable[[], ClusterStats | None] = lambda: None

    def collect(self) -> Iterator[Metric]:
        if self.instance is not None:
            s = self.instance()
            capacity, used = s.capacity_units * UNIT_BYTES, s.used_units * UNIT_BYTES
            values = {
                "modelmesh_instance_lru_seconds": s.lru_ms // 1000,
                "modelmesh_instance_lru_age_seconds": max(0, s.now_ms - s.lru_ms) // 1000,
                "modelmesh_instance_capacity_bytes": capacity,
                "modelmesh_instance_used_bytes": used,
                # basis points (hundredths of a percent), as upstream
                "modelmesh_instance_used_bps": used * 10_000 // capacity if capacity else 0,
                "modelmesh_instance_models_total": s.models,
                "modelmesh_instance_loading_queue_size": s.loads_waiting,
                "modelmesh_instance_loads_in_progress": s.loads_in_progress,
                "meshd_upstream_instances": s.upstream_instances,
            }
            for name, value in values.items():
                yield GaugeMetricFamily(name, _DOCS[name], value=value)
            if s.eviction_frequency_weight is not None:
                name = "meshd_eviction_frequency_weight"
                yield GaugeMetricFamily(name, _DOCS[name], value=s.eviction_frequency_weight)
            if s.eviction_odds_overruled is not None:
                name = "meshd_eviction_odds_overruled"
                yield GaugeMetricFamily(name, _DOCS[name], value=s.eviction_odds_overruled)
        c = self.cluster()
        if c is not None:
            yield GaugeMetricFamily("modelmesh_models_loaded_total", _DOCS["loaded"], value=c.models_loaded)
            yield GaugeMetricFamily("modelmesh_models_with_failure_total", _DOCS["failed"], value=c.models_with_failure)
            yield GaugeMetricFamily("modelmesh_models_managed_total", _DOCS["managed"], value=c.models_managed)


_DOCS = {
    TTFT: "Time to the first piece of a streamed answer, from the call's arrival (gen_ai.server.time_to_first_token)",
    TPOT: "Time per output token after the first, of streamed answers (gen_ai.server.time_per_output_token)",
    TOKEN_USAGE: "Tokens per call, input and output (gen_ai.client.token.usage; input where the engine reports usage)",
    PAYLOADS_DROPPED: "Payload records dropped because the payload processors' queue was full",
    "modelmesh_cache_miss_milliseconds": "Cache miss delay",
    "modelmesh_loadmodel_milliseconds": "Time taken to load model",
    "modelmesh_unloadmodel_milliseconds": "Time taken to unload model",
    "modelmesh_req_queue_delay_milliseconds": "Time spent in inference request queue",
    "modelmesh_loading_queue_delay_milliseconds": "Time spent in model loading queue",
    "modelmesh_model_sizing_milliseconds": "Time taken to perform model sizing",
    "modelmesh_age_at_eviction_milliseconds": "Time since model was last used when evicted",
    "modelmesh_loaded_model_size_bytes": "Reported size of loaded model",
    LOAD_FAILURE: "Model load failures",
    UNLOAD_FAILURE: "Unload model failures",
    LOAD_REFUSED: "Model loads refused for load capacity (RESOURCE_EXHAUSTED at once)",
    "modelmesh_instance_lru_seconds": "Last used time of least recently used model in pod (in secs since epoch)",
    "modelmesh_instance_lru_age_seconds": "Last used age of least recently used model in pod (secs ago)",
    "modelmesh_instance_capacity_bytes": "Effective model capacity of pod",
    "modelmesh_instance_used_bytes": "Amount of capacity currently in use by loaded models",
    "modelmesh_instance_used_bps": "Amount of capacity used in basis points (100ths of percent)",
    "modelmesh_instance_models_total": "Number of model copies loaded in pod",
    "modelmesh_instance_loading_queue_size": "Number of model loads waiting for a loading thread in pod",
    "modelmesh_instance_loads_in_progress": "Number of loading threads in use in pod",
    "meshd_upstream_instances": "Upstream (Java) ModelMesh instance records seen in this mesh's registry (never used)",
    "meshd_eviction_frequency_weight": "Adaptive eviction: weight of frequency against recency (0 LRU, 1 RATE)",
    "meshd_eviction_odds_overruled": "Rate-capped eviction: share of recent evictions RATE would not have made",
    "loaded": "Total number of models with at least one loaded copy",
    "failed": "Total number of models with one or more recent load failures",
    "managed": "Total number of models managed",
}


def build_metrics(config: MetricsConfig) -> Metrics:
    return PrometheusMetrics(config) if config.enabled else NO_METRICS


class MetricsServer:
    """`GET /metrics` over HTTP/1.1 on the event loop (one response per connection).

    On the loop, not in a thread, so the scrape-time gauges read the cache without locks."""

    def __init__(
        self,
        metrics: Metrics,
        port: int,
        host: str | None = None,  # None: every address, both families (meshd.net.listen)
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.ssl_context = ssl_context
        self.metrics = metrics
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        try:
            sock = bound_socket(self.host, self.port)
            self._server = await asyncio.start_server(self._handle, sock=sock, ssl=self.ssl_context)
        except OSError as e:
            raise OSError(e.errno, f"metrics port {self.port} (MM_METRICS): {e.strerror}") from None
        self.port = self._server.sockets[0].getsockname()[1]
        scheme = "http" if self.ssl_context is None else "https"
        log.info("serving Prometheus metrics on %s port %d /metrics", scheme, self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(SCRAPE_READ_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")  # the stream's 64 KiB limit bounds it
            status, body, content_type = self.answer(head)
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # a client that went away or sent no request: nothing to answer
        except Exception:
            log.exception("metrics scrape failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def answer(self, head: bytes) -> tuple[str, bytes, str]:
        """(status line, body, content type) for a request's head."""
        try:
            method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
        except ValueError:
            return "400 Bad Request", b"bad request\n", "text/plain"
        if target.split("?", 1)[0] != "/metrics":
            return "404 Not Found", b"only /metrics is served here\n", "text/plain"
        if method != "GET":
            return "405 Method Not Allowed", b"use GET\n", "text/plain"
        return "200 OK", self.metrics.exposition(), CONTENT_TYPE_LATEST
