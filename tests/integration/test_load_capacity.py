"""No congestion collapse on a real mesh (issue 24): three instances with one slow loading
thread each get a burst of misses for cold models far beyond what they can load, while a
hot model keeps being asked for. The hot copy stays loaded and answers every request; each
cold miss is either served or refused cleanly: RESOURCE_EXHAUSTED saying why and when to
retry (never UNAVAILABLE, never the client's deadline)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from meshd.runtimes.models import decode_infer_response, generate_models, make_infer_request
from meshd.testing.procs import wait_until

from .conftest import MODEL_SIZE, Client, NodeFactory, close_enough, expected
from .test_http_api import http

pytestmark = pytest.mark.slow

COLD = 24
LOAD_DELAY_MS = 1500
ROWS = [[1.0, 2.0, 3.0, 4.0]]


@pytest.mark.parametrize("load_queue", ["value", "fifo"])
def test_the_hot_model_keeps_answering_and_cold_misses_are_refused_cleanly(
    start_node: NodeFactory, tmp_path: object, load_queue: str
) -> None:
    runtime_args = ["--load-delay-ms", str(LOAD_DELAY_MS), "--max-loading-concurrency", "1"]
    settings: dict[str, str | int] = {"load_queue": load_queue, "load_wait_limit_ms": 2000}
    clients = [start_node(f"inst-{n}", 3, runtime_args, settings) for n in "abc"]
    models = generate_models(tmp_path / "models", COLD + 1, size_bytes=MODEL_SIZE)  # type: ignore[operator]
    for m in models:
        clients[0].register(m)
    hot, cold = models[0], models[1:]
    assert close_enough(clients[0].infer(hot.id, ROWS), expected(hot, ROWS))
    holder = next(c for c in clients if hot.id in c.runtime_loaded())

    stop = threading.Event()
    hot_answers: list[bool] = []
    hot_missing = 0

    def ask_hot() -> None:
        n = 0
        while not stop.is_set():
            c = clients[n % 3]
            n += 1
            hot_answers.append(close_enough(c.infer(hot.id, ROWS), expected(hot, ROWS)))

    def watch_holder() -> None:
        nonlocal hot_missing
        while not stop.is_set():
            hot_missing += hot.id not in holder.runtime_loaded()
            stop.wait(0.05)

    def ask_cold(i: int) -> grpc.StatusCode:
        # No deadline: the wait limit decides (a client that allows longer may queue longer).
        req = make_infer_request(cold[i].id, ROWS)
        try:
            answer = clients[i % 3].v2.ModelInfer(req, metadata=(("mm-model-id", cold[i].id),), timeout=None)
            assert close_enough(decode_infer_response(answer), expected(cold[i], ROWS))
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            if e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert "load capacity exhausted" in (e.details() or "")
                assert "retry after" in (e.details() or "")
            return e.code()  # type: ignore[no-any-return]

    background = [threading.Thread(target=ask_hot), threading.Thread(target=watch_holder)]
    for t in background:
        t.start()
    try:
        with ThreadPoolExecutor(COLD) as pool:
            codes = list(pool.map(ask_cold, range(COLD)))
    finally:
        stop.set()
        for t in background:
            t.join()
    assert hot_answers and all(hot_answers)
    if load_queue == "value":
        assert hot_missing == 0  # never evicted for a cold load
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) > 0
    else:  # upstream's queue: no fast refusal; cold misses wait their turn (or run out of room)
        assert grpc.StatusCode.RESOURCE_EXHAUSTED not in codes


def test_a_miss_that_could_not_load_before_the_clients_deadline_is_refused_not_timed_out(
    start_node: NodeFactory, tmp_path: object
) -> None:
    """One loading thread busy with a 1.5 s load: a miss whose client allows 0.5 s gets
    RESOURCE_EXHAUSTED naming the deadline (the client may retry), not DEADLINE_EXCEEDED after
    waiting; one that allows 30 s waits its turn and is served. (A lone instance: the answer
    is RESOURCE_EXHAUSTED there too, not UNAVAILABLE.)"""
    runtime_args = ["--load-delay-ms", str(LOAD_DELAY_MS), "--max-loading-concurrency", "1"]
    c = start_node("inst-a", 4, runtime_args, {"load_wait_limit_ms": 20_000})
    models = generate_models(tmp_path / "models", 3, size_bytes=MODEL_SIZE)  # type: ignore[operator]
    for m in models:
        c.register(m)
    first, short, patient = models

    def infer(model_id: str, timeout: float) -> object:
        req = make_infer_request(model_id, ROWS)
        return c.v2.ModelInfer(req, metadata=(("mm-model-id", model_id),), timeout=timeout)

    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(infer, first.id, 30)  # takes the loading thread for 1.5 s
        wait_until(lambda: c.stats().misses >= 1, 10, "the first load to start")
        with pytest.raises(grpc.RpcError) as refused:
            infer(short.id, 0.5)
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
        assert "deadline" in (refused.value.details() or "")
        waited = pool.submit(infer, patient.id, 30)
        assert close_enough(decode_infer_response(running.result()), expected(first, ROWS))
        assert close_enough(decode_infer_response(waited.result()), expected(patient, ROWS))
    assert short.id not in c.runtime_loaded()


def _rest_infer(c: Client, model_id: str, headers: dict[str, str]) -> tuple[int, dict[str, object]]:
    doc = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": ROWS[0]}]}
    status, body = http(c, "POST", f"/v2/models/{model_id}/infer", json.dumps(doc), headers)
    return status, body


def test_a_patient_request_waits_for_its_load_beyond_the_wait_limit_while_a_hurried_one_is_refused_fast(
    start_node: NodeFactory, tmp_path: object
) -> None:
    """Issue 33: one loading thread, 1.5 s loads, a 1 s wait limit (3 s in force: three mean
    load times). Requests whose clients allow a minute (a gRPC deadline, or mm-timeout-ms over
    REST) queue four deep behind the running load and are all served, the last after waiting
    about 6 s, twice the limit; meanwhile a request without a deadline, and one that allows
    1 s, are refused fast (RESOURCE_EXHAUSTED, saying why)."""
    runtime_args = ["--load-delay-ms", str(LOAD_DELAY_MS), "--max-loading-concurrency", "1"]
    c = start_node("inst-a", 8, runtime_args, {"load_wait_limit_ms": 1000})
    models = generate_models(tmp_path / "models", 7, size_bytes=MODEL_SIZE)  # type: ignore[operator]
    for m in models:
        c.register(m)
    first, *patient, over_rest, hurried, no_deadline = models

    def infer(model_id: str, timeout: float | None) -> object:
        req = make_infer_request(model_id, ROWS)
        return c.v2.ModelInfer(req, metadata=(("mm-model-id", model_id),), timeout=timeout)

    def refused_fast(model_id: str, timeout: float | None) -> str:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            infer(model_id, timeout)
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
        assert time.monotonic() - started < 1.0  # at once, not after waiting
        return refused.value.details() or ""

    with ThreadPoolExecutor(5) as pool:
        running = pool.submit(infer, first.id, 60)  # takes the loading thread for 1.5 s
        wait_until(lambda: c.stats().misses >= 1, 10, "the first load to start")
        started = time.monotonic()
        waiting = [pool.submit(infer, m.id, 60) for m in patient]
        wait_until(lambda: c.stats().misses >= 1 + len(patient), 10, "the patient loads to queue")
        rest = pool.submit(_rest_infer, c, over_rest.id, {"mm-timeout-ms": "60000"})
        wait_until(lambda: c.stats().misses >= 2 + len(patient), 10, "the REST request's load to queue")
        assert "deadline is 1.0 s away" in refused_fast(hurried.id, 1.0)
        assert "loads wait for 1 loading threads" in refused_fast(no_deadline.id, None)
        assert close_enough(decode_infer_response(running.result()), expected(first, ROWS))
        for m, answer in zip(patient, waiting, strict=True):
            assert close_enough(decode_infer_response(answer.result()), expected(m, ROWS))
        waited = time.monotonic() - started
        status, body = rest.result()
    assert status == 200, body
    assert waited > 2 * 3.0  # the last patient load waited beyond the wait limit in force
    loaded = c.runtime_loaded()
    assert {m.id for m in (first, *patient, over_rest)} <= set(loaded)
    assert hurried.id not in loaded and no_deadline.id not in loaded
