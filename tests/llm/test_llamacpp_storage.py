"""A GGUF where its users keep it (issue 42): meshd + `meshd llm-runtime` (with a model folder,
ROOT_MODEL_DIR) + a real llama.cpp engine, the model a folder in an S3-protocol store (moto's
server, started here) under a modelmesh-serving `storage-config` entry. The runtime pulls it
before the engine starts, hands llama.cpp the folder's one .gguf, meshd's record says it is on
disk, an unload keeps the files, and a reload comes from the disk once the store lost it. A
model whose object is not in the store fails its load, naming the model, the store and the
object; no credential in any log."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from meshd._proto.meshd import peer_pb2, peer_pb2_grpc
from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc
from meshd.core.records import DISK_TIER
from meshd.decisions.placement.disk import disk_reading
from meshd.testing.cluster import LocalMesh, Node
from meshd.testing.llm import ASCII_ONLY, LlmRuntimeArgs, add_llm_node, make_gguf
from meshd.testing.procs import wait_until

from ..integration.test_upstream_keys import under, upstream_key
from .conftest import engine_pids, post

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ACCESS, SECRET = "AKIAMESHDLLMTEST", "meshd-llm-secret-never-logged"
BUCKET = "modelmesh-example-models"
MODEL = "llm-stored"
SERVICE = "llm-storage"


@dataclass
class Stack:
    mesh: LocalMesh
    node: Node
    root: Path
    s3: Any

    def stub(self) -> Any:
        return mm_grpc.ModelMeshStub(grpc.insecure_channel(self.node.target))

    def loaded(self) -> list[str]:
        with grpc.insecure_channel(f"127.0.0.1:{self.node.peer_port}") as ch:
            stats = peer_pb2_grpc.MeshPeerStub(ch).InstanceStats(peer_pb2.InstanceStatsRequest(), timeout=10)
        return list(stats.loadedModels)


@pytest.fixture
def stack(llama_python: Path, tmp_path: Path, etcd_server: Any, moto_url: str) -> Iterator[Stack]:
    import boto3  # a dev dependency: missing, the test fails rather than skips

    s3 = boto3.client(
        "s3", endpoint_url=moto_url, aws_access_key_id=ACCESS, aws_secret_access_key=SECRET, region_name="us-east-1"
    )
    s3.create_bucket(Bucket=BUCKET)
    (gguf,) = make_gguf(llama_python, tmp_path / "gguf", 1, seed=7)
    s3.upload_file(str(gguf), BUCKET, f"llm/tiny/{gguf.name}")  # a folder holding one GGUF
    config = tmp_path / "storage-config"
    config.mkdir()
    (config / "localMinIO").write_text(  # modelmesh-serving's docs' localMinIO entry
        json.dumps(
            {
                "type": "s3",
                "access_key_id": ACCESS,
                "secret_access_key": SECRET,
                "endpoint_url": moto_url,
                "default_bucket": BUCKET,
                "region": "us-east-1",
            }
        )
    )
    root = tmp_path / "models"
    mesh = LocalMesh(tmp_path / "mesh", service=SERVICE)
    mesh.etcd_url = etcd_server.url
    try:
        env = {"ROOT_MODEL_DIR": str(root), "STORAGE_CONFIG_DIR": str(config)}
        node = add_llm_node(mesh, "llm-a", LlmRuntimeArgs(llama_python, env=env), {"rate_check_ms": 600_000})
        yield Stack(mesh, node, root, s3)
    finally:
        mesh.stop()


def register(stack: Stack, model_id: str, path: str) -> None:
    # What modelmesh-serving's controller writes for a Predictor with storage.key/path.
    key = json.dumps({"storage_key": "localMinIO", "storage_params": {"bucket": BUCKET}})
    info = mm.ModelInfo(type="llamacpp", path=path, key=key)
    stack.stub().registerModel(mm.RegisterModelRequest(modelId=model_id, modelInfo=info), timeout=30)


def chat(node: Node, model: str) -> str:
    c = openai.OpenAI(base_url=f"{node.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
    done = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, logit_bias=ASCII_ONLY
    )
    return done.choices[0].message.content or ""


def test_a_gguf_in_s3_is_pulled_served_kept_on_disk_and_reloaded_from_it(stack: Stack, etcd_server: Any) -> None:
    register(stack, MODEL, "llm/tiny")
    first = chat(stack.node, MODEL)
    assert first
    files = list((stack.root / MODEL).rglob("*.gguf"))  # ROOT_MODEL_DIR/<id>/<basename>/x.gguf
    assert len(files) == 1 and files[0].parent == stack.root / MODEL / "tiny", files
    assert not list(stack.root.rglob("*.partial"))

    # meshd publishes what the runtime keeps on disk.
    key = upstream_key("", SERVICE, "instances", "llm-a")

    def on_disk() -> bool:
        reading = disk_reading(under(etcd_server, key).get(key, {}))
        return reading is not None and MODEL in reading

    wait_until(on_disk, 20, "the instance record to name the model on disk")
    assert DISK_TIER in under(etcd_server, key)[key]

    # Unloaded: the engine stops, the files stay.
    status, _, _ = post(stack.node, f"/v2/repository/models/{MODEL}/unload", {})
    assert status == 200
    wait_until(lambda: MODEL not in stack.loaded() and not engine_pids(MODEL, stack.node), 30, "the unload")
    assert files[0].is_file()

    # The store loses it; a reload still serves, from the disk tier, the same answer.
    for obj in stack.s3.list_objects_v2(Bucket=BUCKET, Prefix="llm/tiny/").get("Contents", []):
        stack.s3.delete_object(Bucket=BUCKET, Key=obj["Key"])
    assert chat(stack.node, MODEL) == first
    runtime_log = stack.node.runtime.log_path.read_text(errors="replace")
    assert f"{MODEL}: found on disk" in runtime_log

    # A model whose object is not in the store: its load fails, naming model, store and object.
    register(stack, "llm-missing", "llm/no-such-model")
    status, answer, _ = post(
        stack.node, "/v1/chat/completions", {"model": "llm-missing", "messages": [{"role": "user", "content": "hi"}]}
    )
    message = json.dumps(answer)
    assert status >= 400, answer
    assert "llm-missing" in message and "llm/no-such-model" in message and "s3" in message.lower(), message
    assert not (stack.root / "llm-missing").exists() or not list((stack.root / "llm-missing").rglob("*.gguf"))

    for child in (stack.node.runtime, stack.node.meshd):
        text = child.log_path.read_text(errors="replace")
        assert text and SECRET not in text and ACCESS not in text
