"""Configuration from upstream environment names and flags (SPEC §7)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from meshd.config import ConfigError, add_serve_arguments, load_config, parse_kv_store


def parse(argv: list[str], env: dict[str, str]) -> object:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return load_config(p.parse_args(argv), env)


def test_defaults_are_upstreams() -> None:
    cfg = load_config(None, {})
    assert (cfg.grpc_port, cfg.peer_port, cfg.max_msg_size) == (8033, 8080, 16 << 20)
    assert cfg.max_headers_size == 8 << 10  # grpc's soft limit: what meshd takes, a default runtime takes
    assert cfg.kv_store is None  # embedded etcd
    assert cfg.runtime_endpoint == cfg.serving_endpoint == "8085"
    assert cfg.load_failure_expiry_ms == 900_000 and cfg.shutdown_timeout_ms == 30_000
    assert cfg.key_prefix == "/tas-runtime/modelmesh"  # upstream's default prefix, empty root


def test_environment_names_and_flags_flag_wins() -> None:
    env = {
        "MM_SERVICE_NAME": "svc",
        "KV_STORE": "etcd:http://10.0.0.1:2379",
        "MM_KVSTORE_PREFIX": "pre",
        "MM_SVC_GRPC_PORT": "9000",
        "INTERNAL_GRPC_SOCKET_PATH": "/tmp/rt.sock",
        "INTERNAL_SERVING_GRPC_PORT": "8001",
        "MESHD_INSTANCE_ID": "i-1",
        "MM_LABELS": "mt:sklearn, gpu",
    }
    cfg = parse(["--grpc-port", "9100"], env)
    assert cfg.grpc_port == 9100  # type: ignore[attr-defined]
    assert cfg.runtime_endpoint == "unix:/tmp/rt.sock"  # type: ignore[attr-defined]
    assert cfg.serving_endpoint == "8001"  # type: ignore[attr-defined]
    assert cfg.instance_id == "i-1" and cfg.labels == ("mt:sklearn", "gpu")  # type: ignore[attr-defined]
    assert cfg.key_prefix == "/pre/svc"  # type: ignore[attr-defined]


def test_kv_store_forms() -> None:
    assert parse_kv_store("etcd:127.0.0.1:2379").url == "http://127.0.0.1:2379"
    assert parse_kv_store("etcd:e1").url == "http://e1:2379"  # upstream's simple form: port optional
    t = parse_kv_store(
        'etcd:{"endpoints": "http://e1:2379,http://e2:2379", "root_prefix": "modelmesh-serving/mm_ns/ns"}'
    )
    assert (t.url, t.root_prefix) == ("http://e1:2379", "modelmesh-serving/mm_ns/ns")
    for bad in ["zookeeper:x", "etcd:{bad json", 'etcd:{"x": 1}', "etcd:http://host:port", "etcd:/no/such/file"]:
        with pytest.raises(ConfigError):
            parse_kv_store(bad)


@pytest.mark.parametrize(
    "env",
    [
        {"MM_SVC_GRPC_PORT": "abc"},
        {"MESHD_PEER_PORT": "-1"},
        {"INTERNAL_GRPC_PORT": "x"},
        {"KV_STORE": "redis:x"},
        {"MESHD_EVICTION": "fifo"},
        {"MESHD_LOAD_QUEUE": "lifo"},
        {"MESHD_LOAD_WAIT_LIMIT_MS": "10"},
    ],
)
def test_bad_values_name_the_setting(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, env)
    assert next(iter(env)) in str(e.value) or "KV_STORE" in str(e.value)


def test_type_constraints_from_env_or_file(tmp_path: object) -> None:
    from pathlib import Path

    text = '{"sklearn": {"required": ["mt:sklearn"]}, "_default": {"preferred": ["cpu"]}}'
    cfg = load_config(None, {"MM_TYPE_CONSTRAINTS": text})
    assert cfg.type_constraints.for_type("sklearn")[0] == frozenset({"mt:sklearn"})
    path = Path(str(tmp_path)) / "tc.json"
    path.write_text(text)
    cfg = load_config(None, {"MM_TYPE_CONSTRAINTS_PATH": str(path)})
    assert cfg.type_constraints.for_type("other")[1] == frozenset({"cpu"})
    for bad in ({"MM_TYPE_CONSTRAINTS": "{oops"}, {"MM_TYPE_CONSTRAINTS_PATH": "/no/such/file"}):
        with pytest.raises(ConfigError):
            load_config(None, bad)


def test_data_plane_settings(tmp_path: object) -> None:
    from pathlib import Path

    cfg = load_config(None, {})
    assert (cfg.max_inflight_per_copy, cfg.conc_scaleup_bandwidth_pct, cfg.request_timeout_ms) == (0, 90, 0)
    assert cfg.dataplane.allow_other_rpcs and not cfg.dataplane.rpc_configs
    text = '{"rpcConfigs": {"a.B/C": {"idExtractionPath": [1]}}, "allowOtherRpcs": false}'
    path = Path(str(tmp_path)) / "dp.json"
    path.write_text(text)
    for env in ({"MM_DATAPLANE_CONFIG": text}, {"MM_DATAPLANE_CONFIG_PATH": str(path)}):
        cfg = load_config(None, env)
        assert cfg.dataplane.rpc_configs["/a.B/C"].id_extraction_path == (1,)
        assert not cfg.dataplane.allow_other_rpcs
    cfg = load_config(None, {"MM_MAX_INFLIGHT_PER_MODEL_COPY": "-1", "MESHD_REQUEST_TIMEOUT_MS": "2500"})
    assert (cfg.max_inflight_per_copy, cfg.request_timeout_ms) == (-1, 2500)
    for bad, name in [
        ({"MM_DATAPLANE_CONFIG": "{oops"}, "MM_DATAPLANE_CONFIG"),
        ({"MM_DATAPLANE_CONFIG_PATH": "/no/such/file"}, "MM_DATAPLANE_CONFIG_PATH"),
        ({"MM_CONC_SCALEUP_BANDWIDTH_PCT": "5"}, "MM_CONC_SCALEUP_BANDWIDTH_PCT"),
        ({"MM_CONC_SCALEUP_BANDWIDTH_PCT": "201"}, "MM_CONC_SCALEUP_BANDWIDTH_PCT"),
        ({"MESHD_REQUEST_TIMEOUT_MS": "-5"}, "MESHD_REQUEST_TIMEOUT_MS"),
    ]:
        with pytest.raises(ConfigError, match=name):
            load_config(None, bad)


def test_eviction_switch() -> None:
    from meshd.decisions.cache import Eviction

    assert load_config(None, {}).eviction is Eviction.CAPPED  # meshd's order is the default
    assert load_config(None, {"MESHD_EVICTION": "lrfu"}).eviction is Eviction.LRFU
    assert load_config(None, {"MESHD_EVICTION": "LRU"}).eviction is Eviction.LRU  # upstream's, one setting away
    assert load_config(None, {"MESHD_EVICTION": "gdsf"}).eviction is Eviction.GDSF
    assert load_config(None, {"MESHD_EVICTION": "adaptive"}).eviction is Eviction.ADAPTIVE
    assert load_config(None, {"MESHD_EVICTION": " Rate-Capped "}).eviction is Eviction.CAPPED
    with pytest.raises(ConfigError, match="lru, gdsf, lrfu"):
        load_config(None, {"MESHD_EVICTION": "arc"})


def test_native_data_plane_setting(tmp_path: Path) -> None:
    assert load_config(None, {}).data_plane == "python"  # the default: every request through Python
    fake = tmp_path / "haproxy"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    cfg = load_config(None, {"MESHD_DATAPLANE": "native", "MESHD_HAPROXY": str(fake)})
    assert (cfg.data_plane, cfg.haproxy) == ("native", str(fake))
    missing = {"MESHD_HAPROXY": str(tmp_path / "no-such-haproxy")}
    # auto: native where HAProxy is found, else the Python path
    assert load_config(None, {**missing, "MESHD_DATAPLANE": "auto"}).data_plane == "python"
    assert load_config(None, {"MESHD_DATAPLANE": "AUTO", "MESHD_HAPROXY": str(fake)}).data_plane == "native"
    needs = r"MESHD_DATAPLANE \(--dataplane\) is native, which needs HAProxy .*no-such-haproxy.*apt-get install"
    with pytest.raises(ConfigError, match=needs):
        load_config(None, {**missing, "MESHD_DATAPLANE": "native"})
    folder = {"MESHD_HAPROXY": str(tmp_path)}  # a directory is not an executable (it used to pass here)
    with pytest.raises(ConfigError, match=r"is native, which needs HAProxy .*not an executable found here"):
        load_config(None, {**folder, "MESHD_DATAPLANE": "native"})
    with pytest.raises(ConfigError, match=r"is 0 \(any free port\), which HAProxy cannot bind"):
        load_config(None, {"MESHD_DATAPLANE": "native", "MESHD_HAPROXY": str(fake), "MM_SVC_GRPC_PORT": "0"})
    with pytest.raises(ConfigError, match=r"MESHD_DATAPLANE \(--dataplane\) must be one of python, native, auto"):
        load_config(None, {"MESHD_DATAPLANE": "envoy"})


def test_load_queue_switch() -> None:
    cfg = load_config(None, {})
    assert cfg.load_queue and cfg.load_wait_limit_ms == 10_000  # meshd's value-ordered queue by default
    cfg = load_config(None, {"MESHD_LOAD_QUEUE": "FIFO", "MESHD_LOAD_WAIT_LIMIT_MS": "30000"})
    assert not cfg.load_queue and cfg.load_wait_limit_ms == 30_000  # upstream's queue, one setting away


def test_the_latency_target_is_off_by_default_and_a_bad_one_is_a_clear_error() -> None:
    assert load_config(None, {}).latency_target_ms == 0
    assert load_config(None, {"MESHD_LATENCY_TARGET_MS": "1500"}).latency_target_ms == 1500
    for bad, says in (("soon", "must be an integer"), ("-1", "must be at least 0")):
        with pytest.raises(ConfigError, match=rf"MESHD_LATENCY_TARGET_MS .*{says}"):
            load_config(None, {"MESHD_LATENCY_TARGET_MS": bad})


def test_http_port_and_model_repository(tmp_path: object) -> None:
    assert load_config(None, {}).http_port == 8091  # not 8008: the pod's rest-proxy holds it
    assert load_config(None, {}).model_repository is None
    for off in ("disabled", "off", "Disabled"):
        assert load_config(None, {"MESHD_HTTP_PORT": off}).http_port is None
    cfg = parse(["--http-port", "0", "--model-repository", str(tmp_path), "--model-repository-type", "demo"], {})
    assert cfg.http_port == 0  # type: ignore[attr-defined]
    assert str(cfg.model_repository) == str(tmp_path)  # type: ignore[attr-defined]
    assert cfg.model_repository_type == "demo"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MESHD_HTTP_PORT": "http"}, "MESHD_HTTP_PORT"),
        ({"MESHD_HTTP_PORT": "70000"}, "MESHD_HTTP_PORT"),
        ({"MESHD_MODEL_REPOSITORY": "/no/such/dir"}, "MESHD_MODEL_REPOSITORY .*not a directory"),
    ],
)
def test_bad_http_and_repository_settings_name_themselves(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, env)


def test_watch_trace_file(tmp_path: Path) -> None:
    assert load_config(None, {}).watch_trace is None
    path = tmp_path / "trace.txt"
    assert load_config(None, {"MESHD_WATCH_TRACE": str(path)}).watch_trace == path
    with pytest.raises(ConfigError, match=r"MESHD_WATCH_TRACE .*does not exist"):
        load_config(None, {"MESHD_WATCH_TRACE": str(tmp_path / "no" / "trace.txt")})
    with pytest.raises(ConfigError, match=r"MESHD_WATCH_TRACE .*is a directory"):
        load_config(None, {"MESHD_WATCH_TRACE": str(tmp_path)})
    # A file that cannot be opened for append (even by root) is a one-line start-up error,
    # not a traceback when the mirror starts.
    with pytest.raises(ConfigError, match=r"MESHD_WATCH_TRACE .*cannot write") as e:
        load_config(None, {"MESHD_WATCH_TRACE": "/proc/version"})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", ["1023", "99999999999", "2147483648", "8k"])
def test_max_headers_size_is_bounded(value: str) -> None:
    """grpc takes a C int: a larger value used to fail server creation with a traceback."""
    with pytest.raises(ConfigError, match="MM_SVC_GRPC_MAX_HEADERS_SIZE") as e:
        load_config(None, {"MM_SVC_GRPC_MAX_HEADERS_SIZE": value})
    assert "\n" not in str(e.value)
    assert load_config(None, {"MM_SVC_GRPC_MAX_HEADERS_SIZE": "2147483647"}).max_headers_size == 2**31 - 1


@pytest.mark.parametrize(
    ("kv_store", "prefix", "expected"),
    [
        # upstream (kv-utils): root prefix + "/" + MM_KVSTORE_PREFIX + "/" + service, root as given
        (None, None, "/tas-runtime/svc"),
        ("etcd:127.0.0.1:2379", "mm", "/mm/svc"),
        ("etcd:127.0.0.1:2379;rootPrefix=modelmesh-serving", "mm", "modelmesh-serving/mm/svc"),
        ('etcd:{"endpoints": "e:1", "root_prefix": "/r/"}', "mm", "/r//mm/svc"),
        ('etcd:{"endpoints": "e:1", "root_prefix": "/r"}', None, "/r/tas-runtime/svc"),
    ],
)
def test_key_prefix_follows_upstreams_key_rule(kv_store: str | None, prefix: str | None, expected: str) -> None:
    env = {"MM_SERVICE_NAME": "svc"}
    if kv_store:
        env["KV_STORE"] = kv_store
    if prefix:
        env["MM_KVSTORE_PREFIX"] = prefix
    assert load_config(None, env).key_prefix == expected


@pytest.mark.parametrize("bad", ["a/b", "a b", ""])
def test_kv_prefix_is_one_segment(bad: str) -> None:
    with pytest.raises(ConfigError, match="MM_KVSTORE_PREFIX"):
        parse(["--kv-prefix", bad], {})


def test_bad_kv_store_is_a_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from meshd.cli import main

    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{nope")
    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"endpoints": "e:1", "root-prefix": "x"}')
    unreadable = tmp_path / "cert.json"
    unreadable.write_text('{"endpoints": "https://e:1", "certificate_file": "missing.pem"}')
    not_pem = tmp_path / "notpem.json"
    (tmp_path / "junk.pem").write_text("junk")
    not_pem.write_text('{"endpoints": "https://e:1", "certificate_file": "junk.pem"}')
    half_client = tmp_path / "half.json"
    half_client.write_text('{"endpoints": "https://e:1", "client_key": "-----BEGIN PRIVATE KEY-----"}')
    cases = {
        str(tmp_path / "absent.json"): "not found",
        str(bad_json): "not valid JSON",
        str(unknown): "unknown key(s) root-prefix",
        str(unreadable): "cannot read certificate_file",
        str(not_pem): "certificate is not PEM",
        str(half_client): "both or neither",
    }
    for path, message in cases.items():
        assert main(["serve", "--kv-store", f"etcd:{path}"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "env",
    [
        {"MM_SVC_GRPC_PORT": "70000"},
        {"MESHD_PEER_PORT": "65536"},
        {"INTERNAL_GRPC_PORT": "70000"},
        {"INTERNAL_SERVING_GRPC_PORT": "99999"},
    ],
)
def test_ports_above_65535_are_refused(env: dict[str, str]) -> None:
    """grpc took them modulo 65536 (70000 listened on 4464)."""
    with pytest.raises(ConfigError, match=f"{next(iter(env))} .*between") as e:
        load_config(None, env)
    assert "\n" not in str(e.value)
    port_env = next(iter(env))
    assert load_config(None, {port_env: "65535"}) is not None


def test_http_port_error_says_it_can_be_disabled() -> None:
    with pytest.raises(ConfigError, match=r"MESHD_HTTP_PORT .*'disabled'"):
        load_config(None, {"MESHD_HTTP_PORT": "no"})


@pytest.mark.parametrize("bad", ["bad/id", "two words", "", "tab\there", "é", "x" * 254])
def test_bad_instance_ids_are_a_config_error(bad: str) -> None:
    """An instance id is an etcd key segment: 'bad/id' used to end in a traceback after the
    embedded etcd had started and the runtime had purged its models."""
    if bad == "":
        assert load_config(None, {"MESHD_INSTANCE_ID": ""}).instance_id  # unset: from the host name
        return
    with pytest.raises(ConfigError, match="MESHD_INSTANCE_ID") as e:
        load_config(None, {"MESHD_INSTANCE_ID": bad})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("good", ["solo", "pod-7f9c.a", "meshd-0", "10.0.0.1:8080"])
def test_instance_ids_that_are_fine(good: str) -> None:
    assert load_config(None, {"MESHD_INSTANCE_ID": good}).instance_id == good


def test_upstream_pod_settings() -> None:
    from meshd.config import AutoRegistration
    from meshd.observability.payloads import Processor

    cfg = load_config(None, {})
    assert (cfg.probe_port, cfg.prestop_port) == (8089, 8090)  # upstream's ports
    assert cfg.max_connection_age_s is None and cfg.payload_processors == () and not cfg.kv_read_only
    assert cfg.warnings == ()  # meshd's defaults warn about nothing
    env = {
        "MM_PROBE_PORT": "disabled",
        "MM_PRESTOP_WAIT_PORT": "9090",
        "MM_SVC_GRPC_MAX_CONNECTION_AGE_SECS": "300",
        "MM_SVC_GRPC_MAX_CONNECTION_AGE_GRACE_SECS": "10",
        "MM_PAYLOAD_PROCESSORS": "logger:// http://127.0.0.1:1/p",
        "MM_PAYLOAD_PROCESSORS_CAPACITY": "8",
        "MM_LOG_REQUEST_HEADERS": '{"X-Request-Id": "requestId"}',
        "MM_INFO_METRICS": "assistant_deployment_info;deployment=DEPLOY,slot=SLOT",
        "DEPLOY": "blue",
        "SLOT": "",  # set, even empty: upstream takes it
        "KV_READ_ONLY": "true",
        "MM_LOCATION": "10.0.0.7",
        "MM_AUTO_REGISTER_MODELS": '[{"modelId": "m1", "modelInfo": {"type": "t", "path": "/p"}, "vModelId": "v1"}]',
    }
    cfg = load_config(None, env)
    assert cfg.probe_port is None and cfg.prestop_port == 9090
    assert (cfg.max_connection_age_s, cfg.max_connection_age_grace_s) == (300, 10)
    assert cfg.payload_processors == (Processor("logger", ""), Processor("http", "http://127.0.0.1:1/p"))
    assert cfg.payload_capacity == 8
    assert cfg.log_request_headers == {"x-request-id": "requestId"}  # gRPC header names are lower case
    assert cfg.info_metrics is not None and cfg.info_metrics.labels == {"deployment": "blue", "slot": ""}
    assert cfg.kv_read_only and cfg.location == "10.0.0.7"
    assert cfg.auto_register == (AutoRegistration("m1", "t", "/p", "", "v1", False),)
    for bad, what in (
        ({"MM_PAYLOAD_PROCESSORS": "ftp://x"}, "MM_PAYLOAD_PROCESSORS"),
        ({"MM_LOG_REQUEST_HEADERS": "[1]"}, "MM_LOG_REQUEST_HEADERS"),
        ({"MM_INFO_METRICS": "bad name;x=Y"}, "MM_INFO_METRICS"),
        ({"MM_INFO_METRICS": "info;slot=UNSET_VAR"}, r"MM_INFO_METRICS .*: UNSET_VAR \(label slot\) is not set"),
        ({"KV_READ_ONLY": "yes"}, "KV_READ_ONLY"),
        ({"MM_AUTO_REGISTER_MODELS": '[{"modelId": "m"}]'}, "MM_AUTO_REGISTER_MODELS"),
        ({"MM_SVC_GRPC_MAX_CONNECTION_AGE_SECS": "0"}, "MM_SVC_GRPC_MAX_CONNECTION_AGE_SECS"),
    ):
        with pytest.raises(ConfigError, match=what):
            load_config(None, bad)


@pytest.mark.parametrize("off", ["NONE", "none", "disabled", "Off"])
def test_the_probe_port_turns_off_as_upstreams_start_sh_does(off: str) -> None:
    assert load_config(None, {"MM_PROBE_PORT": off}).probe_port is None


@pytest.mark.parametrize(
    "both",
    [
        {"INTERNAL_GRPC_PORT": "8085", "INTERNAL_GRPC_SOCKET_PATH": "/tmp/mmesh/grpc.sock"},
        {"INTERNAL_SERVING_GRPC_PORT": "8001", "INTERNAL_SERVING_GRPC_SOCKET_PATH": "/tmp/mmesh/serve.sock"},
    ],
)
def test_a_runtime_port_and_socket_together_are_refused_as_upstream_does(both: dict[str, str]) -> None:
    port, socket = both
    with pytest.raises(ConfigError, match=f"give {port} .* or {socket} .*, not both"):
        load_config(None, both)
    load_config(None, {socket: both[socket]})  # either alone is fine


def test_unsupported_upstream_variables_get_one_warning_each() -> None:
    cfg = load_config(None, {"MM_SEND_DEST_ID": "true", "TAS_OLD_THING": "1", "HEAP_SIZE_MB": "640", "OTHER": "x"})
    named = sorted(w.split(" ")[0] for w in cfg.warnings)
    assert named == ["HEAP_SIZE_MB", "MM_SEND_DEST_ID", "TAS_OLD_THING"]


def test_metrics_without_a_scheme_is_https_only_with_a_certificate() -> None:
    # Upstream's default scheme is https; without MM_TLS_* meshd has no certificate: http, said once.
    cfg = load_config(None, {"MM_METRICS": "prometheus:port=2113"})
    assert cfg.metrics.https is False and len(cfg.warnings) == 1 and "MM_METRICS" in cfg.warnings[0]
    cfg = load_config(None, {"MM_METRICS": "prometheus:port=2112;scheme=http"})
    assert cfg.metrics.https is False and cfg.warnings == ()


def test_the_metrics_port_ports_auto_chose_is_not_warned_of() -> None:
    """MESHD_PORTS=auto picks the metrics port itself: the user wrote no MM_METRICS, so there is
    nothing to warn about (issue 45); the scheme is the default's."""
    cfg = load_config(None, {"MESHD_PORTS": "auto"})
    assert cfg.metrics.enabled and cfg.metrics.port != 2112
    assert cfg.metrics.https is False and cfg.warnings == ()
    cfg = load_config(None, {"MESHD_PORTS": "auto", "MM_METRICS": "prometheus:port=2113"})  # written: said
    assert len(cfg.warnings) == 1 and "names no scheme" in cfg.warnings[0]


