"""The wire contract: generated code is fresh, and names and field numbers are SPEC's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshd._proto.inference import grpc_predict_v2_pb2 as v2
from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd._proto.mmesh import model_runtime_pb2 as rt

ROOT = Path(__file__).resolve().parent.parent


def numbers(message: object) -> dict[str, int]:
    return {f.name: f.number for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]


def test_generated_code_is_not_stale() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_runtime_spi_contract() -> None:
    assert rt.DESCRIPTOR.package == "mmesh"
    assert [m.name for m in rt.DESCRIPTOR.services_by_name["ModelRuntime"].methods] == [
        "loadModel",
        "unloadModel",
        "predictModelSize",
        "modelSize",
        "runtimeStatus",
    ]
    assert numbers(rt.LoadModelRequest) == {"modelId": 1, "modelType": 2, "modelPath": 3, "modelKey": 4}
    assert numbers(rt.LoadModelResponse) == {"sizeInBytes": 1, "maxConcurrency": 2}
    assert numbers(rt.RuntimeStatusResponse) == {
        "status": 1,
        "capacityInBytes": 2,
        "maxLoadingConcurrency": 3,
        "modelLoadingTimeoutMs": 4,
        "defaultModelSizeInBytes": 5,
        "runtimeVersion": 6,
        "numericRuntimeVersion": 7,
        "methodInfos": 8,
        "limitModelConcurrency": 9,
        "allowAnyMethod": 10,
    }
    assert dict(rt.RuntimeStatusResponse.Status.items()) == {"STARTING": 0, "READY": 1, "FAILING": 2}


def test_management_api_contract() -> None:
    assert numbers(mm.RegisterModelRequest) == {
        "modelId": 1,
        "modelInfo": 2,
        "loadNow": 3,
        "sync": 4,
        "lastUsedTime": 5,
    }
    assert numbers(mm.EnsureLoadedRequest) == {"modelId": 1, "lastUsedTime": 2, "sync": 4}
    assert numbers(mm.SetVModelRequest) == {
        "vModelId": 1,
        "targetModelId": 2,
        "updateOnly": 3,
        "modelInfo": 4,
        "autoDeleteTargetModel": 5,
        "loadNow": 6,
        "force": 7,
        "sync": 8,
        "expectedTargetModelId": 9,
        "owner": 10,
    }
    assert dict(mm.ModelStatusInfo.ModelStatus.items()) == {
        "NOT_FOUND": 0,
        "NOT_LOADED": 1,
        "LOADING": 2,
        "LOADED": 3,
        "LOADING_FAILED": 4,
        "UNKNOWN": 5,
    }
    assert numbers(mm.VModelStatusInfo) == {
        "status": 1,
        "activeModelId": 2,
        "targetModelId": 3,
        "activeModelStatus": 4,
        "targetModelStatus": 5,
        "owner": 6,
    }


def test_kserve_v2_contract() -> None:
    svc = v2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert v2.DESCRIPTOR.package == "inference"
    assert {"ModelInfer", "ModelStreamInfer", "ModelConfig", "RepositoryIndex", "RepositoryModelLoad"} <= {
        m.name for m in svc.methods
    }
    assert svc.methods_by_name["ModelStreamInfer"].client_streaming
    assert numbers(v2.ModelInferRequest) == {
        "model_name": 1,
        "model_version": 2,
        "id": 3,
        "parameters": 4,
        "inputs": 5,
        "outputs": 6,
        "raw_input_contents": 7,
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("requirements", "protobuf_prefix"),
    [
        (["protobuf>=7,<8", "grpcio>=1.75.1"], "7."),  # the newest meshd allows
        (["protobuf==6.31.1", "grpcio==1.75.1"], "6.31.1"),  # the floors pyproject.toml declares
    ],
    ids=["protobuf-7", "declared-floors"],
)
def test_generated_code_imports_under_protobuf_7_and_the_declared_floors(
    tmp_path: Path, requirements: list[str], protobuf_prefix: str
) -> None:
    """meshd pins nothing that stops protobuf 7, and its floors are true: the generated code
    imports under the newest protobuf and under the oldest versions pyproject.toml allows."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = venv / "bin" / "pip"
    done = subprocess.run([str(pip), "install", "-q", *requirements], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    code = (
        f"import google.protobuf as p; assert p.__version__.startswith({protobuf_prefix!r}), p.__version__\n"
        "import meshd._proto.mmesh.model_mesh_pb2_grpc, meshd._proto.mmesh.model_runtime_pb2_grpc\n"
        "import meshd._proto.inference.grpc_predict_v2_pb2_grpc, meshd._proto.meshd.peer_pb2_grpc\n"
        "print('ok')"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-W", "error", "-c", code], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
