"""Three meshd instances and three reference runtimes on one etcd: one mesh."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from meshd._proto.inference import grpc_predict_v2_pb2 as v2
from meshd._proto.meshd import peer_pb2, peer_pb2_grpc
from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.runtimes.models import GeneratedModel, decode_infer_response, generate_models, make_infer_request
from meshd.testing.procs import wait_until

from .conftest import MODEL_SIZE, Client, NodeFactory, Traffic, close_enough, expected, listed_instances

pytestmark = pytest.mark.slow

ROWS = [[1.0, 2.0, 3.0, 4.0]]
ST = mm.ModelStatusInfo


def three(start_node: NodeFactory, **kw: object) -> list[Client]:
    return [start_node(f"inst-{n}", **kw) for n in "abc"]  # type: ignore[arg-type]


def load_on(c: Client, model_id: str) -> None:
    """Place a copy on this instance explicitly (the internal load-here operation)."""
    with grpc.insecure_channel(f"127.0.0.1:{c.node.peer_port}") as ch:
        req = peer_pb2.InternalOpRequest(modelId=model_id, load=True, sync=True)
        state = peer_pb2_grpc.MeshPeerStub(ch).InternalOperation(req, timeout=30).state
    assert state == peer_pb2.InternalOpResponse.LOADED


def copies(c: Client, model_id: str) -> set[str]:
    return {x.location for x in c.status(model_id).modelCopyInfos if x.copyStatus == ST.LOADED}


def test_a_model_loaded_on_one_instance_is_served_through_each_other(
    start_node: NodeFactory, models: list[GeneratedModel]
) -> None:
    a, b, c = three(start_node)
    m = models[0]
    a.register(m)
    load_on(a, m.id)
    for client in (b, c, a):
        assert close_enough(client.infer(m.id, ROWS), expected(m, ROWS))
    # Served by the one copy: nothing else loaded it.
    assert a.runtime_loaded() == [m.id] and b.runtime_loaded() == [] and c.runtime_loaded() == []
    assert copies(b, m.id) == {"inst-a"}


def test_a_peers_answers_carry_its_load_queue(start_node: NodeFactory, models: list[GeneratedModel]) -> None:
    """Every unary answer on the internal port, served or refused, says the instance's loads
    in progress (`meshd-loads`): placement reads it in place of the peer's record (issue 36)."""
    a = start_node("inst-a")
    start_node("inst-b")  # the peer the calls come from, as a sees it
    wait_until(lambda: listed_instances(a) >= {"inst-a", "inst-b"}, 15, "inst-a to see inst-b")
    loaded, absent = models[:2]
    a.register(loaded)
    a.register(absent)
    load_on(a, loaded.id)
    with grpc.insecure_channel(f"127.0.0.1:{a.node.peer_port}") as ch:
        infer = ch.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=v2.ModelInferRequest.SerializeToString,
            response_deserializer=v2.ModelInferResponse.FromString,
        )
        as_peer = (("meshd-hop", "inst-b"), ("meshd-mode", "serve"))
        resp, call = infer.with_call(
            make_infer_request(loaded.id, ROWS), metadata=(("mm-model-id", loaded.id), *as_peer), timeout=30
        )
        assert close_enough(decode_infer_response(resp), expected(loaded, ROWS))
        assert dict(call.trailing_metadata())["meshd-loads"] == "0"
        with pytest.raises(grpc.RpcError) as refused:  # serve mode, no copy here: refused, with the count
            infer(make_infer_request(absent.id, ROWS), metadata=(("mm-model-id", absent.id), *as_peer), timeout=30)
    trailers = dict(refused.value.trailing_metadata())
    assert trailers["meshd-reason"] == "not-here" and trailers["meshd-loads"] == "0"


def test_concurrent_cold_loads_spread_over_the_instances(start_node: NodeFactory, tmp_path: object) -> None:
    nodes = three(start_node, capacity_models=30)
    models = generate_models(tmp_path / "many", 30, size_bytes=MODEL_SIZE)  # type: ignore[operator]
    for m in models:
        nodes[0].register(m)
    barrier = threading.Barrier(30)

    def cold(i: int) -> bool:
        m = models[i]
        barrier.wait()
        return close_enough(nodes[i % 3].infer(m.id, ROWS), expected(m, ROWS))

    with ThreadPoolExecutor(30) as pool:
        assert all(pool.map(cold, range(30)))
    loads = Counter({n.node.instance_id: len(n.runtime_loaded()) for n in nodes})
    assert sum(loads.values()) == 30
    assert max(loads.values()) <= 15, loads  # no instance took more than half


