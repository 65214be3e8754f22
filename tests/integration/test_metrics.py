"""/metrics and the per-invocation log of real `meshd serve` processes after real traffic:
a peer hop, a cache miss, a vmodel, a load failure and a NOT_FOUND."""

from __future__ import annotations

import json
import re
import urllib.request
from collections import defaultdict
from collections.abc import Callable

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.runtimes.models import GeneratedModel, make_infer_request
from meshd.testing.procs import free_port, wait_until

from .conftest import NodeFactory
from .test_mesh import load_on

pytestmark = [pytest.mark.slow, pytest.mark.both_data_planes]

ROWS = [[1.0, 2.0, 3.0, 4.0]]
INFER = "ModelInfer"  # the metrics' method label (upstream's short names)
INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"  # the invoke log's method

Series = dict[str, list[tuple[dict[str, str], float]]]


def raw(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text: str = r.read().decode()
    return text


def scrape(port: int) -> Series:
    """Every sample by name, as prometheus_client's parser names them."""
    text = raw(port)
    out: Series = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name].append((s.labels, s.value))
    return out


def total(series: Series, name: str, **labels: str) -> float:
    return sum(v for lab, v in series.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def fails(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    code: grpc.StatusCode = e.value.code()
    return code


def test_metrics_and_invoke_log_after_traffic(start_node: NodeFactory, models: list[GeneratedModel]) -> None:
    held_on_b, cold, bad = models[0], models[1], models[2]
    fail_bad = ["--fail-load", bad.id]
    pa, pb = free_port(), free_port()
    a = start_node(
        "inst-a",
        runtime_args=fail_bad,
        settings={
            "metrics": f"prometheus:port={pa};per_model_metrics=true",
            "log_each_invoke": "true",
            "log_format": "json",
        },
    )
    b = start_node("inst-b", settings={"metrics": f"prometheus:port={pb}"}, runtime_args=fail_bad)
    for m in (held_on_b, cold, bad):
        a.register(m)
    load_on(b, held_on_b.id)

    calls_to_a = 0

    def via_a(model_id: str, header: str = "mm-model-id") -> None:
        nonlocal calls_to_a
        calls_to_a += 1
        a.v2.ModelInfer(make_infer_request(model_id, ROWS), metadata=((header, model_id),), timeout=30)

    for _ in range(2):  # a holds no copy: a peer hop to b
        via_a(held_on_b.id)
    via_a(cold.id)  # no copy anywhere: a cache miss and a load (here or on b)
    a.mm.setVModel(mm.SetVModelRequest(vModelId="vm", targetModelId=held_on_b.id), timeout=30)
    via_a("vm", "mm-vmodel-id")
    assert fails(lambda: via_a("no-such-model")) == grpc.StatusCode.NOT_FOUND
    assert fails(lambda: via_a(bad.id)) == grpc.StatusCode.INTERNAL  # its loads fail on both (upstream: INTERNAL)

    # A failed call is recorded just after its status goes out (context.abort sends it first),
    # so the last failure may reach the exposition a moment after the client saw it.
    api = "modelmesh_api_request_milliseconds_count"
    wait_until(lambda: total(scrape(pa), api) == calls_to_a, 10, "every call to a to be recorded")
    ma, mb = scrape(pa), scrape(pb)

    # External requests at a, per model (per_model_metrics on a): ids and codes as sent.
    assert total(ma, api, method=INFER, code="OK", modelId=held_on_b.id, vModelId="") == 2
    assert total(ma, api, method=INFER, code="OK", modelId=held_on_b.id, vModelId="vm") == 1
    assert total(ma, api, method=INFER, code="OK", modelId=cold.id) == 1
    # An id that names no model gets no series of its own (clients choose ids).
    assert total(ma, api, method=INFER, code="NOT_FOUND", modelId="") == 1
    assert total(ma, api, modelId="no-such-model") == 0
    assert total(ma, api) == calls_to_a
    assert total(ma, "modelmesh_request_size_bytes_count") == calls_to_a
    assert total(ma, "modelmesh_response_size_bytes_count", code="OK") == 4
    # b has no per-model labels; its runtime served the 3 calls a sent it, plus b's own.
    assert all("modelId" not in lab for name in mb for lab, _ in mb[name])
    invoked_b = total(mb, "modelmesh_invoke_model_milliseconds_count", method=INFER, code="OK")
    invoked_a = total(ma, "modelmesh_invoke_model_milliseconds_count", method=INFER, code="OK")
    assert invoked_b >= 3 and invoked_a + invoked_b == 4  # the cold model served once, wherever it loaded
    assert total(ma, "modelmesh_invoke_model_milliseconds_count", modelId=held_on_b.id) == 0  # served on b

    # Loads: held_on_b and cold succeeded; the cold one was a cache miss where it loaded.
    loads = total(ma, "modelmesh_loadmodel_milliseconds_count") + total(mb, "modelmesh_loadmodel_milliseconds_count")
    assert loads >= 2
    misses = total(ma, "modelmesh_cache_miss_milliseconds_count") + total(mb, "modelmesh_cache_miss_milliseconds_count")
    assert misses >= 1
    # The parser reads a counter's sample as `<name>_total`; on the wire it is upstream's name.
    failures = total(ma, "modelmesh_loadmodel_failure_total") + total(mb, "modelmesh_loadmodel_failure_total")
    assert failures >= 1
    for port in (pa, pb):
        text = raw(port)
        assert re.search(r"^modelmesh_loadmodel_failure \d", text, re.M) and "loadmodel_failure_total" not in text
    assert total(mb, "modelmesh_loading_queue_delay_milliseconds_count") >= 1

    # Instance gauges on both, computed at scrape time; cluster gauges on the leader only.
    for series, client in ((ma, a), (mb, b)):
        assert total(series, "modelmesh_instance_models_total") == len(client.runtime_loaded())
        assert total(series, "modelmesh_instance_capacity_bytes") > 0
        # the default order (rate-capped) says how often its odds overruled RATE: nothing has
        # been evicted here, so never (the gauge is there, at 0)
        assert series["meshd_eviction_odds_overruled"] == [({}, 0.0)]
        assert "meshd_eviction_frequency_weight" not in series
    leaders = [port for port, s in ((pa, ma), (pb, mb)) if "modelmesh_models_managed_total" in s]
    assert len(leaders) == 1
    # The leader's mirror of the records may trail the failure record by a moment.
    wait_until(lambda: total(scrape(leaders[0]), "modelmesh_models_with_failure_total") == 1, 10, "failure gauge")
    assert total(scrape(leaders[0]), "modelmesh_models_managed_total") == 3

    # One JSON record per call at a, with its fields; the peer hop names b.
    records = []
    for line in a.node.meshd.log_path.read_text().splitlines():
        if line.startswith("{"):
            obj = json.loads(line)  # every JSON line parses
            assert {"time", "level", "logger", "message"} <= obj.keys()
            if obj["logger"] == "meshd.invocations":
                records.append(obj)
    assert len(records) == calls_to_a
    hops = [r for r in records if r["modelId"] == held_on_b.id and r["vModelId"] is None]
    assert [(r["servedBy"], r["code"], r["method"]) for r in hops] == [("inst-b", "OK", INFER_PATH)] * 2
    assert all(r["level"] == "INFO" and r["durationMs"] >= 0 for r in records)
    [missing] = [r for r in records if r["code"] == "NOT_FOUND"]
    assert missing["modelId"] == "no-such-model" and missing["servedBy"] is None
    [by_vmodel] = [r for r in records if r["vModelId"] == "vm"]
    assert by_vmodel["modelId"] == held_on_b.id