def test_metrics_without_a_scheme_is_https_with_the_instance_certificate(tmp_path: Path) -> None:
    from meshd.testing.certs import TestCA

    ca = TestCA(tmp_path)
    issued = ca.issue("meshd-0")
    env = {
        "MM_TLS_KEY_CERT_PATH": str(issued.cert),
        "MM_TLS_PRIVATE_KEY_PATH": str(issued.key),
        "MM_TLS_TRUST_CERT_PATH": str(ca.cert),
    }
    cfg = load_config(None, env | {"MM_METRICS": "prometheus:port=2113"})
    assert cfg.metrics.https is True and cfg.warnings == ()


def test_metrics_https_without_a_certificate_is_self_signed_and_said() -> None:
    import ssl

    from meshd.security.tls import self_signed_server_context

    cfg = load_config(None, {"MM_METRICS": "prometheus:port=2112;scheme=https"})  # modelmesh-serving's default
    assert cfg.metrics.https is True and any("self-signed" in w for w in cfg.warnings)
    assert isinstance(self_signed_server_context(), ssl.SSLContext)


def test_auto_register_reads_upstreams_other_spelling() -> None:
    cfg = load_config(None, {"MM_AUTO_REGISTER_MODEL": '[{"modelId": "m", "modelInfo": {"type": "t"}}]'})
    assert [a.model_id for a in cfg.auto_register] == ["m"] and cfg.warnings == ()


