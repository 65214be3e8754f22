"""Which methods are carried and how: runtime allow-list, dataplane config, shapes."""

from __future__ import annotations

import pytest

from meshd.serving.proxy.methods import DataplaneConfig, MethodTable, RpcConfig

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


def test_runtime_allow_list_and_injection_paths() -> None:
    table = MethodTable({"inference.GRPCInferenceService/ModelInfer": (1,), STREAM: ()}, allow_any=False)
    infer = table.spec(INFER)
    assert infer is not None and infer.inject == (1,) and not infer.streaming
    stream = table.spec(STREAM)
    assert stream is not None and stream.streaming and stream.inject == ()
    assert table.spec("/inference.GRPCInferenceService/ModelReady") is None
    assert table.spec(INFER) is infer  # made once


def test_any_method_with_allow_any_or_an_empty_map_but_never_the_spi() -> None:
    for table in (MethodTable({}, allow_any=False), MethodTable({INFER: (1,)}, allow_any=True)):
        assert table.spec("/custom.Svc/Predict") is not None
        for forbidden in (
            "mmesh.ModelRuntime/unloadModel",  # no leading slash: some servers accept it
            "//mmesh.ModelRuntime/unloadModel",
            "/mmesh.ModelRuntime/unloadModel/x",
            "/inference.GRPCInferenceService/RepositoryModelUnload",  # the runtime's own repository API
            "/mmesh.ModelRuntime/loadModel",
            "/mmesh.ModelMesh/registerModel",
            "/meshd.peer.MeshPeer/InternalOperation",
            "/meshd.admin.MeshAdmin/futureMethod",
            "/grpc.health.v1.Health/Check",
        ):
            assert table.spec(forbidden) is None


def test_dataplane_config_extraction_streaming_and_allow_other_rpcs() -> None:
    config = DataplaneConfig.parse(
        '{"rpcConfigs": {"custom.Svc/Predict": {"idExtractionPath": [2, 1], "vModelId": true},'
        ' "custom.Svc/Generate": {"streaming": true}}, "allowOtherRpcs": false}'
    )
    assert config.rpc_configs["/custom.Svc/Predict"] == RpcConfig((2, 1), True, False)
    table = MethodTable({}, allow_any=True, dataplane=config)
    predict = table.spec("/custom.Svc/Predict")
    assert predict is not None and predict.extract == (2, 1) and predict.extract_vmodel
    generate = table.spec("/custom.Svc/Generate")
    assert generate is not None and generate.streaming
    assert table.spec("/custom.Svc/Other") is None  # allowOtherRpcs false
    # The runtime's allow-list still applies to configured methods.
    assert MethodTable({INFER: ()}, allow_any=False, dataplane=config).spec("/custom.Svc/Predict") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nope", "not valid JSON"),
        ("[]", "JSON object"),
        ('{"rpcConfig": {}}', "unknown keys"),
        ('{"allowOtherRpcs": "yes"}', "allowOtherRpcs"),
        ('{"rpcConfigs": []}', "rpcConfigs must be an object"),
        ('{"rpcConfigs": {"a.B/C": 1}}', "must be an object"),
        ('{"rpcConfigs": {"a.B/C": {"idExtractionPath": "1"}}}', "list of field numbers"),
        ('{"rpcConfigs": {"a.B/C": {"idExtractionPath": [0]}}}', "idExtractionPath"),
        ('{"rpcConfigs": {"a.B/C": {"idExtractionPath": [true]}}}', "list of field numbers"),
        ('{"rpcConfigs": {"a.B/C": {"vModelId": 1}}}', "vModelId"),
        ('{"rpcConfigs": {"a.B/C": {"extract": [1]}}}', "unknown keys"),
    ],
)
def test_bad_dataplane_config_is_refused_with_a_reason(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DataplaneConfig.parse(text)


def test_a_bad_runtime_injection_path_is_refused() -> None:
    with pytest.raises(ValueError, match="ModelInfer"):
        MethodTable({INFER: (0,)}, allow_any=False)


def test_kserve_methods_fall_back_to_the_body_model_name() -> None:
    table = MethodTable({}, allow_any=True)
    for method in ("ModelInfer", "ModelStreamInfer", "ModelMetadata", "ModelConfig"):
        spec = table.spec(f"/inference.GRPCInferenceService/{method}")
        assert spec is not None and spec.fallback == (1,) and spec.extract == ()
    custom = table.spec("/custom.Svc/Predict")
    assert custom is not None and custom.fallback == ()
