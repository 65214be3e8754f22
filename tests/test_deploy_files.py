"""The deployment files (docker-compose.yaml, deploy/k8s, deploy/grafana, deploy/prometheus).

No Docker engine or cluster exists here, so these files cannot be run; instead every meshd
command, flag and environment variable in them is checked against the real CLI parsers and
configuration loader, and every metric the dashboard plots against the names meshd exports.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshd import cli
from meshd.adapter import main as adapter_main
from meshd.config import SETTINGS, load_config
from meshd.decisions.openai import TokenTiming
from meshd.observability.metrics import ClusterStats, InstanceStats, MetricsConfig, build_metrics
from meshd.runtimes import demo as runtime_demo
from meshd.runtimes import models as gen_models

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yaml"
K8S = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
DASHBOARD = ROOT / "deploy" / "grafana" / "meshd-dashboard.json"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"

# SPEC §8: the names users already scrape.
SPEC_METRICS = {
    "modelmesh_api_request_milliseconds",
    "modelmesh_invoke_model_milliseconds",
    "modelmesh_request_size_bytes",
    "modelmesh_response_size_bytes",
    "modelmesh_cache_miss_milliseconds",
    "modelmesh_loadmodel_milliseconds",
    "modelmesh_unloadmodel_milliseconds",
    "modelmesh_req_queue_delay_milliseconds",
    "modelmesh_loading_queue_delay_milliseconds",
    "modelmesh_model_sizing_milliseconds",
    "modelmesh_age_at_eviction_milliseconds",
    "modelmesh_loaded_model_size_bytes",
    "modelmesh_loadmodel_failure",
    "modelmesh_unloadmodel_failure",
    "modelmesh_models_loaded_total",
    "modelmesh_models_with_failure_total",
    "modelmesh_models_managed_total",
    "modelmesh_instance_lru_seconds",
    "modelmesh_instance_lru_age_seconds",
    "modelmesh_instance_capacity_bytes",
    "modelmesh_instance_used_bytes",
    "modelmesh_instance_used_bps",
    "modelmesh_instance_models_total",
}
# Set by the platform, not by meshd's settings table.
PLATFORM_ENV = {"POD_IP"}


class _ParseError(Exception):
    pass


def _strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make argparse raise instead of printing usage and exiting (also for subparsers)."""

    def error(message: str) -> Any:
        raise _ParseError(f"{parser.prog}: {message}")

    parser.error = error  # type: ignore[method-assign]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _strict(sub)
    return parser


def check_meshd_argv(argv: list[str]) -> None:
    """Parse `meshd <argv>` with the parser that `meshd` itself would use."""
    assert argv, "a meshd container needs a command (the image's entrypoint is `meshd`)"
    command, rest = argv[0], argv[1:]
    own = {
        "runtime": runtime_demo.build_parser,
        "adapter": adapter_main.build_parser,
        "gen-models": gen_models.build_parser,
    }
    if command in own:
        args = _strict(own[command]()).parse_args(rest)
    else:
        args = _strict(cli.build_parser()).parse_args(argv)
    assert args is not None


def check_serve_env(env: Mapping[str, str]) -> None:
    known = {s.env for s in SETTINGS} | PLATFORM_ENV
    unknown = sorted(k for k in env if k not in known and not k.startswith("OTEL_"))
    assert not unknown, f"not meshd settings: {unknown}"
    load_config(None, env)  # every value must be accepted as `meshd serve` would


def _compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return doc


def _ours(service: Mapping[str, Any]) -> bool:
    return "build" in service or str(service.get("image", "")).startswith("meshd")


def test_dockerfile_entrypoint_is_meshd() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["meshd"\]$', text, re.M), "compose and k8s commands assume `meshd` entrypoint"


def test_compose_commands_flags_and_env_exist() -> None:
    services = _compose()["services"]
    ours = {name: s for name, s in services.items() if _ours(s)}
    assert sum(1 for s in ours.values() if s["command"][0] == "serve") == 3, "three meshd pods"
    assert sum(1 for s in ours.values() if s["command"][0] == "runtime") == 3, "three reference runtimes"
    assert any(not _ours(s) and "etcd" in str(s.get("image")) for s in services.values())
    for name, service in ours.items():
        try:
            check_meshd_argv([str(a) for a in service["command"]])
            if service["command"][0] == "serve":
                check_serve_env({k: str(v) for k, v in (service.get("environment") or {}).items()})
        except (_ParseError, AssertionError, ValueError) as e:
            pytest.fail(f"compose service {name}: {e}")