def test_kill_9_under_traffic_loses_no_request(start_node: NodeFactory, models: list[GeneratedModel]) -> None:
    a, b, c = three(start_node, settings={"instance_ttl_s": 2})
    shared, only_on_b = models[:3], models[3]
    for m in [*shared, only_on_b]:
        a.register(m)
    for m in shared:
        load_on(b, m.id)
        load_on(c, m.id)
    load_on(b, only_on_b.id)
    with Traffic([a, c], shared, ROWS) as traffic:
        time.sleep(1.0)
        b.node.meshd.kill()
        b.node.runtime.kill()
        time.sleep(3.0)
    assert not traffic.failures, traffic.failures[:5]
    assert traffic.served["inst-a"] > 10 and traffic.served["inst-c"] > 10
    # The model whose only copy died is served again (reloaded on a survivor).
    assert close_enough(a.infer(only_on_b.id, ROWS), expected(only_on_b, ROWS))
    wait_until(lambda: "inst-b" not in copies(a, shared[0].id), 15, "the dead copy to leave the status")


def test_a_load_failure_on_one_instance_loads_elsewhere_and_is_reported(
    start_node: NodeFactory, models: list[GeneratedModel]
) -> None:
    m = models[0]
    a = start_node("inst-a", runtime_args=["--fail-load", m.id])
    b = start_node("inst-b")
    # A port that answers comes before the record peers see: wait until a knows b.
    wait_until(lambda: listed_instances(a) >= {"inst-a", "inst-b"}, 15, "inst-a to see inst-b")
    a.register(m)
    # Make a try first (its runtime refuses this model); the failure lands in the record.
    with grpc.insecure_channel(f"127.0.0.1:{a.node.peer_port}") as ch:
        req = peer_pb2.InternalOpRequest(modelId=m.id, load=True, sync=True)
        state = peer_pb2_grpc.MeshPeerStub(ch).InternalOperation(req, timeout=30).state
    assert state == peer_pb2.InternalOpResponse.FAILED
    # A request through a is served: placement excludes the instance that failed.
    assert close_enough(a.infer(m.id, ROWS), expected(m, ROWS))
    # a's mirror learns of b's copy from etcd's watch: on a busy machine, a few ms after the answer.
    wait_until(lambda: a.status(m.id).status == ST.LOADED, 10, "the status to say LOADED")
    st = a.status(m.id)
    assert any("injected load failure" in e for e in st.errors), st
    assert ("inst-a", ST.LOADING_FAILED) in {(x.location, x.copyStatus) for x in st.modelCopyInfos}
    assert b.runtime_loaded() == [m.id] and a.runtime_loaded() == []


