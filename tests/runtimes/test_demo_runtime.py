"""The demo runtime as a real child process, driven over the runtime SPI and KServe V2."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshd._proto.inference import grpc_predict_v2_pb2 as pb
from meshd._proto.mmesh import model_runtime_pb2 as rt
from meshd.runtimes.demo import parse_args
from meshd.runtimes.models import (
    DemoModel,
    GeneratedModel,
    decode_infer_response,
    make_echo_request,
    make_infer_request,
    unpack_f32,
    write_echo_model,
)

ROWS = [[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0], [-1.5, 0.25, 8.0, -2.0]]
INFERENCE_METHODS = {
    f"inference.GRPCInferenceService/{m}"
    for m in ("ModelInfer", "ModelMetadata", "ModelReady", "ModelConfig", "ModelStreamInfer")
} | {f"meshd.demo.Echo/{m}" for m in ("Unary", "ServerStream", "ClientStream", "Bidi")}
Status = rt.RuntimeStatusResponse
# conftest.start_runtime(*flags, socket=, serving_port=, wait_ready=) -> DemoRuntime
StartRuntime = Callable[..., Any]


def expected(model: GeneratedModel, rows: list[list[float]]) -> list[list[float]]:
    # The wire carries float32 both ways, so compare against float32-rounded math.
    return DemoModel.load(model.path).predict(rows)


def assert_rows_close(actual: list[list[float]], want: list[list[float]]) -> None:
    assert len(actual) == len(want)
    for got, row in zip(actual, want, strict=True):
        assert got == pytest.approx(row, rel=1e-5, abs=1e-6)


def code_of(call: object) -> grpc.StatusCode:
    assert isinstance(call, grpc.RpcError)
    return call.code()  # type: ignore[no-any-return]


def test_runtime_status_reports_defaults_and_method_infos(start_runtime: StartRuntime) -> None:
    status = start_runtime().status()
    assert status.status == Status.READY
    assert status.capacityInBytes == 256 << 20
    assert status.maxLoadingConcurrency == 2
    assert status.modelLoadingTimeoutMs == 30_000
    assert status.defaultModelSizeInBytes == 1 << 20
    assert status.runtimeVersion.startswith("meshd-demo/")
    assert not status.limitModelConcurrency and not status.allowAnyMethod
    assert set(status.methodInfos) == INFERENCE_METHODS
    assert all(not info.idInjectionPath for info in status.methodInfos.values())


def test_runtime_status_follows_flags(start_runtime: StartRuntime) -> None:
    runtime = start_runtime(
        "--capacity-bytes=5000",
        "--max-loading-concurrency=7",
        "--loading-timeout-ms=1234",
        "--default-model-size=99",
        "--limit-model-concurrency",
        "--inject-id",
        "--no-uvloop",  # the plain asyncio loop must work too
    )
    status = runtime.status()
    assert (status.capacityInBytes, status.maxLoadingConcurrency, status.modelLoadingTimeoutMs) == (5000, 7, 1234)
    assert status.defaultModelSizeInBytes == 99
    assert status.limitModelConcurrency
    injected = {k: list(v.idInjectionPath) for k, v in status.methodInfos.items() if v.idInjectionPath}
    assert injected == {
        "inference.GRPCInferenceService/ModelInfer": [1],
        "inference.GRPCInferenceService/ModelMetadata": [1],
    }


def test_starting_until_startup_delay_then_purges_before_ready(
    start_runtime: StartRuntime, models: list[GeneratedModel]
) -> None:
    runtime = start_runtime("--startup-delay-ms=1500", wait_ready=False)
    assert runtime.status().status == Status.STARTING
    assert not runtime.inference.ServerReady(pb.ServerReadyRequest()).ready
    # Loads before READY work, but READY wipes them (SPEC §1: purge before READY).
    runtime.load("early", models[0].path)
    assert runtime.loaded() == ["early"]
    deadline = time.monotonic() + 10
    while runtime.status().status != Status.READY:
        assert time.monotonic() < deadline, "runtime never became READY"
        time.sleep(0.1)
    assert runtime.loaded() == []
    assert runtime.inference.ServerReady(pb.ServerReadyRequest()).ready
    # Every READY answer purges: a restarted meshd must find an empty runtime.
    runtime.load("later", models[1].path)
    assert runtime.loaded() == ["later"]
    assert runtime.status().status == Status.READY
    assert runtime.loaded() == []


def test_load_predict_unload_round_trip(start_runtime: StartRuntime, models: list[GeneratedModel]) -> None:
    runtime = start_runtime("--max-concurrency=3")
    loaded = runtime.load("m1", models[1].path)
    assert (loaded.sizeInBytes, loaded.maxConcurrency) == (3 << 20, 3)
    assert runtime.runtime.modelSize(rt.ModelSizeRequest(modelId="m1")).sizeInBytes == 3 << 20

    resp = runtime.inference.ModelInfer(make_infer_request("m1", ROWS))
    assert resp.model_name == "m1"
    assert_rows_close(decode_infer_response(resp), expected(models[1], ROWS))
    assert decode_infer_response(resp)[1][0] == 1.0  # bias[0] is the model index

    meta = runtime.inference.ModelMetadata(pb.ModelMetadataRequest(name="m1"))
    assert (meta.name, [list(t.shape) for t in meta.inputs], [list(t.shape) for t in meta.outputs]) == (
        "m1",
        [[-1, 4]],
        [[-1, 2]],
    )
    assert runtime.inference.ModelConfig(pb.ModelConfigRequest(name="m1")).config.name == "m1"
    assert runtime.inference.ModelReady(pb.ModelReadyRequest(name="m1")).ready

    runtime.runtime.unloadModel(rt.UnloadModelRequest(modelId="m1"))
    assert runtime.loaded() == []
    assert not runtime.inference.ModelReady(pb.ModelReadyRequest(name="m1")).ready
    with pytest.raises(grpc.RpcError) as info:
        runtime.inference.ModelInfer(make_infer_request("m1", ROWS))
    assert code_of(info.value) == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "model m1 is not loaded"
    for call in (
        lambda: runtime.runtime.unloadModel(rt.UnloadModelRequest(modelId="m1")),
        lambda: runtime.runtime.modelSize(rt.ModelSizeRequest(modelId="m1")),
        lambda: runtime.inference.ModelMetadata(pb.ModelMetadataRequest(name="m1")),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert code_of(info.value) == grpc.StatusCode.NOT_FOUND


def test_model_id_headers_override_the_request_body(start_runtime: StartRuntime, models: list[GeneratedModel]) -> None:
    runtime = start_runtime()
    runtime.load("mödel-ü", models[2].path)
    runtime.load("plain", models[3].path)
    request = make_infer_request("someone-else", [[0.0, 0.0, 0.0, 0.0]])
    by_bin = runtime.inference.ModelInfer(request, metadata=[("mm-model-id-bin", "mödel-ü".encode())])
    assert (by_bin.model_name, decode_infer_response(by_bin)[0][0]) == ("mödel-ü", 2.0)
    by_ascii = runtime.inference.ModelInfer(request, metadata=[("mm-model-id", "plain")])
    assert (by_ascii.model_name, decode_infer_response(by_ascii)[0][0]) == ("plain", 3.0)


def test_zero_size_makes_the_caller_ask_model_size(start_runtime: StartRuntime, models: list[GeneratedModel]) -> None:
    runtime = start_runtime("--zero-size")
    assert runtime.load("m0", models[0].path).sizeInBytes == 0
    assert runtime.runtime.modelSize(rt.ModelSizeRequest(modelId="m0")).sizeInBytes == 3 << 20


def test_load_failures(start_runtime: StartRuntime, models: list[GeneratedModel], tmp_path: Path) -> None:
    runtime = start_runtime("--fail-load=^doomed-")
    with pytest.raises(grpc.RpcError) as info:
        runtime.load("doomed-1", models[0].path)
    assert (code_of(info.value), info.value.details()) == (
        grpc.StatusCode.INTERNAL,
        "injected load failure for doomed-1",
    )

    missing = tmp_path / "nope.json"
    with pytest.raises(grpc.RpcError) as info:
        runtime.load("missing", missing)
    assert code_of(info.value) == grpc.StatusCode.FAILED_PRECONDITION
    assert str(missing) in info.value.details()

    invalid = tmp_path / "invalid.json"
    invalid.write_text(json.dumps({"format": "meshd-demo/1", "kind": "linear"}))
    with pytest.raises(grpc.RpcError) as info:
        runtime.load("invalid", invalid)
    assert code_of(info.value) == grpc.StatusCode.FAILED_PRECONDITION
    assert "'inputs'" in info.value.details()

    runtime.load("fine", models[0].path)
    assert runtime.loaded() == ["fine"]


def test_predict_model_size_sources(start_runtime: StartRuntime, models: list[GeneratedModel], tmp_path: Path) -> None:
    runtime = start_runtime("--default-model-size=4242")

    def predict(path: Path | str, key: str = "") -> int:
        req = rt.PredictModelSizeRequest(modelId="x", modelPath=str(path), modelKey=key)
        return int(runtime.runtime.predictModelSize(req).sizeInBytes)

    assert predict(models[0].path) == 3 << 20
    assert predict(tmp_path / "absent.json", json.dumps({"disk_size_bytes": 1000, "other": 1})) == 1250
    assert predict(tmp_path / "absent.json", "not json") == 4242


def test_cancelled_load_leaves_nothing_loaded(start_runtime: StartRuntime, models: list[GeneratedModel]) -> None:
    runtime = start_runtime()
    slow = json.dumps({"load_delay_ms": 800})
    future = runtime.runtime.loadModel.future(
        rt.LoadModelRequest(modelId="slow", modelPath=str(models[0].path), modelKey=slow)
    )
    time.sleep(0.3)
    assert future.cancel()
    time.sleep(1.0)  # well past the load delay: a load that ignored the cancel would have landed
    assert runtime.loaded() == []
    with pytest.raises(grpc.RpcError) as info:
        runtime.runtime.modelSize(rt.ModelSizeRequest(modelId="slow"))
    assert code_of(info.value) == grpc.StatusCode.NOT_FOUND
    assert "load of slow cancelled" in runtime.child.log_path.read_text()


def test_unload_during_load_voids_the_load(start_runtime: StartRuntime, models: list[GeneratedModel]) -> None:
    runtime = start_runtime("--load-delay-ms=600")
    future = runtime.runtime.loadModel.future(rt.LoadModelRequest(modelId="m", modelPath=str(models[0].path)))
    time.sleep(0.2)
    runtime.runtime.unloadModel(rt.UnloadModelRequest(modelId="m"))  # OK: it was loading
    with pytest.raises(grpc.RpcError) as info:
        future.result(timeout=5)
    assert code_of(info.value) == grpc.StatusCode.ABORTED
    assert runtime.loaded() == []


def test_bad_inference_requests(start_runtime: StartRuntime, models: list[GeneratedModel]) -> None:
    runtime = start_runtime()
    runtime.load("m", models[0].path)
    for method in ("ModelInfer", "ModelMetadata", "RepositoryIndex"):
        with pytest.raises(grpc.RpcError) as info:
            runtime.raw_unary(method)(b"\x0a\xff\x01")  # field 1, claims 255 bytes, has 1
        assert code_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("malformed ")

    wrong_width = make_infer_request("m", [[1.0, 2.0, 3.0]])
    wrong_type = make_infer_request("m", ROWS)
    wrong_type.inputs[0].datatype = "INT32"
    for request in (wrong_width, wrong_type, pb.ModelInferRequest(model_name="m")):
        with pytest.raises(grpc.RpcError) as info:
            runtime.inference.ModelInfer(request)
        assert code_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT

    with pytest.raises(grpc.RpcError) as info:
        runtime.inference.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="m"))
    assert code_of(info.value) == grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(grpc.RpcError) as info:
        runtime.raw_unary("NoSuchMethod")(b"")
    assert code_of(info.value) == grpc.StatusCode.UNIMPLEMENTED


def test_stream_infer_answers_every_request(start_runtime: StartRuntime, models: list[GeneratedModel]) -> None:
    runtime = start_runtime()
    runtime.load("a", models[0].path)
    runtime.load("b", models[1].path)
    requests = [
        make_infer_request("a", ROWS).SerializeToString(),
        make_infer_request("b", ROWS[:1]).SerializeToString(),
        b"\x0a\xff\x01",
        make_infer_request("gone", ROWS).SerializeToString(),
        make_infer_request("a", [[0.0, 0.0, 0.0, 0.0]]).SerializeToString(),
    ]
    stream = runtime.serving_channel.stream_stream(
        "/inference.GRPCInferenceService/ModelStreamInfer",
        response_deserializer=pb.ModelStreamInferResponse.FromString,
    )
    responses = list(stream(iter(requests), timeout=10))
    assert len(responses) == 5
    assert_rows_close(decode_infer_response(responses[0].infer_response), expected(models[0], ROWS))
    assert responses[1].infer_response.model_name == "b"
    assert_rows_close(decode_infer_response(responses[1].infer_response), expected(models[1], ROWS[:1]))
    assert responses[2].error_message.startswith("malformed ModelInferRequest")
    assert responses[3].error_message == "model gone is not loaded"
    assert decode_infer_response(responses[4].infer_response)[0][0] == 0.0  # model index 0 answered


def test_repository_index_lists_loaded_models(
    start_runtime: StartRuntime, models: list[GeneratedModel], tmp_path: Path
) -> None:
    runtime = start_runtime()
    for model in reversed(models):
        runtime.load(model.id, model.path)
    runtime.load("echo", write_echo_model(tmp_path / "echo.json"))
    index = runtime.inference.RepositoryIndex(pb.RepositoryIndexRequest())
    assert [m.name for m in index.models] == sorted([*(m.id for m in models), "echo"])
    assert {m.state for m in index.models} == {"READY"}
    runtime.runtime.unloadModel(rt.UnloadModelRequest(modelId=models[0].id))
    assert models[0].id not in runtime.loaded()

    echoed = runtime.inference.ModelInfer(make_echo_request("echo", 10_000))
    payload = make_echo_request("x", 10_000).raw_input_contents[0]
    assert (echoed.model_name, echoed.raw_output_contents[0]) == ("echo", payload)


def test_unix_socket_and_graceful_stop(
    start_runtime: StartRuntime, models: list[GeneratedModel], socket_dir: Path
) -> None:
    sock = socket_dir / "rt.sock"
    runtime = start_runtime(socket=sock)
    assert runtime.load("m", models[2].path).sizeInBytes == 3 << 20
    resp = runtime.inference.ModelInfer(make_infer_request("m", ROWS))
    assert_rows_close(decode_infer_response(resp), expected(models[2], ROWS))
    runtime.close()
    assert runtime.child.stop() == 0  # SIGTERM: graceful, exit status 0
    assert not sock.exists()


def test_separate_serving_endpoint(start_runtime: StartRuntime, models: list[GeneratedModel]) -> None:
    runtime = start_runtime(serving_port=True)
    assert runtime.serving_target != runtime.target
    runtime.load("m", models[0].path)
    resp = runtime.inference.ModelInfer(make_infer_request("m", ROWS[:1]))
    assert unpack_f32(resp.raw_output_contents[0]) == pytest.approx(expected(models[0], ROWS[:1])[0], rel=1e-5)
    # Each endpoint serves only its own service: the SPI is unreachable via inference and vice versa.
    with pytest.raises(grpc.RpcError) as info:
        runtime.channel.unary_unary("/inference.GRPCInferenceService/ServerLive")(b"")
    assert code_of(info.value) == grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(grpc.RpcError) as info:
        runtime.serving_channel.unary_unary("/mmesh.ModelRuntime/runtimeStatus")(b"")
    assert code_of(info.value) == grpc.StatusCode.UNIMPLEMENTED


def test_command_line_needs_a_management_endpoint() -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--serving-port=1"])
    assert info.value.code == 2
    opts = parse_args(["--port=1", "--fail-load=a.c", "--zero-size"])
    assert opts.config.fail_load is not None and opts.config.fail_load.search("xabcx")
    assert opts.config.zero_size and opts.serving.port is None
