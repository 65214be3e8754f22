"""Placement by price on real meshd processes (issue 33): an instance's record says what its
next victim is worth (`meshdVictim`), and a load a peer placed by price (`meshd-price-limit`)
is refused, with nothing evicted, where it would evict more than the sender counted on; under
the limit it loads and serves as any forwarded load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from meshd._proto.inference import grpc_predict_v2_pb2 as v2
from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.core.records import VICTIM_VALUE
from meshd.kv.embedded import EmbeddedEtcd
from meshd.runtimes.models import GeneratedModel, decode_infer_response, generate_models, make_infer_request
from meshd.testing.cluster import LocalMesh
from meshd.testing.procs import wait_until

from .conftest import MODEL_SIZE, NodeFactory, close_enough, expected, listed_instances
from .test_mesh import load_on
from .test_upstream_keys import under, upstream_key

pytestmark = pytest.mark.slow

ROWS = [[1.0, 2.0, 3.0, 4.0]]


def test_a_load_placed_by_price_loads_only_where_it_evicts_no_more_than_its_limit(
    start_node: NodeFactory, mesh: LocalMesh, etcd_server: EmbeddedEtcd, models: list[GeneratedModel]
) -> None:
    a = start_node("inst-a", 2)  # room for two models
    start_node("inst-b")  # the peer the calls come from, as a sees it
    wait_until(lambda: listed_instances(a) >= {"inst-a", "inst-b"}, 15, "inst-a to see inst-b")
    cold, hot, new = models[:3]
    # Set load times, the hot copy's three times the cold one's: an unset one is a few ms of RPC
    # jitter, and a first load's slower connection made the cold copy's reload look dearer than
    # the hot one's. With equal times the jitter picked the victim until the hot copy's calls,
    # and a record published in between named the hot copy's worth, not the cold one's; with
    # the cold copy the victim throughout, every record after both loads names its worth, which
    # nothing here moves (no eviction moves the clock).
    for m, delay_ms in ((cold, 50), (hot, 150)):
        info = mm.ModelInfo(type="demo", path=str(m.path), key=f'{{"load_delay_ms": {delay_ms}}}')
        a.mm.registerModel(mm.RegisterModelRequest(modelId=m.id, modelInfo=info), timeout=10)
    a.register(new)
    load_on(a, cold.id)
    load_on(a, hot.id)
    for _ in range(3):
        assert close_enough(a.infer(hot.id, ROWS), expected(hot, ROWS))

    def victim_value() -> float | None:
        key = upstream_key("", mesh.service, "instances", "inst-a")
        value = under(etcd_server, key).get(key, {}).get(VICTIM_VALUE)
        return value if isinstance(value, float | int) else None

    wait_until(lambda: victim_value() is not None, 15, "inst-a's record to say what its next victim is worth")
    value = victim_value()
    assert value is not None

    def load_as_peer(limit: str) -> Any:
        with grpc.insecure_channel(f"127.0.0.1:{a.node.peer_port}") as ch:
            infer = ch.unary_unary(
                "/inference.GRPCInferenceService/ModelInfer",
                request_serializer=v2.ModelInferRequest.SerializeToString,
                response_deserializer=v2.ModelInferResponse.FromString,
            )
            md = (("mm-model-id", new.id), ("meshd-hop", "inst-b"), ("meshd-mode", "load"))
            return infer(make_infer_request(new.id, ROWS), metadata=(*md, ("meshd-price-limit", limit)), timeout=30)

    with pytest.raises(grpc.RpcError) as refused:  # "-inf": only free room would do, and a is full
        load_as_peer("-inf")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dict(refused.value.trailing_metadata())["meshd-reason"] == "repriced"
    assert a.runtime_loaded() == sorted([cold.id, hot.id])  # nothing evicted, nothing loaded

    with pytest.raises(grpc.RpcError) as under_value:  # just under what its next victim is worth
        load_as_peer(f"{value - 0.01:.4f}")
    assert dict(under_value.value.trailing_metadata())["meshd-reason"] == "repriced"

    answer = load_as_peer(f"{value + 0.01:.4f}")  # worth no more than the limit: loaded, served
    assert close_enough(decode_infer_response(answer), expected(new, ROWS))
    assert a.runtime_loaded() == sorted([hot.id, new.id])  # the cheap copy made the room


def test_misses_load_where_the_fleet_evicts_least_and_never_on_the_instance_whose_copies_cost_most(
    start_node: NodeFactory, mesh: LocalMesh, etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    """Four full instances (five models each: small enough to place by price, not to pack);
    inst-a's copies took 300 ms each to load, the others' a few, so a's next victim is worth
    far more (a reload costs more). Cold misses at inst-d go to the three cheapest (b, c, d)
    and none evicts from a; placement without prices would pick a for one in four."""
    per = 5
    nodes = {x: start_node(f"inst-{x}", per) for x in "abcd"}
    ingress = nodes["d"]
    wait_until(lambda: listed_instances(ingress) >= {f"inst-{x}" for x in "abcd"}, 15, "inst-d to see the fleet")
    models = generate_models(tmp_path / "models", 4 * per + 8, size_bytes=MODEL_SIZE)
    slow, quick, cold = models[:per], models[per : 4 * per], models[4 * per :]
    for m in slow:
        info = mm.ModelInfo(type="demo", path=str(m.path), key='{"load_delay_ms": 300}')
        ingress.mm.registerModel(mm.RegisterModelRequest(modelId=m.id, modelInfo=info), timeout=10)
    for m in (*quick, *cold):
        ingress.register(m)
    for m in slow:
        load_on(nodes["a"], m.id)
    for n, x in enumerate("bcd"):
        for m in quick[n * per : (n + 1) * per]:
            load_on(nodes[x], m.id)

    def values() -> dict[str, float]:
        records = under(etcd_server, upstream_key("", mesh.service, "instances"))
        out = {}
        for key, rec in records.items():
            value = rec.get(VICTIM_VALUE)
            if isinstance(value, float | int) and rec.get("count") == per:
                out[key.rsplit("/", 1)[-1]] = float(value)
        return out

    def a_dearest() -> bool:
        v = values()
        return len(v) == 4 and v["inst-a"] > max(v[f"inst-{x}"] for x in "bcd")

    wait_until(a_dearest, 15, "every record to say what its next victim is worth, inst-a's the most")
    for m in cold:
        assert close_enough(ingress.infer(m.id, ROWS), expected(m, ROWS))
    assert nodes["a"].runtime_loaded() == sorted(m.id for m in slow)  # nothing placed there, nothing evicted
    # Each miss loaded on one of the others (a later one may have evicted an earlier one there).
    assert {m.id for x in "bcd" for m in cold if m.id in nodes[x].runtime_loaded()}
