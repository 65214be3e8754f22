"""A two-instance mesh of real processes beside real llama.cpp engines (`meshd llm-runtime`),
built once per module: etcd, two meshd instances, their runtimes, and tiny GGUF models.

Each runtime's budget holds two tiny engines and not three. Every process is stopped by PID
when the module ends, engines with their runtimes.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshd._proto.meshd import peer_pb2, peer_pb2_grpc
from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc
from meshd.testing.cluster import LocalMesh, Node
from meshd.testing.llm import BUILD_TIMEOUT_S, WIDE_SHAPE, LlmRuntimeArgs, add_llm_node, llamacpp_python, make_gguf

LLM_MODELS = ("llm-0", "llm-1", "llm-2")
WIDE_MODEL = "llm-wide"
TENSOR_MODEL = "tensor-model"  # a reference-runtime model: never loaded here, only refused
VMODEL = "chat"


@dataclass
class LlmMesh:
    mesh: LocalMesh
    a: Node
    b: Node
    paths: dict[str, Path]

    def stub(self, node: Node | None = None) -> Any:
        return mm_grpc.ModelMeshStub(grpc.insecure_channel((node or self.a).target))

    def stats(self, node: Node) -> Any:
        with grpc.insecure_channel(f"127.0.0.1:{node.peer_port}") as ch:
            return peer_pb2_grpc.MeshPeerStub(ch).InstanceStats(peer_pb2.InstanceStatsRequest(), timeout=10)

    def holder(self, model_id: str) -> Node:
        """The instance whose runtime holds the model's one copy."""
        holders = [n for n in (self.a, self.b) if model_id in self.stats(n).loadedModels]
        assert len(holders) == 1, f"{model_id} is loaded on {[n.instance_id for n in holders]}"
        return holders[0]

    def unload_everywhere(self) -> None:
        """Every copy unloaded (the KServe repository extension, for the whole mesh)."""
        for model_id in (*LLM_MODELS, WIDE_MODEL):
            post(self.a, f"/v2/repository/models/{model_id}/unload", {})


def post(
    node: Node, path: str, body: Any, headers: dict[str, str] | None = None, timeout: float = 60
) -> tuple[int, Any, dict[str, str]]:
    """POST JSON to a node's HTTP port: (status, decoded body, headers)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        node.http_url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw.strip() else None, dict(r.headers)
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, json.loads(raw) if raw.strip() else None, dict(e.headers)


def engine_pids(model_id: str, node: Node) -> list[int]:
    """The pids of the engine processes serving `model_id` (llama.cpp's --model_alias) beside `node`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"llama_cpp.server" in argv and model_id.encode() in argv and b"--model_alias" in argv:
            if (
                argv[argv.index(b"--model_alias") + 1] == model_id.encode()
                and _parent(int(entry)) == node.runtime.proc.pid
            ):
                found.append(int(entry))
    return found


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return 0
    return int(stat[stat.rfind(")") + 2 :].split()[1])


def kill_engine(model_id: str, node: Node) -> int:
    pids = engine_pids(model_id, node)
    assert len(pids) == 1, f"expected one engine for {model_id}, found {pids}"
    os.kill(pids[0], signal.SIGKILL)
    return pids[0]


@pytest.fixture(scope="session")
def llama_python() -> Path:
    """The llama.cpp venv's python (compiled on first use: ~9 min on 2 cores, then cached)."""
    return llamacpp_python()


# Whichever test first asks for the llama.cpp venv builds it in its set-up, which counts toward
# its timeout: a page test with the suite's 300 s timed out mid-build on a fresh machine (no
# wheel to be had) and every later llama.cpp test failed with it (the session fixture's error).
FIRST_BUILD_TIMEOUT_S = BUILD_TIMEOUT_S + 600


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "llama_python" not in getattr(item, "fixturenames", ()):
            continue
        marker = item.get_closest_marker("timeout")
        if marker is None or not marker.args or marker.args[0] < FIRST_BUILD_TIMEOUT_S:
            item.add_marker(pytest.mark.timeout(FIRST_BUILD_TIMEOUT_S))


def register_models(lm: LlmMesh) -> None:
    stub = lm.stub()
    for model_id, path in lm.paths.items():
        info = mm.ModelInfo(type="llamacpp", path=str(path))
        stub.registerModel(mm.RegisterModelRequest(modelId=model_id, modelInfo=info), timeout=30)
    stub.registerModel(
        mm.RegisterModelRequest(modelId=TENSOR_MODEL, modelInfo=mm.ModelInfo(type="demo", path="/nowhere")),
        timeout=30,
    )
    stub.setVModel(mm.SetVModelRequest(vModelId=VMODEL, targetModelId=LLM_MODELS[0]), timeout=30)


@pytest.fixture(scope="module")
def gguf_models(llama_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf")
    tiny = make_gguf(llama_python, out, len(LLM_MODELS), seed=7)
    (wide,) = make_gguf(llama_python, out, 1, seed=99, prefix="wide", shape=WIDE_SHAPE)
    return {**dict(zip(LLM_MODELS, tiny, strict=True)), WIDE_MODEL: wide}


def start_llm_mesh(
    llama_python: Path, tmp: Path, etcd_url: str, paths: dict[str, Path], instances: int
) -> tuple[LocalMesh, LlmMesh]:
    mesh = LocalMesh(tmp, service=f"llm-{tmp.name}-{os.getpid()}")
    mesh.etcd_url = etcd_url
    # No copy scaling during the tests: which instance holds what is each test's business.
    settings: dict[str, str | int] = {"rate_check_ms": 600_000}
    try:
        args = LlmRuntimeArgs(llama_python)
        nodes = [add_llm_node(mesh, f"llm-{'ab'[i]}", args, settings) for i in range(instances)]
        lm = LlmMesh(mesh, nodes[0], nodes[-1], paths)
        register_models(lm)
    except BaseException:
        mesh.stop()
        raise
    return mesh, lm


@pytest.fixture(scope="module")
def llm_mesh(
    llama_python: Path, gguf_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, etcd_server: Any
) -> Iterator[LlmMesh]:
    """Two instances, each beside its own runtime."""
    mesh, lm = start_llm_mesh(llama_python, tmp_path_factory.mktemp("mesh2"), etcd_server.url, gguf_models, 2)
    try:
        yield lm
    finally:
        mesh.stop()


@pytest.fixture
def lone_instance(
    llama_python: Path, gguf_models: dict[str, Path], tmp_path: Path, etcd_server: Any
) -> Iterator[LlmMesh]:
    """One instance whose runtime has room for two tiny engines, not three."""
    mesh, lm = start_llm_mesh(llama_python, tmp_path / "mesh1", etcd_server.url, gguf_models, 1)
    try:
        yield lm
    finally:
        mesh.stop()
