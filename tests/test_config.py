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
    assert cfg.key_prefix == "mm/modelmesh"


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
    assert cfg.key_prefix == "pre/svc"  # type: ignore[attr-defined]


def test_kv_store_forms() -> None:
    assert parse_kv_store("etcd:127.0.0.1:2379").url == "http://127.0.0.1:2379"
    t = parse_kv_store(
        'etcd:{"endpoints": "http://e1:2379,http://e2:2379", "root_prefix": "modelmesh-serving/mm_ns/ns"}'
    )
    # Every member is kept: meshd fails over between them (a lost member is not a lost etcd).
    assert (t.url, t.root_prefix) == ("http://e1:2379,http://e2:2379", "modelmesh-serving/mm_ns/ns")
    assert parse_kv_store("etcd:10.0.0.1:2379, http://10.0.0.2:2379").url == "http://10.0.0.1:2379,http://10.0.0.2:2379"
    for bad in ["zookeeper:x", "etcd:{bad json", 'etcd:{"x": 1}', "etcd:http://nohostport", "etcd:a:1,nohostport"]:
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
    from meshd.cache import Eviction

    assert load_config(None, {}).eviction is Eviction.LRU  # upstream's order stays the default
    assert load_config(None, {"MESHD_EVICTION": "GDSF"}).eviction is Eviction.GDSF


def test_http_port_and_model_repository(tmp_path: object) -> None:
    assert load_config(None, {}).http_port == 8008  # upstream's REST proxy port
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
