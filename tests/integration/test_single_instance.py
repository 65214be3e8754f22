"""One meshd instance beside one reference runtime, on a real etcd (SPEC §2-3)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import pytest

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.kv.embedded import EmbeddedEtcd
from meshd.kv.etcd import EtcdStore
from meshd.runtimes.models import GeneratedModel, make_infer_request
from meshd.testing.procs import wait_until

from .conftest import NodeFactory, close_enough, expected

pytestmark = pytest.mark.slow

ROWS = [[0.5, -1.0, 2.0, 0.25], [1.0, 1.0, 1.0, 1.0]]
ST = mm.ModelStatusInfo
T = TypeVar("T")


def test_register_infer_and_status(start_node: NodeFactory, models: list[GeneratedModel]) -> None:
    c = start_node()
    m = models[0]
    assert c.register(m).status == ST.NOT_LOADED
    assert c.status(m.id).status == ST.NOT_LOADED
    assert close_enough(c.infer(m.id, ROWS), expected(m, ROWS))
    st = c.status(m.id)
    assert st.status == ST.LOADED
    assert [(x.location, x.copyStatus) for x in st.modelCopyInfos] == [("inst-a", ST.LOADED)]
    assert c.runtime_loaded() == [m.id]
    # The -bin header names the same model.
    assert close_enough(c.infer(m.id, ROWS, header="mm-model-id-bin"), expected(m, ROWS))
    # Idempotent for identical info, ALREADY_EXISTS for different info.
    assert c.register(m).status == ST.LOADED
    with pytest.raises(grpc.RpcError) as e:
        c.mm.registerModel(
            mm.RegisterModelRequest(modelId=m.id, modelInfo=mm.ModelInfo(type="other", path=str(m.path))), timeout=10
        )
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    stats = c.stats()
    assert (stats.loads, stats.misses, stats.hits) == (1, 1, 1)


def test_ensure_loaded_sync_async_and_unregister(start_node: NodeFactory, models: list[GeneratedModel]) -> None:
    c = start_node(runtime_args=["--load-delay-ms", "300"])
    a, b = models[0], models[1]
    c.register(a)
    c.register(b)
    st = c.mm.ensureLoaded(mm.EnsureLoadedRequest(modelId=a.id, sync=True), timeout=30)
    assert st.status == ST.LOADED
    st = c.mm.ensureLoaded(mm.EnsureLoadedRequest(modelId=b.id, sync=False), timeout=30)
    assert st.status == ST.LOADING  # returned before the 300 ms load finished
    assert close_enough(c.infer(b.id, ROWS), expected(b, ROWS))
    assert c.runtime_loaded() == sorted([a.id, b.id])
    # Unregister unloads from the runtime; unregistering again is a no-op.
    c.mm.unregisterModel(mm.UnregisterModelRequest(modelId=a.id), timeout=10)
    c.mm.unregisterModel(mm.UnregisterModelRequest(modelId=a.id), timeout=10)
    assert c.status(a.id).status == ST.NOT_FOUND
    wait_until(lambda: c.runtime_loaded() == [b.id], 10, "the runtime to unload the unregistered model")
    with pytest.raises(grpc.RpcError) as e:
        c.mm.ensureLoaded(mm.EnsureLoadedRequest(modelId=a.id), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # registerModel(loadNow, sync) loads before answering.
    assert c.register(a, loadNow=True, sync=True).status == ST.LOADED


def test_capacity_for_three_while_five_are_used(start_node: NodeFactory, models: list[GeneratedModel]) -> None:
    c = start_node(capacity_models=3)
    used = models[:5]
    for m in used:
        c.register(m)
    for round_ in range(4):
        for m in used:
            rows = [[float(round_), 1.0, -2.0, 0.5]]
            assert close_enough(c.infer(m.id, rows), expected(m, rows)), m.id
        assert len(c.runtime_loaded()) <= 3
    stats = c.stats()
    assert stats.evictions > 0
    assert stats.loads == stats.evictions + len(stats.loadedModels)
    assert len(stats.loadedModels) <= 3
    # Records agree with the runtime: the copies named are exactly those loaded.
    loaded = set(c.runtime_loaded())
    for m in used:
        st = c.status(m.id)
        assert (st.status == ST.LOADED) == (m.id in loaded), m.id


def test_load_failure_is_recorded(start_node: NodeFactory, models: list[GeneratedModel]) -> None:
    bad, good = models[0], models[1]
    c = start_node(runtime_args=["--fail-load", bad.id])
    c.register(bad)
    c.register(good)
    with pytest.raises(grpc.RpcError) as e:
        c.infer(bad.id, ROWS)
    # Upstream's answer to a load failure: INTERNAL, the runtime's message first.
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert e.value.details().startswith("runtime failed to load model-0000: INTERNAL: injected load failure")
    assert bad.id in e.value.details()
    st = c.status(bad.id)
    assert st.status == ST.LOADING_FAILED
    assert any("injected load failure" in err for err in st.errors)
    assert close_enough(c.infer(good.id, ROWS), expected(good, ROWS))
    assert c.runtime_loaded() == [good.id]


def test_records_survive_meshd_restart(start_node: NodeFactory, models: list[GeneratedModel], mesh: object) -> None:
    c = start_node()
    for m in models[:3]:
        c.register(m)
    c.infer(models[0].id, ROWS)
    # A loaded model and a pending instance-record publish must not stop SIGTERM from
    # ending meshd promptly (stop() SIGKILLs after 10 s, which would return -9).
    assert c.node.meshd.stop() == 0, c.node.meshd.log_tail()
    mesh.restart_meshd(c.node)  # type: ignore[attr-defined]
    c.channel.close()
    c.channel = grpc.insecure_channel(c.node.target)
    for m in models[:3]:
        # The runtime purged on READY, so the old copy record was cleaned up.
        assert c.status(m.id).status == ST.NOT_LOADED
    assert close_enough(c.infer(models[1].id, ROWS), expected(models[1], ROWS))
    assert c.runtime_loaded() == [models[1].id]


def test_bad_input_gets_clear_status_and_loses_nothing(
    start_node: NodeFactory, models: list[GeneratedModel], etcd_server: EmbeddedEtcd, mesh: object
) -> None:
    c = start_node()
    m = models[0]
    c.register(m)
    c.infer(m.id, ROWS)
    before = _records(etcd_server, mesh.service)  # type: ignore[attr-defined]

    def code_of(fn: object, *args: object, **kw: object) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as e:
            fn(*args, **kw)  # type: ignore[operator]
        assert e.value.details(), "every refusal says why"
        return e.value.code()

    empty_id = mm.RegisterModelRequest(modelId="", modelInfo=mm.ModelInfo(type="demo", path=str(m.path)))
    assert code_of(c.mm.registerModel, empty_id, timeout=10) == grpc.StatusCode.INVALID_ARGUMENT
    empty_type = mm.RegisterModelRequest(modelId="x", modelInfo=mm.ModelInfo(type="", path=str(m.path)))
    assert code_of(c.mm.registerModel, empty_type, timeout=10) == grpc.StatusCode.INVALID_ARGUMENT
    too_long = mm.RegisterModelRequest(modelId="x" * 5000, modelInfo=mm.ModelInfo(type="demo"))
    assert code_of(c.mm.registerModel, too_long, timeout=10) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(c.mm.getModelStatus, mm.GetStatusRequest(modelId=""), timeout=10) == grpc.StatusCode.INVALID_ARGUMENT

    req = make_infer_request(m.id, ROWS).SerializeToString()
    infer = c.raw("/inference.GRPCInferenceService/ModelInfer")
    assert code_of(infer, req, metadata=(("mm-model-id", "no-such-model"),), timeout=10) == grpc.StatusCode.NOT_FOUND
    non_utf8 = (("mm-model-id-bin", b"\xff\xfe\x80"),)
    assert code_of(infer, req, metadata=non_utf8, timeout=10) == grpc.StatusCode.INVALID_ARGUMENT
    nameless = make_infer_request("", ROWS).SerializeToString()
    assert code_of(infer, nameless, timeout=10) == grpc.StatusCode.INVALID_ARGUMENT  # no id at all
    both = (("mm-model-id", m.id), ("mm-vmodel-id", "v"))
    assert code_of(infer, req, metadata=both, timeout=10) == grpc.StatusCode.INVALID_ARGUMENT
    two = (("mm-model-id", m.id), ("mm-model-id", "other"))
    assert code_of(infer, req, metadata=two, timeout=10) == grpc.StatusCode.INVALID_ARGUMENT
    malformed = b"\x0a\xff\xff\xff\xff\x0f garbage"
    assert code_of(infer, malformed, metadata=(("mm-model-id", m.id),), timeout=10) == grpc.StatusCode.INVALID_ARGUMENT
    # The runtime SPI is never reachable through the inference path.
    spi = c.raw("/mmesh.ModelRuntime/unloadModel")
    assert code_of(spi, b"", metadata=(("mm-model-id", m.id),), timeout=10) == grpc.StatusCode.UNIMPLEMENTED
    unknown = c.raw("/some.Service/Method")
    assert code_of(unknown, b"", metadata=(("mm-model-id", m.id),), timeout=10) == grpc.StatusCode.UNIMPLEMENTED

    assert _records(etcd_server, mesh.service) == before  # type: ignore[attr-defined]
    assert close_enough(c.infer(m.id, ROWS), expected(m, ROWS))


def test_corrupt_record_is_reported_untouched_and_the_instance_keeps_serving(
    start_node: NodeFactory, models: list[GeneratedModel], etcd_server: EmbeddedEtcd, mesh: object
) -> None:
    c = start_node()
    good = models[0]
    c.register(good)
    key = f"/tas-runtime/{mesh.service}/registry/broken"  # type: ignore[attr-defined]
    _put(etcd_server, key, b"{this is not json")

    def reported() -> bool:
        try:
            c.status("broken")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.DATA_LOSS and "corrupt" in (e.details() or "")
            return True
        return False

    wait_until(reported, 10, "the corrupt record to be reported")
    info = mm.ModelInfo(type="demo", path=str(good.path))
    with pytest.raises(grpc.RpcError) as e:
        c.mm.registerModel(mm.RegisterModelRequest(modelId="broken", modelInfo=info), timeout=10)
    assert e.value.code() == grpc.StatusCode.DATA_LOSS
    with pytest.raises(grpc.RpcError) as e:
        c.infer("broken", ROWS)
    assert e.value.code() == grpc.StatusCode.DATA_LOSS
    assert _records(etcd_server, mesh.service)[key] == b"{this is not json"  # type: ignore[attr-defined]
    assert close_enough(c.infer(good.id, ROWS), expected(good, ROWS))


def _with_store(etcd: EmbeddedEtcd, fn: Callable[[EtcdStore], Awaitable[T]]) -> T:
    async def run() -> T:
        store = EtcdStore.from_url(etcd.url)
        try:
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(run())


def _put(etcd: EmbeddedEtcd, key: str, value: bytes) -> None:
    _with_store(etcd, lambda store: store.put(key, value))


def _records(etcd: EmbeddedEtcd, service: str) -> dict[str, bytes]:
    async def read(store: EtcdStore) -> dict[str, bytes]:
        kvs, _ = await store.range_prefix(f"/tas-runtime/{service}/")
        return {kv.key: kv.value for kv in kvs}

    return _with_store(etcd, read)


def test_the_janitor_repairs_drift_between_records_and_the_cache(
    start_node: NodeFactory, models: list[GeneratedModel], etcd_server: EmbeddedEtcd, mesh: object
) -> None:
    c = start_node(settings={"janitor_ms": 300})
    loaded, other = models[0], models[1]
    c.register(loaded)
    c.register(other)
    c.infer(loaded.id, ROWS)
    service = mesh.service  # type: ignore[attr-defined]
    # Drift written behind meshd's back: the loaded copy dropped from its record, and a
    # copy of a model it never loaded claimed for it.
    for model, ids in ((loaded, {}), (other, {"inst-a": 1})):
        key = f"/tas-runtime/{service}/registry/{model.id}"
        rec = json.loads(_records(etcd_server, service)[key])
        rec["instanceIds"] = ids
        _put(etcd_server, key, json.dumps(rec).encode())

    def repaired() -> bool:
        recs = _records(etcd_server, service)
        ids = {
            m.id: json.loads(recs[f"/tas-runtime/{service}/registry/{m.id}"])["instanceIds"] for m in (loaded, other)
        }
        return list(ids[loaded.id]) == ["inst-a"] and ids[other.id] == {}

    wait_until(repaired, 15, "the janitor to repair both records")
    assert c.runtime_loaded() == [loaded.id]