def test_instance_id_is_the_pod_names_tail_as_upstreams() -> None:
    assert load_config(None, {"WKUBE_POD_NAME": "modelmesh-serving-mlserver-1.x-6d8f9c7b5d-x2x7k"}).instance_id == (
        "9c7b5d-x2x7k"
    )
    assert load_config(None, {"WKUBE_POD_NAME": "p", "MESHD_INSTANCE_ID": "mine"}).instance_id == "mine"


def test_a_service_version_whose_number_overflows_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"SERVICE_VERSION.*64-bit"):
        load_config(None, {"SERVICE_VERSION": "9" * 30})
    assert load_config(None, {"SERVICE_VERSION": "modelmesh-20230512-7"}).service_version == "modelmesh-20230512-7"
    # A digit int() refuses (superscript two) is not a number here: version 1.0.0, no traceback.
    assert load_config(None, {"SERVICE_VERSION": "1.\u00b2"}).service_version == "1.\u00b2"


@pytest.mark.parametrize(
    ("env", "host"),
    [
        ({"WKUBE_POD_IPADDR": "fd00::7"}, "fd00::7"),
        ({"MESHD_ADVERTISE_HOST": "[fd00::7]"}, "fd00::7"),  # bracketed by the user: one pair when written
        ({"WKUBE_POD_IPADDR": "10.0.0.7"}, "10.0.0.7"),
    ],
)
def test_an_ipv6_pod_ip_is_kept_bare_for_the_addresses_built_from_it(env: dict[str, str], host: str) -> None:
    assert load_config(None, env).advertise_host == host