def test_compose_references_resolve() -> None:
    doc = _compose()
    services = doc["services"]
    volumes = set(doc.get("volumes") or {})
    for name, service in services.items():
        mode = service.get("network_mode", "")
        if mode.startswith("service:"):
            assert mode.split(":", 1)[1] in services, f"{name}: network_mode names no service"
            assert "ports" not in service, f"{name}: ports belong to the namespace owner"
        depends = service.get("depends_on") or []
        for dep in depends if isinstance(depends, list) else depends.keys():
            assert dep in services, f"{name}: depends on unknown {dep}"
        for volume in service.get("volumes") or []:
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name}: mounts missing {source}"
            else:
                assert source in volumes, f"{name}: unknown volume {source}"
        env = service.get("environment") or {}
        if name.startswith("meshd-"):
            # Peers dial the advertised host on the peer port; it must be the namespace owner.
            advertise = service["command"][service["command"].index("--advertise-host") + 1]
            assert mode == f"service:{advertise}", f"{name}: advertises {advertise}, lives in {mode}"
            assert env.get("KV_STORE") == "etcd:http://etcd:2379"


def _k8s_docs() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in K8S:
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for d in docs:
        if d["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}:
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]


def test_k8s_manifests_commands_flags_and_env_exist() -> None:
    docs = _k8s_docs()
    assert K8S, "example manifests exist"
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    checked = 0
    for workload, spec in _pod_specs(docs):
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            if not str(container["image"]).startswith("meshd"):
                continue
            where = f"{workload}/{container['name']}"
            argv = [str(a) for a in container.get("command", [])[1:] + container.get("args", [])]
            env: dict[str, str] = {}
            for source in container.get("envFrom", []):
                name = source["configMapRef"]["name"]
                assert name in config_maps, f"{where}: no ConfigMap {name}"
                env.update(config_maps[name])
            for item in container.get("env", []):
                env[item["name"]] = str(item.get("value", "10.0.0.7"))  # downward-API values: an IP
            try:
                check_meshd_argv(argv)
                if argv[0] == "serve":
                    check_serve_env(env)
                    checked += 1
            except (_ParseError, AssertionError, ValueError) as e:
                pytest.fail(f"{where}: {e}")
    assert checked, "a meshd serve container"


