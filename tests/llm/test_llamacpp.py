"""meshd with real llama.cpp engines (`meshd llm-runtime --engine llamacpp`): the official
`openai` client, plain and streamed; models loaded, evicted and served from peers like any
model; engines killed between requests and in the middle of a stream; bad input refused
before any engine sees it, nothing stored lost."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from meshd._proto.inference import grpc_predict_v2_pb2 as v2
from meshd._proto.inference import grpc_predict_v2_pb2_grpc as v2_grpc
from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.testing.cluster import Node
from meshd.testing.llm import ASCII_ONLY
from meshd.testing.procs import wait_until
from meshd.testing.venvs import ensure_venv

from ..integration.test_tritonclient import TRITONCLIENT
from .conftest import LLM_MODELS, TENSOR_MODEL, VMODEL, WIDE_MODEL, LlmMesh, engine_pids, kill_engine, post

# A first run compiles llama.cpp for its venv (~9 min on 2 cores).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

NO_EOS = ASCII_ONLY


def client(node: Node) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.http_url}/v1", api_key="unused", max_retries=0, timeout=60)


def complete(node: Node, model: str, prompt: str = "the mesh", max_tokens: int = 8, **kw: Any) -> str:
    done = client(node).completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)
    return done.choices[0].text


def test_openai_client_completions_and_chat_plain_and_streamed(llm_mesh: LlmMesh) -> None:
    c = client(llm_mesh.a)
    model = LLM_MODELS[0]
    plain = c.completions.create(model=model, prompt="hello", max_tokens=12, temperature=0, logit_bias=NO_EOS)
    assert plain.model == model and plain.choices[0].text
    pieces = list(
        c.completions.create(model=model, prompt="hello", max_tokens=12, temperature=0, logit_bias=NO_EOS, stream=True)
    )
    assert len(pieces) > 2, "a streamed answer comes in pieces"
    assert "".join(p.choices[0].text for p in pieces) == plain.choices[0].text
    chat = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, logit_bias=NO_EOS
    )
    assert chat.choices[0].message.role == "assistant"
    streamed = list(
        c.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            temperature=0,
            logit_bias=NO_EOS,
            stream=True,
        )
    )
    assert streamed and streamed[-1].choices[0].finish_reason == "length"
    assert "".join(s.choices[0].delta.content or "" for s in streamed) == chat.choices[0].message.content


def test_embeddings_through_the_mesh(llm_mesh: LlmMesh) -> None:
    c = client(llm_mesh.b)
    one = c.embeddings.create(model=LLM_MODELS[0], input="the mesh")
    again = c.embeddings.create(model=LLM_MODELS[0], input="the mesh")
    other = c.embeddings.create(model=LLM_MODELS[1], input="the mesh")
    assert one.data[0].embedding and one.data[0].embedding == again.data[0].embedding
    assert other.data[0].embedding != one.data[0].embedding


def test_models_lists_the_registered_language_models_and_vmodels(llm_mesh: LlmMesh) -> None:
    listed = {m.id for m in client(llm_mesh.b).models.list()}
    assert listed == {*LLM_MODELS, WIDE_MODEL, VMODEL}  # not the tensor model


def test_a_vmodel_serves_its_active_model(llm_mesh: LlmMesh) -> None:
    assert complete(llm_mesh.a, VMODEL, logit_bias=NO_EOS) == complete(llm_mesh.a, LLM_MODELS[0], logit_bias=NO_EOS)


def test_three_models_in_room_for_two_load_evict_and_hit_like_any_model(lone_instance: LlmMesh) -> None:
    llm_mesh = lone_instance
    a = llm_mesh.a
    balanced: dict[str, Any] = {}
    first = {m: complete(a, m, logit_bias=NO_EOS, **balanced) for m in LLM_MODELS}
    assert len(set(first.values())) == 3, f"models of different seeds answer differently: {first}"
    before = llm_mesh.stats(a)
    for m in LLM_MODELS:  # each again: an eviction and a reload for some, the same answers
        assert complete(a, m, logit_bias=NO_EOS, **balanced) == first[m]
    after = llm_mesh.stats(a)
    assert len(after.loadedModels) == 2, after.loadedModels
    assert after.evictions > before.evictions
    assert after.loads > before.loads
    assert complete(a, LLM_MODELS[2], logit_bias=NO_EOS, **balanced) == first[LLM_MODELS[2]]
    assert llm_mesh.stats(a).hits > after.hits
    assert len([m for m in LLM_MODELS if engine_pids(m, a)]) == 2, "an evicted model's engine is stopped"


def test_a_model_is_served_from_a_peer(llm_mesh: LlmMesh) -> None:
    llm_mesh.unload_everywhere()
    model = LLM_MODELS[1]
    expected = complete(llm_mesh.a, model, logit_bias=NO_EOS, extra_headers={"mm-balanced": "true"})
    assert model in llm_mesh.stats(llm_mesh.a).loadedModels
    assert complete(llm_mesh.b, model, logit_bias=NO_EOS) == expected
    assert model not in llm_mesh.stats(llm_mesh.b).loadedModels, "served by a's copy, not loaded on b"
    streamed = client(llm_mesh.b).completions.create(
        model=model, prompt="the mesh", max_tokens=8, temperature=0, logit_bias=NO_EOS, stream=True
    )
    assert "".join(p.choices[0].text for p in streamed) == expected


def test_bad_input_is_refused_before_any_engine_and_nothing_is_lost(llm_mesh: LlmMesh) -> None:
    a = llm_mesh.a
    cases: list[tuple[str, Any, int, str]] = [
        ("/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404, "model_not_found"),
        ("/v1/completions", {"prompt": "x"}, 400, "missing_model"),
        ("/v1/chat/completions", b'{"model": "llm-0", "messages": [', 400, "invalid_request"),
        ("/v1/chat/completions", [1, 2], 400, "invalid_request"),
        ("/v1/completions", {"model": "llm-0", "prompt": "x", "stream": "yes"}, 400, "invalid_request"),
        ("/v1/chat/completions", {"model": TENSOR_MODEL, "messages": []}, 400, "invalid_request"),
        ("/v1/completions", {"model": "", "prompt": "x"}, 400, "invalid_request"),
        ("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', 400, "invalid_request"),
        ("/v1/completions", {"model": "m" * 5000, "prompt": "x"}, 400, "invalid_request"),
    ]
    for path, body, status, code in cases:
        got, answer, _ = post(a, path, body)
        assert (got, answer["error"]["code"]) == (status, code), (path, body, answer)
        assert answer["error"]["message"] and answer["error"]["type"]
    assert "is not a language model" in post(a, "/v1/chat/completions", {"model": TENSOR_MODEL})[1]["error"]["message"]
    # An LLM sent tensors it does not take: KServe V2 over gRPC and HTTP.
    req = v2.ModelInferRequest(model_name=LLM_MODELS[0])
    req.inputs.add(name="x", datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend([1, 2, 3, 4])
    with grpc.insecure_channel(a.target) as ch, pytest.raises(grpc.RpcError) as e:
        v2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text_input" in (e.value.details() or "")
    tensors = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    status, answer, _ = post(a, f"/v2/models/{LLM_MODELS[0]}/infer", tensors)
    assert status == 400 and "text_input" in answer["error"]
    for model_id in (*LLM_MODELS, WIDE_MODEL, TENSOR_MODEL):  # every record still there
        status = llm_mesh.stub().getModelStatus(mm.GetStatusRequest(modelId=model_id), timeout=10).status
        assert status != mm.ModelStatusInfo.NOT_FOUND, model_id
    assert {m.id for m in client(a).models.list()} == {*LLM_MODELS, WIDE_MODEL, VMODEL}


def test_engine_killed_between_requests_answers_promptly_and_comes_back(llm_mesh: LlmMesh) -> None:
    llm_mesh.unload_everywhere()
    model = LLM_MODELS[2]
    expected = complete(llm_mesh.a, model, logit_bias=NO_EOS)
    at = llm_mesh.holder(model)
    old = kill_engine(model, at)
    started = time.monotonic()
    body = {"model": model, "prompt": "the mesh", "max_tokens": 8, "temperature": 0, "logit_bias": NO_EOS}
    status, answer, headers = post(at, "/v1/completions", body)
    took = time.monotonic() - started
    # Rerouted (a copy loaded on the other instance) or told to retry: at once, never a hang.
    if status == 200:
        assert answer["choices"][0]["text"] == expected
    else:
        assert status == 503 and headers.get("Retry-After") == "1", (status, answer)
        assert "restarting" in answer["error"]["message"], answer
    assert took < 10, f"answered after {took:.1f} s"
    wait_until(lambda: bool(engine_pids(model, at)) and engine_pids(model, at) != [old], 10, "the engine restarted")
    assert complete(at, model, logit_bias=NO_EOS) == expected


def test_engine_killed_mid_stream_ends_the_stream_with_an_error(llm_mesh: LlmMesh) -> None:
    llm_mesh.unload_everywhere()
    assert complete(llm_mesh.a, WIDE_MODEL, max_tokens=2)  # loaded somewhere first
    at = llm_mesh.holder(WIDE_MODEL)
    stream = client(llm_mesh.a).completions.create(
        model=WIDE_MODEL, prompt="the mesh", max_tokens=1500, temperature=0, logit_bias=NO_EOS, stream=True
    )
    pieces = 0
    started = time.monotonic()
    with pytest.raises(openai.APIError) as e:
        for _ in stream:
            pieces += 1
            if pieces == 5:
                kill_engine(WIDE_MODEL, at)
    assert pieces >= 5 and time.monotonic() - started < 30
    assert "ended early" in str(e.value.message), e.value
    wait_until(lambda: bool(engine_pids(WIDE_MODEL, at)), 15, "the engine restarted")
    assert complete(llm_mesh.a, WIDE_MODEL, max_tokens=4, logit_bias=NO_EOS)


def test_engine_killed_mid_stream_on_the_direct_path_ends_with_an_error_then_reroutes(llm_mesh: LlmMesh) -> None:
    """A copy beside the instance asked is streamed by meshd from its engine, not relayed by the
    runtime: a kill -9 of the engine mid-stream ends the stream with one error event at once,
    and the next request is served (rerouted, or by the engine back already) or told to retry,
    never left hanging."""
    llm_mesh.unload_everywhere()
    at = llm_mesh.a
    assert complete(at, WIDE_MODEL, max_tokens=2, extra_headers={"mm-balanced": "true"})  # loaded on a
    assert llm_mesh.holder(WIDE_MODEL).instance_id == at.instance_id
    stream = client(at).completions.create(
        model=WIDE_MODEL, prompt="the mesh", max_tokens=1500, temperature=0, logit_bias=NO_EOS, stream=True
    )
    pieces = 0
    started = time.monotonic()
    with pytest.raises(openai.APIError) as e:
        for _ in stream:
            pieces += 1
            if pieces == 5:
                kill_engine(WIDE_MODEL, at)
    assert pieces >= 5 and time.monotonic() - started < 30
    # "broke off": meshd saw the engine's connection break itself (the runtime's relay says "stopped").
    assert "ended early" in e.value.message and "broke off its answer" in e.value.message, e.value
    started = time.monotonic()
    body = {"model": WIDE_MODEL, "prompt": "the mesh", "max_tokens": 4, "temperature": 0, "logit_bias": NO_EOS}
    status, answer, headers = post(at, "/v1/completions", body)
    assert time.monotonic() - started < 10
    if status != 200:
        assert status == 503 and headers.get("Retry-After") == "1", (status, answer)
        assert "restarting" in answer["error"]["message"], answer
    else:
        assert answer["choices"][0]["text"], answer
    wait_until(lambda: bool(engine_pids(WIDE_MODEL, at)), 15, "the engine restarted")
    assert complete(at, WIDE_MODEL, max_tokens=4, logit_bias=NO_EOS)


TRITON_TEXT = Path(__file__).resolve().parent / "clients" / "triton_text.py"


def test_kserve_text_completions_through_tritonclient_unary_and_streamed(llm_mesh: LlmMesh) -> None:
    python = ensure_venv("tritonclient", TRITONCLIENT)
    model = LLM_MODELS[1]
    parameters = {"max_tokens": 10, "temperature": 0.0}
    argv = [str(python), str(TRITON_TEXT), "--url", llm_mesh.b.target, "--model", model]
    proc = subprocess.run(
        [*argv, "--parameters", json.dumps(parameters)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    out = json.loads(proc.stdout)
    assert out["metadata"]["inputs"][0] == {"name": "text_input", "datatype": "BYTES", "shape": ["1"]}
    assert [o["name"] for o in out["metadata"]["outputs"]] == ["text_output", "finish_reason"]
    assert out["config"]["config"]["model_transaction_policy"] == {"decoupled": True}
    assert out["infer"]["finish_reason"] in ("length", "stop")
    expected = complete(llm_mesh.a, model, prompt="the mesh", max_tokens=10)
    assert out["infer"]["text"] == expected
    assert len(out["stream"]) > 1 and out["stream"][-1]["finish_reason"]
    assert "".join(p["text"] for p in out["stream"]) == expected
