"""MM_METRICS parsing, the metric objects' exposition and the /metrics HTTP endpoint."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from meshd.config import ConfigError, load_config
from meshd.net.listen import ipv6_available
from meshd.observability.metrics import (
    LOAD_FAILURE,
    NO_METRICS,
    ClusterStats,
    InstanceStats,
    MetricsConfig,
    MetricsServer,
    PrometheusMetrics,
    build_metrics,
)

INFER = "/inference.GRPCInferenceService/ModelInfer"


def samples(text: str | bytes) -> list[Sample]:
    body = text.decode() if isinstance(text, bytes) else text
    return [s for family in text_string_to_metric_families(body) for s in family.samples]


def named(text: bytes, name: str) -> list[Sample]:
    return [s for s in samples(text) if s.name == name]


# ---- MM_METRICS ------------------------------------------------------------------------
def test_default_is_upstreams_prometheus_on_2112() -> None:
    cfg = load_config(None, {}).metrics
    assert cfg == MetricsConfig(enabled=True, port=2112, per_model=False, fq_names=False, https=False)
    assert load_config(None, {}).log_each_invoke is False and load_config(None, {}).log_format == "text"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("disabled", MetricsConfig(enabled=False)),
        ("prometheus", MetricsConfig()),
        ("prometheus:port=9100", MetricsConfig(port=9100)),
        ("prometheus:port=9100;per_model_metrics=true", MetricsConfig(port=9100, per_model=True)),
        ("prometheus:per_model_metrics=TRUE;fq_names=true;", MetricsConfig(per_model=True, fq_names=True)),
        # upstream keys with nothing to do here are accepted
        ("prometheus:port=2113;scheme=http;mem_detail=all", MetricsConfig(port=2113, https=False)),
    ],
)
def test_metrics_setting(text: str, expected: MetricsConfig) -> None:
    assert MetricsConfig.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("prometheus:port=abc", "port must be an integer"),
        ("prometheus:port=0", "between 1 and 65535"),
        ("prometheus:port=70000", "between 1 and 65535"),
        ("prometheus:per_model_metrics=yes", "per_model_metrics must be true or false"),
        ("prometheus:fq_names", "expected key=value"),
        ("prometheus:colour=blue", "unknown key 'colour'"),
        ("prometheus:scheme=ftp", "scheme must be http or https"),
        ("statsd:port=8126", "statsd is not supported"),
    ],
)
def test_bad_metrics_setting_is_a_config_error_naming_it(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, {"MM_METRICS": text})
    assert "MM_METRICS (--metrics)" in str(e.value) and says in str(e.value)


@pytest.mark.parametrize(
    ("env", "name"),
    [({"MM_LOG_EACH_INVOKE": "yes"}, "MM_LOG_EACH_INVOKE"), ({"MESHD_LOG_FORMAT": "xml"}, "MESHD_LOG_FORMAT")],
)
def test_bad_logging_settings_are_config_errors(env: dict[str, str], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        load_config(None, env)


def test_logging_settings() -> None:
    cfg = load_config(None, {"MM_LOG_EACH_INVOKE": "True", "MESHD_LOG_FORMAT": "JSON"})
    assert cfg.log_each_invoke is True and cfg.log_format == "json"


# ---- exposition --------------------------------------------------------------------------
def test_disabled_metrics_record_nothing() -> None:
    m = build_metrics(MetricsConfig(enabled=False))
    assert m is NO_METRICS and not m.enabled
    m.api_request(INFER, "OK", 1.0, 10, 10, "m", "")
    assert m.exposition() == b""


def test_request_histograms_are_labelled_method_and_code_only_without_per_model() -> None:
    m = PrometheusMetrics(MetricsConfig())
    for _ in range(3):
        m.api_request(INFER, "OK", 1.5, 100, 40, "m1", "vm")
    m.api_request(INFER, "NOT_FOUND", 0.3, 100, -1, "nope", "")
    m.invoke_model(INFER, "OK", 1.0, "m1")
    text = m.exposition()
    counts = {
        (s.labels["method"], s.labels["code"]): s.value for s in named(text, "modelmesh_api_request_milliseconds_count")
    }
    assert counts == {("ModelInfer", "NOT_FOUND"): 1, ("ModelInfer", "OK"): 3}
    # no response, no response size (the series exists, bound with the others, at 0)
    assert [s.value for s in named(text, "modelmesh_response_size_bytes_count")] == [3, 0]
    assert [s.value for s in named(text, "modelmesh_request_size_bytes_count")] == [3, 1]
    assert [s.labels for s in named(text, "modelmesh_invoke_model_milliseconds_count")] == [
        {"method": "ModelInfer", "code": "OK"}
    ]
    assert not any("modelId" in s.labels for s in samples(text))


def test_per_model_metrics_add_model_and_vmodel_labels() -> None:
    m = PrometheusMetrics(MetricsConfig(per_model=True, fq_names=True))
    m.api_request(INFER, "OK", 1.5, 100, 40, "m1", "vm")
    m.invoke_model(INFER, "OK", 1.0, "m1")
    m.load(20.0, "m1")
    text = m.exposition()
    [api] = named(text, "modelmesh_api_request_milliseconds_count")
    assert api.labels == {
        "method": "inference.GRPCInferenceService/ModelInfer",
        "code": "OK",
        "modelId": "m1",
        "vModelId": "vm",
    }
    [load] = named(text, "modelmesh_loadmodel_milliseconds_count")
    assert load.labels == {"modelId": "m1", "vModelId": ""}


def test_counters_keep_upstreams_names_and_model_histograms_count() -> None:
    m = PrometheusMetrics(MetricsConfig())
    m.load_failure()
    m.load_failure()
    m.unload_failure()
    m.load_refused()
    m.payloads_dropped(3)
    for observe in (m.cache_miss, m.loading_queue_delay, m.unload, m.req_queue_delay, m.model_sizing):
        observe(3.0, "m")
    m.age_at_eviction(60_000, "m")
    m.loaded_model_size(1 << 20, "m")
    text = m.exposition().decode()
    assert f"# TYPE {LOAD_FAILURE} counter\n{LOAD_FAILURE} 2.0\n" in text
    assert "modelmesh_loadmodel_refused 1.0" in text and "meshd_payloads_dropped 3.0" in text
    assert "modelmesh_unloadmodel_failure 1.0" in text and "_total" not in text.replace("_models_total", "")
    for name in (
        "cache_miss_milliseconds",
        "loading_queue_delay_milliseconds",
        "unloadmodel_milliseconds",
        "req_queue_delay_milliseconds",
        "model_sizing_milliseconds",
        "age_at_eviction_milliseconds",
        "loaded_model_size_bytes",
    ):
        assert [s.value for s in named(text.encode(), f"modelmesh_{name}_count")] == [1], name
    assert "_created" not in text


def test_gauges_are_read_at_scrape_time_and_cluster_ones_only_on_the_leader() -> None:
    m = PrometheusMetrics(MetricsConfig())
    stats = InstanceStats(lru_ms=1_000_000, now_ms=1_090_000, capacity_units=100, used_units=25, models=3)
    m.watch_instance(lambda: stats)
    leading: list[ClusterStats | None] = [None]
    m.watch_cluster(lambda: leading[0])
    values = {s.name: s.value for s in samples(m.exposition())}
    assert values["modelmesh_instance_lru_seconds"] == 1000
    assert values["modelmesh_instance_lru_age_seconds"] == 90
    assert values["modelmesh_instance_capacity_bytes"] == 100 * 8192
    assert values["modelmesh_instance_used_bytes"] == 25 * 8192
    assert values["modelmesh_instance_used_bps"] == 2500
    assert values["modelmesh_instance_models_total"] == 3
    assert "modelmesh_models_managed_total" not in values
    assert "meshd_eviction_frequency_weight" not in values  # not the adaptive order: no such gauge
    assert "meshd_eviction_odds_overruled" not in values  # nor the capped one
    stats = replace(stats, eviction_frequency_weight=0.625)
    assert {s.name: s.value for s in samples(m.exposition())}["meshd_eviction_frequency_weight"] == 0.625
    stats = replace(stats, eviction_frequency_weight=None, eviction_odds_overruled=0.75)
    values = {s.name: s.value for s in samples(m.exposition())}
    assert values["meshd_eviction_odds_overruled"] == 0.75 and "meshd_eviction_frequency_weight" not in values
    leading[0] = ClusterStats(models_managed=5, models_loaded=4, models_with_failure=1)
    values = {s.name: s.value for s in samples(m.exposition())}
    assert (
        values["modelmesh_models_managed_total"],
        values["modelmesh_models_loaded_total"],
        values["modelmesh_models_with_failure_total"],
    ) == (5, 4, 1)


def test_method_labels_are_bounded() -> None:
    m = PrometheusMetrics(MetricsConfig())
    for i in range(300):
        m.api_request(f"/pkg.Svc/M{i}", "UNIMPLEMENTED", 0.1, 1, -1, "", "")
    methods = {s.labels["method"] for s in named(m.exposition(), "modelmesh_api_request_milliseconds_count")}
    assert len(methods) == 257 and "other" in methods


# ---- /metrics over HTTP ------------------------------------------------------------------
async def http(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    writer.write_eof()  # half-close: a partial request ends here
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return answer


async def test_metrics_endpoint_serves_get_metrics_only() -> None:
    m = PrometheusMetrics(MetricsConfig())
    m.api_request(INFER, "OK", 1.0, 1, 1, "", "")
    server = MetricsServer(m, 0, host="127.0.0.1")
    await server.start()
    try:
        ok = await http(server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        head, body = ok.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200") and b"text/plain" in head
        assert named(body, "modelmesh_api_request_milliseconds_count")[0].value == 1
        assert (await http(server.port, b"GET / HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 404")
        assert (await http(server.port, b"POST /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 405")
        assert (await http(server.port, b"nonsense\r\n\r\n")).startswith(b"HTTP/1.1 400")
        assert await http(server.port, b"GET /metr") == b""  # hung up on: nothing, and the server lives on
    finally:
        await server.stop()


async def test_a_taken_metrics_port_is_a_clear_error() -> None:
    first = MetricsServer(NO_METRICS, 0, host="127.0.0.1")
    await first.start()
    try:
        with pytest.raises(OSError, match=r"metrics port \d+ \(MM_METRICS\)"):
            await MetricsServer(NO_METRICS, first.port, host="127.0.0.1").start()
    finally:
        await first.stop()


@pytest.mark.skipif(not ipv6_available(), reason="no IPv6 on this host")
async def test_with_no_host_metrics_answer_on_ipv6_and_ipv4() -> None:
    """Prometheus scrapes the pod IP, an IPv6 address on an IPv6-only cluster."""
    server = MetricsServer(PrometheusMetrics(MetricsConfig()), 0)
    await server.start()
    try:
        for host in ("::1", "127.0.0.1"):
            reader, writer = await asyncio.open_connection(host, server.port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            assert (await reader.read()).startswith(b"HTTP/1.1 200"), host
            writer.close()
    finally:
        await server.stop()
