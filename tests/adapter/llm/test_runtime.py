"""`meshd llm-runtime` as a process, over its SPI and inference port, with engines of our own
that misbehave on cue (meshd.testing.fake_llm): a start-up failure says why, a crashing engine
is restarted and meanwhile answered UNAVAILABLE at once, one that keeps crashing is given up
and its model reported gone. Real engines: tests/llm."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshd._proto.meshd import disk_pb2, disk_pb2_grpc, llm_pb2, llm_pb2_grpc
from meshd._proto.mmesh import model_runtime_pb2 as rt
from meshd._proto.mmesh import model_runtime_pb2_grpc as rt_grpc
from meshd.adapter.llm.runtime import engine_file
from meshd.decisions.placement.llm import LOAD_HEADER, EngineLoad, parse_load
from meshd.testing.procs import Children, free_ports, port_open, wait_until

pytestmark = pytest.mark.slow  # real processes: the runtime and its engines

FAKE = f"{sys.executable} -m meshd.testing.fake_llm --port {{port}} --name {{name}}"


def start_runtime(children: Children, tmp: Path, engine_flags: str, *flags: str) -> grpc.Channel:
    (port,) = free_ports(1)
    argv = [sys.executable, "-m", "meshd", "llm-runtime", "--engine-command", FAKE + engine_flags]
    argv += ["--port", str(port), "--workdir", str(tmp), "--memory-bytes", str(1 << 30), *flags]
    child = children.start("llm-runtime", argv)
    wait_until(lambda: port_open(port) or not child.alive(), 30, "llm-runtime up")
    assert child.alive(), child.log_tail()
    return grpc.insecure_channel(f"127.0.0.1:{port}")


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Children]:
    with Children(tmp_path / "logs") as c:
        yield c


def load(channel: grpc.Channel, model_id: str, path: Path, model_type: str = "llm") -> Any:
    req = rt.LoadModelRequest(modelId=model_id, modelType=model_type, modelPath=str(path))
    return rt_grpc.ModelRuntimeStub(channel).loadModel(req, timeout=30)


def call(channel: grpc.Channel, model_id: str, prompt: str, stream: bool = False) -> list[Any]:
    body = json.dumps({"model": "client-name", "prompt": prompt, "stream": stream}).encode()
    req = llm_pb2.HttpCall(model_id=model_id, path="/v1/completions", body=body)
    return list(llm_pb2_grpc.OpenAIStub(channel).Call(req, timeout=10))


def test_status_load_call_unload(children: Children, tmp_path: Path) -> None:
    ch = start_runtime(children, tmp_path, "")
    status = rt_grpc.ModelRuntimeStub(ch).runtimeStatus(rt.RuntimeStatusRequest(), timeout=10)
    assert status.status == rt.RuntimeStatusResponse.READY and status.capacityInBytes == 1 << 30
    assert list(status.methodInfos["meshd.llm.OpenAI/Call"].idInjectionPath) == [1]
    assert load(ch, "m1", tmp_path).sizeInBytes > 10 << 20  # the engine's resident memory
    head, *rest = call(ch, "m1", "the mesh answers")
    assert (head.status, head.content_type.split(";")[0]) == (200, "application/json")
    answer = json.loads(b"".join(c.data for c in [head, *rest]))
    assert answer["model"] == "m1", "the engine sees its own name for the model, never the client's"
    streamed = b"".join(c.data for c in call(ch, "m1", "a b c", stream=True))
    assert streamed.count(b"data: ") == 4 and streamed.endswith(b"data: [DONE]\n\n")
    rt_grpc.ModelRuntimeStub(ch).unloadModel(rt.UnloadModelRequest(modelId="m1"), timeout=10)
    with pytest.raises(grpc.RpcError) as e:
        call(ch, "m1", "x")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_loads_that_cannot_work_say_why(children: Children, tmp_path: Path) -> None:
    ch = start_runtime(children, tmp_path, " --exit-at-start 3")
    cases = [
        ("m", tmp_path, "llm", grpc.StatusCode.INTERNAL, "exited (exit status 3): fake engine: told to fail at start"),
        ("m", tmp_path / "absent.gguf", "llm", grpc.StatusCode.NOT_FOUND, "does not exist"),
        ("m", tmp_path, "sklearn", grpc.StatusCode.INVALID_ARGUMENT, "serves language models"),
    ]
    for model_id, path, model_type, code, words in cases:
        with pytest.raises(grpc.RpcError) as e:
            load(ch, model_id, path, model_type)
        assert e.value.code() == code and words in (e.value.details() or ""), e.value


def test_a_crashing_engine_is_restarted_then_given_up_and_its_model_reported_gone(
    children: Children, tmp_path: Path
) -> None:
    ch = start_runtime(children, tmp_path, " --die-after 0.6", "--max-restarts", "2")
    load(ch, "m1", tmp_path)
    stub = rt_grpc.ModelRuntimeStub(ch)
    seen_restarting = False
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            call(ch, "m1", "x")
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                assert "restarting" in (e.details() or "") and "exit status 1" in (e.details() or "")
                seen_restarting = True
            elif e.code() == grpc.StatusCode.NOT_FOUND:
                break
        time.sleep(0.05)
    else:
        pytest.fail("the crashing engine was never given up")
    assert seen_restarting, "calls during a restart are told so"
    with pytest.raises(grpc.RpcError) as e:
        stub.modelSize(rt.ModelSizeRequest(modelId="m1"), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_answers_carry_the_engines_load(children: Children, tmp_path: Path) -> None:
    """Each answer's initial metadata says the engine's load (`meshd-engine-load`): the calls
    in flight at the runtime, and the engine's own reading of its queue once it was read."""
    ch = start_runtime(children, tmp_path, " --max-running 1 --token-interval-ms 5")
    load(ch, "m1", tmp_path)
    body = json.dumps({"model": "m1", "prompt": "a b c", "stream": True}).encode()

    def one() -> EngineLoad:
        call = llm_pb2_grpc.OpenAIStub(ch).Call(llm_pb2.HttpCall(model_id="m1", path="/v1/completions", body=body))
        said = dict(call.initial_metadata())
        assert b"".join(c.data for c in call).endswith(b"data: [DONE]\n\n")
        got = parse_load(said[LOAD_HEADER])
        assert got is not None, said
        return got

    assert one().inflight == 1
    readings: list[EngineLoad] = []
    wait_until(lambda: readings.append(one()) or readings[-1].running >= 0, 30, "the engine's metrics read")
    assert readings[-1].waiting == 0 and 0.0 <= readings[-1].kv_use <= 1.0