def test_a_vmodel_switch_under_traffic_fails_nothing_and_waits_for_the_load(
    start_node: NodeFactory, models: list[GeneratedModel]
) -> None:
    a, b, c = three(start_node)
    old, new = models[0], models[1]
    a.register(old)
    # The new target takes 1.5 s to load: a request that reached it early would wait.
    slow = mm.ModelInfo(type="demo", path=str(new.path), key='{"load_delay_ms": 1500}')
    a.mm.registerModel(mm.RegisterModelRequest(modelId=new.id, modelInfo=slow), timeout=10)
    st = a.mm.setVModel(mm.SetVModelRequest(vModelId="vm", targetModelId=old.id), timeout=10)
    assert (st.status, st.activeModelId) == (mm.VModelStatusInfo.DEFINED, old.id)
    load_on(a, old.id)
    before = sum(cl.stats().misses for cl in (a, b, c))
    answers: dict[str, list[str]] = {"inst-b": [], "inst-c": []}
    failures: list[str] = []
    stop = threading.Event()

    def traffic(client: Client) -> None:
        mine = answers[client.node.instance_id]
        while not stop.is_set():
            try:
                out = client.v2.ModelInfer(
                    make_infer_request("vm", ROWS), metadata=(("mm-vmodel-id", "vm"),), timeout=30
                )
                got = decode_infer_response(out)
                mine.append(
                    "old"
                    if close_enough(got, expected(old, ROWS))
                    else "new"
                    if close_enough(got, expected(new, ROWS))
                    else "?"
                )
            except Exception as e:
                failures.append(str(e))

    threads = [threading.Thread(target=traffic, args=(cl,)) for cl in (b, c)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    st = a.mm.setVModel(mm.SetVModelRequest(vModelId="vm", targetModelId=new.id), timeout=10)
    assert st.status == mm.VModelStatusInfo.TRANSITIONING and st.activeModelId == old.id
    wait_until(
        lambda: a.mm.getVModelStatus(mm.GetVModelStatusRequest(vModelId="vm"), timeout=10).activeModelId == new.id,
        30,
        "the vmodel to switch",
    )
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(30)
    assert not failures, failures[:3]
    for client, seq in answers.items():
        # Each client's requests are sequential: old answers, then new ones, never back.
        switch = seq.index("new") if "new" in seq else len(seq)
        assert seq[0] == "old" and seq[-1] == "new", (client, seq[:3], seq[-3:])
        assert set(seq[:switch]) == {"old"} and set(seq[switch:]) == {"new"}, (client, seq)
    # No client request waited for a load: the new target was loaded before any reached it.
    assert sum(cl.stats().misses for cl in (a, b, c)) == before
    st = a.mm.getVModelStatus(mm.GetVModelStatusRequest(vModelId="vm"), timeout=10)
    assert (st.status, st.activeModelId, st.targetModelId) == (mm.VModelStatusInfo.DEFINED, new.id, new.id)


def test_sigterm_under_traffic_hands_models_over_and_fails_nothing(
    start_node: NodeFactory, models: list[GeneratedModel]
) -> None:
    a, b, c = three(start_node)
    held = models[:3]
    for m in held:
        a.register(m)
        load_on(b, m.id)  # b holds the only copies
    with Traffic([a, c], held, ROWS) as traffic:
        time.sleep(0.5)
        assert b.node.meshd.stop() == 0, b.node.meshd.log_tail()  # SIGTERM, exits by itself
        # Before b exited, every model it held was loaded elsewhere.
        elsewhere = set(a.runtime_loaded()) | set(c.runtime_loaded())
        assert {m.id for m in held} <= elsewhere, elsewhere
        assert "drained: every model held here is loaded elsewhere" in b.node.meshd.log_path.read_text()
        time.sleep(0.5)
    assert not traffic.failures, traffic.failures[:5]
    assert traffic.served["inst-a"] > 10 and traffic.served["inst-c"] > 10


def test_copies_follow_load_and_policy(start_node: NodeFactory, tmp_path: Path) -> None:
    settings: dict[str, str | int] = {"scaleup_rpm_threshold": 30, "rate_check_ms": 500, "copy_idle_ms": 1500}
    nodes = three(start_node, capacity_models=3, settings=settings)
    a = nodes[0]
    # Two fillers beyond the four that fill the cluster: each slot an idle drop frees is filled again.
    hot, capped, *fillers = generate_models(tmp_path / "models", 8, size_bytes=MODEL_SIZE)
    a.register(hot)
    pinned = mm.ModelInfo(type="demo", path=str(capped.path), key='{"meshd": {"min_copies": 2, "max_copies": 2}}')
    a.mm.registerModel(mm.RegisterModelRequest(modelId=capped.id, modelInfo=pinned), timeout=10)
    for f in fillers:
        a.register(f)

    def holders(model_id: str) -> set[str]:
        return {n.node.instance_id for n in nodes if model_id in n.runtime_loaded()}

    stop = threading.Event()
    failures: list[str] = []

    def traffic() -> None:
        while not stop.is_set():
            for m in (hot, capped):
                try:
                    assert close_enough(a.infer(m.id, ROWS), expected(m, ROWS))
                except Exception as e:
                    failures.append(str(e))

    t = threading.Thread(target=traffic)
    t.start()
    capped_seen: list[int] = []

    def scaled() -> bool:
        capped_seen.append(len(holders(capped.id)))
        return len(holders(hot.id)) == 3 and capped_seen[-1] == 2

    try:
        # Hot: a copy on every instance. Capped: its max of two, never three at any sample.
        wait_until(scaled, 30, "copies for load")
    finally:
        stop.set()
        t.join(30)
    assert not failures, failures[:3]
    assert max(capped_seen) == 2 and len(holders(capped.id)) == 2, capped_seen
    spare = iter(fillers)

    def fill_up() -> None:  # every instance to capacity (3 models each), evicting nothing
        while short := [n for n in nodes if len(n.runtime_loaded()) < 3]:
            for n in short:  # again if a drop lands meanwhile
                load_on(n, next(spare).id)

    fill_up()
    # Full and idle: the hot model sheds extra copies, one holder per round, down to one; capped
    # keeps its min of 2. An idle copy goes only while the cluster is <= 5 % free (upstream's
    # rule), and one freed slot of nine is 11 %: each is filled again so the next drop is due.
    # (Two drops may also come at once, the second judged on a record not yet showing the first's room.)
    while (left := len(holders(hot.id))) > 1:
        wait_until(lambda: len(holders(hot.id)) < left, 30, f"an idle copy of {left} to be dropped")
        fill_up()
    time.sleep(2)  # a few more scaling rounds
    assert len(holders(hot.id)) == 1 and len(holders(capped.id)) == 2


def test_type_constraints_place_models_only_where_labels_allow(
    start_node: NodeFactory, models: list[GeneratedModel]
) -> None:
    tc = '{"special": {"required": ["mt:special"]}}'
    a = start_node("inst-a", settings={"labels": "mt:special", "type_constraints": tc})
    b = start_node("inst-b", settings={"type_constraints": tc})
    specials, plain = models[:4], models[4]
    for m in specials:  # four, so placement ignoring the labels would land some on b
        info = mm.ModelInfo(type="special", path=str(m.path))
        b.mm.registerModel(mm.RegisterModelRequest(modelId=m.id, modelInfo=info), timeout=10)
        assert close_enough(b.infer(m.id, ROWS), expected(m, ROWS))  # through the unlabelled one
    assert a.runtime_loaded() == sorted(m.id for m in specials) and b.runtime_loaded() == []
    b.register(plain)
    assert close_enough(b.infer(plain.id, ROWS), expected(plain, ROWS))  # unconstrained: anywhere


def test_one_leader_prunes_dead_copies_preloads_and_is_replaced_when_killed(
    start_node: NodeFactory, models: list[GeneratedModel], etcd_server: object, mesh: object
) -> None:
    settings: dict[str, str | int] = {"instance_ttl_s": 2, "leader_sweep_ms": 300, "dead_instance_prune_ms": 1000}
    nodes = three(start_node, settings=settings)
    service = mesh.service  # type: ignore[attr-defined]

    def leaders() -> list[str]:
        import asyncio

        from meshd.kv.election import leader_of
        from meshd.kv.etcd import EtcdStore

        async def read() -> list[str]:
            store = EtcdStore.from_url(etcd_server.url)  # type: ignore[attr-defined]
            try:
                kvs, _ = await store.range_prefix(f"/tas-runtime/{service}/leaderLatch/")
            finally:
                await store.close()
            leader = leader_of(kvs, f"/tas-runtime/{service}/leaderLatch/")
            return [leader] if leader else []

        return asyncio.run(read())

    assert len(leaders()) == 1
    leader = leaders()[0]
    # Preload: a model used recently and held nowhere is loaded by the leader on its own.
    m = models[0]
    info = mm.ModelInfo(type="demo", path=str(m.path))
    nodes[0].mm.registerModel(
        mm.RegisterModelRequest(modelId=m.id, modelInfo=info, lastUsedTime=int(time.time() * 1000)), timeout=10
    )
    wait_until(lambda: any(m.id in n.runtime_loaded() for n in nodes), 15, "the leader to preload")
    # Only the leader serves the cluster gauges.
    wait_until(lambda: any(n.stats().modelsLoadedTotal == 1 for n in nodes), 10, "the leader's gauges")
    stats = {n.node.instance_id: n.stats() for n in nodes}
    assert [i for i, st in stats.items() if st.leader] == [leader]
    assert (stats[leader].modelsManagedTotal, stats[leader].modelsLoadedTotal) == (1, 1)
    # The leader holds a copy; kill it (and its runtime): another instance leads, and its
    # sweep removes the dead instance from the model record itself (not just from status).
    victim = next(n for n in nodes if n.node.instance_id == leader)
    if m.id not in victim.runtime_loaded():
        load_on(victim, m.id)
    assert leader in record_ids(etcd_server, service, m.id)
    victim.node.meshd.kill()
    victim.node.runtime.kill()
    wait_until(lambda: leaders() not in ([], [leader]), 20, "a new leader")
    wait_until(lambda: leader not in record_ids(etcd_server, service, m.id), 20, "the dead copy to be pruned")
    new_leader = leaders()[0]
    assert new_leader != leader
    # Exactly one surviving instance acts as leader (only the acting leader serves gauges).
    survivors = [n for n in nodes if n is not victim]
    wait_until(lambda: sum(n.stats().leader for n in survivors) == 1, 10, "one acting leader")
    assert [n.node.instance_id for n in survivors if n.stats().leader] == [new_leader]


def record_ids(etcd: object, service: str, model_id: str) -> set[str]:
    import asyncio
    import json

    from meshd.kv.etcd import EtcdStore

    async def read() -> set[str]:
        store = EtcdStore.from_url(etcd.url)  # type: ignore[attr-defined]
        try:
            kv = await store.get(f"/tas-runtime/{service}/registry/{model_id}")
        finally:
            await store.close()
        return set(json.loads(kv.value)["instanceIds"]) if kv else set()

    return asyncio.run(read())


def test_a_dead_runtime_sends_requests_to_another_copy(start_node: NodeFactory, models: list[GeneratedModel]) -> None:
    a, b = start_node("inst-a"), start_node("inst-b")
    m = models[0]
    a.register(m)
    load_on(a, m.id)
    load_on(b, m.id)
    a.node.runtime.kill()  # meshd on a still believes its copy is loaded
    for _ in range(10):  # through a: its runtime answers UNAVAILABLE, b's copy serves
        assert close_enough(a.infer(m.id, ROWS), expected(m, ROWS))


def test_requests_during_a_cold_load_wait_for_it_instead_of_loading_more_copies(
    start_node: NodeFactory, models: list[GeneratedModel]
) -> None:
    nodes = three(start_node)
    a = nodes[0]
    m = models[0]
    slow = mm.ModelInfo(type="demo", path=str(m.path), key='{"load_delay_ms": 2000}')
    a.mm.registerModel(mm.RegisterModelRequest(modelId=m.id, modelInfo=slow), timeout=10)
    with ThreadPoolExecutor(7) as pool:
        first = pool.submit(a.infer, m.id, ROWS)
        time.sleep(0.5)  # the load is under way somewhere; more requests arrive everywhere
        rest = [pool.submit(nodes[i % 3].infer, m.id, ROWS) for i in range(6)]
        assert all(close_enough(f.result(), expected(m, ROWS)) for f in [first, *rest])
    assert sum(m.id in n.runtime_loaded() for n in nodes) == 1  # one copy, not one per ingress


def test_a_request_at_another_instance_joins_a_load_still_waiting_for_a_thread(
    start_node: NodeFactory, models: list[GeneratedModel]
) -> None:
    """Issue 36: a load waiting for a loading thread is in the model's record already, so a
    request for it at another instance waits for that load instead of loading a second copy
    (the record used to be written only once the load had a thread)."""
    one_thread = ["--max-loading-concurrency", "1"]
    a = start_node("inst-a", runtime_args=one_thread)
    b = start_node("inst-b", runtime_args=one_thread)
    wait_until(lambda: listed_instances(b) >= {"inst-a", "inst-b"}, 15, "inst-b to see inst-a")
    busy, queued = models[:2]
    for m, delay_ms in ((busy, 3000), (queued, 300)):
        info = mm.ModelInfo(type="demo", path=str(m.path), key=f'{{"load_delay_ms": {delay_ms}}}')
        a.mm.registerModel(mm.RegisterModelRequest(modelId=m.id, modelInfo=info), timeout=10)

    def loading_on_a(model_id: str) -> bool:
        return any(x.location == "inst-a" and x.copyStatus == ST.LOADING for x in b.status(model_id).modelCopyInfos)

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(load_on, a, busy.id)  # a's one loading thread, for 3 s
        wait_until(lambda: loading_on_a(busy.id), 10, "busy's load on inst-a in its record")
        second = pool.submit(load_on, a, queued.id)  # waits for that thread
        # Its record has it, and a says LOADING (a waiting load has no cache entry yet).
        wait_until(lambda: loading_on_a(queued.id), 10, "queued's waiting load on inst-a in its status")
        assert not first.done()  # it was recorded while it waited, not once it had the thread
        assert close_enough(b.infer(queued.id, ROWS), expected(queued, ROWS))
        first.result()
        second.result()
    assert queued.id not in b.runtime_loaded() and queued.id in a.runtime_loaded()


def test_vmodel_autodelete_switches_under_traffic_fail_nothing(
    start_node: NodeFactory, models: list[GeneratedModel]
) -> None:
    a, b, c = three(start_node)

    def retarget(m: GeneratedModel) -> None:
        req = mm.SetVModelRequest(
            vModelId="vm",
            targetModelId=m.id,
            modelInfo=mm.ModelInfo(type="demo", path=str(m.path)),
            autoDeleteTargetModel=True,
            loadNow=True,
            sync=True,
            force=True,
        )
        a.mm.setVModel(req, timeout=30)

    retarget(models[0])
    failures: list[str] = []
    stop = threading.Event()

    def traffic(client: Client) -> None:
        while not stop.is_set():
            try:
                client.v2.ModelInfer(make_infer_request("vm", ROWS), metadata=(("mm-vmodel-id", "vm"),), timeout=30)
            except Exception as e:
                failures.append(str(e))

    threads = [threading.Thread(target=traffic, args=(cl,)) for cl in (b, c, b, c)]
    for t in threads:
        t.start()
    try:
        for m in [*models[1:], models[0]]:
            retarget(m)  # forced: the old active is auto-deleted at once
            time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not failures, failures[:3]
    # Every superseded target was auto-deleted.
    remaining = [m.id for m in models if a.status(m.id).status != ST.NOT_FOUND]
    assert remaining == [models[0].id]


def test_an_unreachable_peer_reroutes_whatever_its_host_is_called(
    start_node: NodeFactory, models: list[GeneratedModel]
) -> None:
    a = start_node("inst-a")
    b = start_node("inst-b", settings={"advertise_host": "meshd-b.invalid"})  # peers cannot reach it
    m = models[0]
    a.register(m)
    load_on(b, m.id)  # b holds the only copy, at an address nobody can resolve
    assert close_enough(a.infer(m.id, ROWS), expected(m, ROWS))  # rerouted: loaded on a
    assert m.id in a.runtime_loaded()


def test_the_last_resort_load_respects_required_labels(start_node: NodeFactory, models: list[GeneratedModel]) -> None:
    m = models[0]
    tc = '{"special": {"required": ["mt:special"]}}'
    a = start_node(
        "inst-a", runtime_args=["--fail-load", m.id], settings={"labels": "mt:special", "type_constraints": tc}
    )
    b = start_node("inst-b", settings={"type_constraints": tc})
    info = mm.ModelInfo(type="special", path=str(m.path))
    b.mm.registerModel(mm.RegisterModelRequest(modelId=m.id, modelInfo=info), timeout=10)
    with pytest.raises(grpc.RpcError) as e:
        b.infer(m.id, ROWS)  # a fails it; b lacks the label and must not load it instead
    # Failed to load wherever it may load: upstream's INTERNAL, with the runtime's message.
    assert e.value.code() == grpc.StatusCode.INTERNAL and "injected load failure" in (e.value.details() or "")
    assert b.runtime_loaded() == [] and a.runtime_loaded() == []


def test_set_vmodel_sync_load_now_waits_for_the_new_target(
    start_node: NodeFactory, models: list[GeneratedModel]
) -> None:
    a = start_node("inst-a")
    m = models[0]
    info = mm.ModelInfo(type="demo", path=str(m.path), key='{"load_delay_ms": 1000}')
    req = mm.SetVModelRequest(vModelId="vm", targetModelId=m.id, modelInfo=info, loadNow=True, sync=True)
    st = a.mm.setVModel(req, timeout=30)
    assert st.status == mm.VModelStatusInfo.DEFINED and st.activeModelStatus.status == ST.LOADED
