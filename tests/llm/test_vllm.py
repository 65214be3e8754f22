"""meshd with a real vLLM engine (its CPU build): LoRA adapters registered as models with
their base, loaded at run time into the base's engine where the base is loaded, and with two
adapter slots for three adapters, evicted and loaded again like any model."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc
from meshd.testing.cluster import LocalMesh, Node
from meshd.testing.llm import add_llm_node, make_hf_llama, vllm_args, vllm_python

from .conftest import LlmMesh

# A first run builds the vLLM venv (1-3 min).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BASE = "vbase"
ADAPTERS = ("adapter-0", "adapter-1", "adapter-2")
SLOTS = 2


@pytest.fixture(scope="module")
def vllm_mesh(tmp_path_factory: pytest.TempPathFactory, etcd_server: Any) -> Iterator[LlmMesh]:
    python = vllm_python()
    tmp = tmp_path_factory.mktemp("vllm")
    base, adapters = make_hf_llama(python, tmp / "models", len(ADAPTERS), seed=3)
    mesh = LocalMesh(tmp / "mesh", service=f"vllm-{os.getpid()}")
    mesh.etcd_url = etcd_server.url
    try:
        node = add_llm_node(mesh, "vllm-a", vllm_args(python, SLOTS), {"rate_check_ms": 600_000})
        lm = LlmMesh(mesh, node, node, {BASE: base, **dict(zip(ADAPTERS, adapters, strict=True))})
        stub = mm_grpc.ModelMeshStub(grpc.insecure_channel(node.target))
        stub.registerModel(
            mm.RegisterModelRequest(modelId=BASE, modelInfo=mm.ModelInfo(type="vllm", path=str(base))), timeout=30
        )
        key = json.dumps({"meshd": {"base_model": BASE}})
        for model_id, path in zip(ADAPTERS, adapters, strict=True):
            info = mm.ModelInfo(type="lora", path=str(path), key=key)
            stub.registerModel(mm.RegisterModelRequest(modelId=model_id, modelInfo=info), timeout=30)
        yield lm
    finally:
        mesh.stop()


def complete(node: Node, model: str) -> str:
    c = openai.OpenAI(base_url=f"{node.http_url}/v1", api_key="unused", max_retries=0, timeout=300)
    return c.completions.create(model=model, prompt="the mesh", max_tokens=8, temperature=0).choices[0].text


def engine_models(lm: LlmMesh) -> dict[str, str | None]:
    """What the vLLM engine itself holds: model id -> parent (an adapter's base)."""
    log = (lm.mesh.workdir / "logs" / "vllm-a-llm-runtime.log").read_text()
    port = int(log.rsplit(f"loaded {BASE}: engine pid ", 1)[1].split(" on port ", 1)[1].split(",", 1)[0])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
        return {m["id"]: m.get("parent") for m in json.load(r)["data"]}


def test_adapters_load_into_their_base_and_take_its_slots_like_models(vllm_mesh: LlmMesh) -> None:
    node = vllm_mesh.a
    first = {model: complete(node, model) for model in ADAPTERS[:2]}  # the base loads first, then each
    base_answer = complete(node, BASE)
    assert len({base_answer, *first.values()}) == 3, "each adapter changes the answers"
    assert engine_models(vllm_mesh) == {BASE: None, ADAPTERS[0]: BASE, ADAPTERS[1]: BASE}
    before = vllm_mesh.stats(node)
    first[ADAPTERS[2]] = complete(node, ADAPTERS[2])  # two slots: the least recently used adapter goes
    after = vllm_mesh.stats(node)
    assert after.evictions == before.evictions + 1
    assert set(after.loadedModels) == {BASE, ADAPTERS[1], ADAPTERS[2]}
    assert engine_models(vllm_mesh) == {BASE: None, ADAPTERS[1]: BASE, ADAPTERS[2]: BASE}
    assert complete(node, ADAPTERS[0]) == first[ADAPTERS[0]]  # loaded again, the same adapter
    assert set(vllm_mesh.stats(node).loadedModels) == {BASE, ADAPTERS[0], ADAPTERS[2]}
    for model in ADAPTERS:  # and each answers as it did
        assert complete(node, model) == first[model]
    st = mm_grpc.ModelMeshStub(grpc.insecure_channel(node.target)).getModelStatus(
        mm.GetStatusRequest(modelId=ADAPTERS[1]), timeout=10
    )
    assert st.status == mm.ModelStatusInfo.LOADED