def test_with_a_model_folder_a_bad_store_fails_the_load_and_the_disk_tier_is_served(
    children: Children, tmp_path: Path
) -> None:
    ch = start_runtime(children, tmp_path, "", "--root-model-dir", str(tmp_path / "models"))
    # A key naming a storage-config entry that is not there fails the load, naming both.
    key = json.dumps({"storage_key": "no-such-entry"})
    req = rt.LoadModelRequest(modelId="stored", modelType="llm", modelPath="llm/m", modelKey=key)
    with pytest.raises(grpc.RpcError) as e:
        rt_grpc.ModelRuntimeStub(ch).loadModel(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
    assert "'stored'" in (e.value.details() or "") and "no-such-entry" in (e.value.details() or "")
    size = rt.PredictModelSizeRequest(modelId="stored", modelType="llm", modelPath="llm/m", modelKey=key)
    with pytest.raises(grpc.RpcError) as e:
        rt_grpc.ModelRuntimeStub(ch).predictModelSize(size, timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    inv = disk_pb2_grpc.DiskTierStub(ch).diskInventory(disk_pb2.DiskInventoryRequest(), timeout=10)
    assert list(inv.models) == [] and inv.budget_bytes > 0


def test_a_pulled_folder_holding_one_gguf_is_handed_over_as_that_file(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    (folder / "sub").mkdir(parents=True)
    (folder / "README.md").write_text("x")
    assert engine_file(folder) == folder  # no GGUF: the folder (vLLM's Hugging Face layout)
    (folder / "sub" / "a.gguf").write_bytes(b"GGUF")
    assert engine_file(folder) == folder / "sub" / "a.gguf"
    assert engine_file(folder / "sub" / "a.gguf") == folder / "sub" / "a.gguf"
    (folder / "b.gguf").write_bytes(b"GGUF")
    assert engine_file(folder) == folder  # two: the engine is told the folder, and says so