def test_k8s_ports_and_probes_agree_with_settings() -> None:
    docs = _k8s_docs()
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    workloads = [d for d in docs if d["kind"] in {"Deployment", "StatefulSet"}]
    for svc in (d for d in docs if d["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        matching = [w for w in workloads if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert matching, f"service {svc['metadata']['name']} selects nothing"
        containers = [c for w in matching for c in w["spec"]["template"]["spec"]["containers"]]
        named = {p["name"] for c in containers for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert not isinstance(port["targetPort"], str) or port["targetPort"] in named, port
    for workload, spec in _pod_specs(docs):
        for container in spec["containers"]:
            if container.get("args", [None])[0] != "serve":
                continue
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            env: dict[str, str] = {}
            for source in container.get("envFrom", []):
                env.update(config_maps[source["configMapRef"]["name"]])
            cfg = load_config(None, env)
            assert ports["grpc"] == cfg.grpc_port and ports["peer"] == cfg.peer_port, workload
            assert ports["http"] == cfg.http_port and ports["metrics"] == cfg.metrics.port, workload
            assert ports["probes"] == cfg.probe_port and ports["prestop"] == cfg.prestop_port, workload
            # A modelmesh-serving pod's rest-proxy holds 8008: meshd's own ports keep clear of it.
            assert 8008 not in ports.values(), workload
            # Upstream's HTTP probes, on the probe port.
            assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": cfg.probe_port}, workload
            assert container["livenessProbe"]["httpGet"] == {"path": "/live", "port": cfg.probe_port}, workload
            hook = container["lifecycle"]["preStop"]["exec"]["command"]
            assert hook == ["/opt/kserve/mmesh/stop.sh", "wait"], workload
            assert cli.build_parser().parse_args(["stop", "wait"]).mode == "wait"


def test_image_ships_stop_sh_where_upstream_has_it() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY deploy/image/stop.sh /opt/kserve/mmesh/stop.sh" in dockerfile
    script = ROOT / "deploy" / "image" / "stop.sh"
    assert script.stat().st_mode & 0o111, "stop.sh must be executable"
    assert "exec meshd stop" in script.read_text()
    exposed = {int(p) for p in re.findall(r"\b\d{4}\b", dockerfile.split("EXPOSE", 1)[1].splitlines()[0])}
    cfg = load_config(None, {})
    assert {cfg.grpc_port, cfg.peer_port, cfg.http_port, cfg.probe_port, cfg.prestop_port} <= exposed
    assert 8008 not in exposed


def exported_samples() -> set[str]:
    """Every sample name meshd's /metrics shows once each metric has a value (the leader's
    gauges included), read from the real exposition."""
    m = build_metrics(MetricsConfig())
    stats = InstanceStats(lru_ms=0, now_ms=1000, capacity_units=8, used_units=4, models=1, eviction_odds_overruled=0.2)
    m.watch_instance(lambda: stats)
    m.watch_cluster(lambda: ClusterStats(models_managed=1, models_loaded=1, models_with_failure=0))
    m.api_request("/inference.GRPCInferenceService/ModelInfer", "OK", 1.0, 10, 10, "m", "")
    m.invoke_model("/inference.GRPCInferenceService/ModelInfer", "OK", 1.0, "m")
    for observe in (m.req_queue_delay, m.cache_miss, m.loading_queue_delay, m.load, m.unload, m.model_sizing):
        observe(1.0, "m")
    m.age_at_eviction(1.0, "m")
    m.loaded_model_size(1, "m")
    m.load_failure()
    m.load_refused()
    m.unload_failure()
    m.payloads_dropped()
    m.llm_call("m", TokenTiming("chat", 0.1, 0.01, 10, 5))
    text = m.exposition().decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_grafana_dashboard_plots_only_exported_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dash["templating"]["list"] if v.get("type") == "query"]
    assert exprs
    labels = {"gen_ai_operation_name", "gen_ai_request_model", "gen_ai_token_type"}
    used = {n for expr in exprs for n in re.findall(r"\b(?:modelmesh|gen_ai|meshd)_[a-z_]+", expr)} - labels
    samples = exported_samples()
    assert used <= samples, sorted(used - samples)
    # Every metric of SPEC §8 is exported; the dashboard covers the request path, loads,
    # the cache and the leader's cluster gauges.
    families = {re.sub(r"_(bucket|count|sum)$", "", n) for n in samples}
    assert families >= SPEC_METRICS, sorted(SPEC_METRICS - families)
    plotted = {re.sub(r"_(bucket|count|sum)$", "", n) for n in used}
    assert {"modelmesh_api_request_milliseconds", "modelmesh_loadmodel_milliseconds"} <= plotted
    assert "modelmesh_models_managed_total" in plotted and "modelmesh_instance_used_bytes" in plotted
    # Language models: time to first token, time per output token, tokens (issue 43).
    assert {"gen_ai_server_time_to_first_token_seconds", "gen_ai_client_token_usage"} <= plotted
    # What the default eviction order learnt (issue 44).
    assert "meshd_eviction_odds_overruled" in plotted


def test_prometheus_scrapes_each_compose_pod_on_the_metrics_port() -> None:
    targets = yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"][0]["static_configs"][0]["targets"]
    services = _compose()["services"]
    for name, service in services.items():
        if _ours(service) and service["command"][0] == "serve":
            cfg = load_config(None, {k: str(v) for k, v in service["environment"].items()})
            owner = service["network_mode"].split(":", 1)[1]
            assert cfg.metrics.enabled and f"{owner}:{cfg.metrics.port}" in targets, f"{name} not scraped"
